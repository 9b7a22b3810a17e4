// Package openaiprovider is the onceflow command's "openai" model provider
// (ONCEFLOW_LLM=openai: OpenAI or any OpenAI-compatible endpoint, Chat Completions API):
// the adapter llm/openai, built from ONCEFLOW_LLM_BASE_URL, ONCEFLOW_LLM_MODEL and
// OPENAI_API_KEY. The onceflow binary lists it in cli.App.Providers; a program of one's
// own built on package cli lists it to let ONCEFLOW_LLM select it, and links the OpenAI
// SDK (github.com/openai/openai-go) only then.
package openaiprovider

import (
	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/openai"
)

// Provider returns the "openai" provider, for cli.App.Providers.
func Provider() cli.Provider {
	return cli.Provider{Name: openai.Provider, New: func(cfg *config.Config) (llm.Client, error) {
		return openai.New(openai.Config{BaseURL: cfg.LLMBaseURL, APIKey: cfg.OpenAIAPIKey, Model: cfg.LLMModel}), nil
	}, NewBatch: func(cfg *config.Config) (onceflow.BatchAPI, error) {
		return openai.New(openai.Config{BaseURL: cfg.LLMBaseURL, APIKey: cfg.OpenAIAPIKey, Model: cfg.LLMModel}).Batches(), nil
	}}
}
