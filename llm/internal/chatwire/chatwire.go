// Package chatwire reads OpenAI's Chat Completions wire format without the SDK, for the
// packages that need an answer's fields but not a client (llm/openai's
// DecodeCompletion, llm/probe), so that a program using only those does not link
// github.com/openai/openai-go.
package chatwire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/llm"
)

// Decode parses a chat.completion body strictly: it must be a JSON object
// with at least one choice, each tool call naming its function. It never panics.
func Decode(raw []byte) (*llm.Response, error) {
	var c struct {
		ID      string `json:"id"`
		Model   string `json:"model"`
		Choices []struct {
			FinishReason string `json:"finish_reason"`
			Message      struct {
				Content   *string `json:"content"`
				ToolCalls []struct {
					ID       string `json:"id"`
					Function struct {
						Name      string `json:"name"`
						Arguments string `json:"arguments"`
					} `json:"function"`
				} `json:"tool_calls"`
			} `json:"message"`
		} `json:"choices"`
		Usage *struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("decode chat completion: %w", err)
	}
	if dec.More() {
		return nil, errors.New("decode chat completion: trailing data after the JSON object")
	}
	if len(c.Choices) == 0 {
		return nil, errors.New("chat completion has no choices")
	}
	first := c.Choices[0]
	resp := &llm.Response{ID: c.ID, Model: c.Model, FinishReason: first.FinishReason, Raw: raw}
	if first.Message.Content != nil {
		resp.Content = *first.Message.Content
	}
	for i, tc := range first.Message.ToolCalls {
		if tc.Function.Name == "" {
			return nil, fmt.Errorf("chat completion tool call %d has no function name", i)
		}
		resp.ToolCalls = append(resp.ToolCalls, llm.ToolCall{ID: tc.ID, Name: tc.Function.Name, Arguments: tc.Function.Arguments})
	}
	if c.Usage != nil {
		resp.Usage = llm.Usage{InputTokens: c.Usage.PromptTokens, OutputTokens: c.Usage.CompletionTokens}
	}
	return resp, nil
}
