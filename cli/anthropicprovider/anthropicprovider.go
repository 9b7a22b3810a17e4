// Package anthropicprovider is the onceflow command's "anthropic" model provider
// (ONCEFLOW_LLM=anthropic, the Messages API): the adapter llm/anthropic, built from
// ONCEFLOW_LLM_BASE_URL, ONCEFLOW_LLM_MODEL and ANTHROPIC_API_KEY, and its Message
// Batches API for the batch lane (ONCEFLOW_SUMMARIES_LANE=batch). The onceflow binary
// lists it in cli.App.Providers; a program of one's own built on package cli lists it to
// let ONCEFLOW_LLM select it, and links the Anthropic SDK
// (github.com/anthropics/anthropic-sdk-go) only then.
package anthropicprovider

import (
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
)

// Provider returns the "anthropic" provider, for cli.App.Providers. The adapter's base
// URL has no /v1; ONCEFLOW_LLM_BASE_URL may have one, by habit, which it drops.
func Provider() cli.Provider {
	return cli.Provider{Name: anthropic.Provider, New: func(cfg *config.Config) (llm.Client, error) {
		return newClient(cfg), nil
	}, NewBatch: func(cfg *config.Config) (onceflow.BatchAPI, error) {
		return newClient(cfg).Batches(), nil
	}}
}

// newClient is the adapter cfg configures.
func newClient(cfg *config.Config) *anthropic.Client {
	return anthropic.New(anthropic.Config{BaseURL: strings.TrimSuffix(strings.TrimSuffix(cfg.LLMBaseURL, "/"), "/v1"),
		APIKey: cfg.AnthropicAPIKey, Model: cfg.LLMModel})
}
