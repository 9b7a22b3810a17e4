// Package anthropic is the llm.Client for Anthropic's Messages API, built on
// github.com/anthropics/anthropic-sdk-go/v2.
//
// It follows package openai: the SDK's retries are off (option.WithMaxRetries(0)),
// errors are mapped with errors.As on the SDK's *anthropic.Error onto *llm.APIError
// (status, error type, error.details.error_code, retry-after, x-should-retry,
// request-id), including error events inside a stream (overloaded_error), transport
// errors pass through for retry.Classify, and an unparseable answer is a permanent
// error matching llm.ErrMalformedResponse. The SDK's environment defaults
// (ANTHROPIC_API_KEY, profiles) are not read: Config says everything.
//
// Mapping: system messages become the system prompt, tool results become user
// messages of tool_result blocks (consecutive ones merged), and stop reasons are
// reported in OpenAI's vocabulary (end_turn is llm.FinishStop, tool_use
// llm.FinishToolCalls, max_tokens llm.FinishLength). Request.Temperature is not sent:
// the v2 SDK no longer has the parameter.
//
// Client.Batches is the Message Batches API for onceflow's batch lane
// (onceflow.BatchAPI): the same requests as Complete sends, answered at the batch price.
package anthropic

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"strings"
	"time"

	asdk "github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// Provider is the name this adapter gives its errors (llm.APIError.Provider).
const Provider = "anthropic"

// Defaults of Config's fields.
const (
	DefaultBaseURL   = "https://api.anthropic.com"
	DefaultModel     = "claude-sonnet-4-5"
	DefaultMaxTokens = 1024
)

// Config configures a Client.
type Config struct {
	// BaseURL is the API root, without /v1 (http://127.0.0.1:9090 for onceflow
	// fake-llm). Default: https://api.anthropic.com.
	BaseURL string
	// APIKey is sent as x-api-key. Default: none. Never logged.
	APIKey string
	// Model is used when a request names none. Default: claude-sonnet-4-5.
	Model string
	// MaxTokens is used when a request sets none (the API requires it). Default: 1024.
	MaxTokens int
	// HTTPClient sends the requests. Default: a client on a clone of
	// http.DefaultTransport keeping llm.DefaultMaxIdleConnsPerHost idle connections (not
	// net/http's 2), with no overall timeout: each call's context deadline
	// bounds it.
	HTTPClient *http.Client
	// Options are extra SDK request options, applied after the adapter's own.
	Options []option.RequestOption
}

// Client is the Anthropic adapter. It is safe for concurrent use.
type Client struct {
	sdk       asdk.Client
	baseURL   string // Config.BaseURL or its default: where a batch's results are read
	model     string
	maxTokens int
}

var _ llm.Client = (*Client)(nil)

// New returns a Client for cfg.
func New(cfg Config) *Client {
	hc := cfg.HTTPClient
	if hc == nil {
		hc = llm.NewHTTPClient()
	}
	baseURL := cmp.Or(cfg.BaseURL, DefaultBaseURL)
	opts := []option.RequestOption{
		option.WithoutEnvironmentDefaults(),
		option.WithBaseURL(baseURL),
		option.WithHTTPClient(hc),
		option.WithMaxRetries(0), // one layer owns retries: package retry
	}
	if cfg.APIKey != "" {
		opts = append(opts, option.WithAPIKey(cfg.APIKey))
	}
	opts = append(opts, cfg.Options...)
	maxTokens := cfg.MaxTokens
	if maxTokens <= 0 {
		maxTokens = DefaultMaxTokens
	}
	return &Client{sdk: asdk.NewClient(opts...), baseURL: baseURL, model: cmp.Or(cfg.Model, DefaultModel), maxTokens: maxTokens}
}

// Complete implements llm.Client. Response.Raw holds the body exactly as received.
func (c *Client) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	params, err := c.params(req)
	if err != nil {
		return nil, err
	}
	var raw []byte
	var httpResp *http.Response
	opts := append(callOptions(req, &httpResp), option.WithResponseBodyInto(&raw))
	if _, err := c.sdk.Messages.New(ctx, params, opts...); err != nil {
		return nil, mapError(err, httpResp)
	}
	requestID := requestIDOf(httpResp)
	resp, err := DecodeMessage(raw)
	if err != nil {
		return nil, llm.Malformed(Provider, requestID, err)
	}
	resp.RequestID = requestID
	if httpResp != nil {
		resp.RateLimit = llm.RateLimitOf(httpResp.Header, time.Now())
	}
	return resp, nil
}

// Stream implements llm.Client. Each chunk's Raw is its event's data.
func (c *Client) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		params, err := c.params(req)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		var httpResp *http.Response
		stream := c.sdk.Messages.NewStreaming(ctx, params, callOptions(req, &httpResp)...)
		defer stream.Close()
		requestID := requestIDOf(httpResp)

		type toolAcc struct {
			id, name string
			input    strings.Builder
		}
		var (
			calls   []*toolAcc
			byIndex = map[int64]*toolAcc{}
			id      string
			stop    string
			usage   llm.Usage
			stopped bool
		)
		for stream.Next() {
			ev := stream.Current()
			var text string
			switch ev.Type {
			case "message_start":
				id = ev.Message.ID
				usage.InputTokens = int(ev.Message.Usage.InputTokens)
			case "content_block_start":
				if ev.ContentBlock.Type == "tool_use" {
					acc := &toolAcc{id: ev.ContentBlock.ID, name: ev.ContentBlock.Name}
					byIndex[ev.Index] = acc
					calls = append(calls, acc)
				}
			case "content_block_delta":
				switch ev.Delta.Type {
				case "text_delta":
					text = ev.Delta.Text
				case "input_json_delta":
					if acc := byIndex[ev.Index]; acc != nil {
						acc.input.WriteString(ev.Delta.PartialJSON)
					}
				}
			case "message_delta":
				stop = string(ev.Delta.StopReason)
				usage.OutputTokens = int(ev.Usage.OutputTokens)
			case "message_stop":
				stopped = true
			}
			if !yield(llm.Chunk{Content: text, ID: id, RequestID: requestID, Raw: []byte(ev.RawJSON())}, nil) {
				return
			}
		}
		if err := stream.Err(); err != nil {
			yield(llm.Chunk{}, mapStreamError(err, httpResp, requestID))
			return
		}
		if !stopped || stop == "" {
			yield(llm.Chunk{}, fmt.Errorf("%s: stream ended before message_stop: %w", Provider, io.ErrUnexpectedEOF))
			return
		}
		final := llm.Chunk{Done: true, ID: id, RequestID: requestID, FinishReason: finishReason(stop), Usage: &usage}
		if httpResp != nil {
			final.RateLimit = llm.RateLimitOf(httpResp.Header, time.Now())
		}
		for _, acc := range calls {
			final.ToolCalls = append(final.ToolCalls, llm.ToolCall{ID: acc.id, Name: acc.name, Arguments: cmp.Or(acc.input.String(), "{}")})
		}
		yield(final, nil)
	}
}

func callOptions(req *llm.Request, httpResp **http.Response) []option.RequestOption {
	opts := []option.RequestOption{option.WithResponseInto(httpResp)}
	if req.IdempotencyKey != "" {
		opts = append(opts, option.WithHeader("Idempotency-Key", req.IdempotencyKey))
	}
	return opts
}

// params maps an llm.Request onto the SDK's parameters; its errors are permanent.
func (c *Client) params(req *llm.Request) (asdk.MessageNewParams, error) {
	p := asdk.MessageNewParams{Model: asdk.Model(cmp.Or(req.Model, c.model)), MaxTokens: int64(c.maxTokens)}
	if req.MaxTokens > 0 {
		p.MaxTokens = int64(req.MaxTokens)
	}
	toolResults := -1 // index in p.Messages of the user message collecting tool results
	for i, m := range req.Messages {
		switch m.Role {
		case llm.RoleSystem:
			p.System = append(p.System, asdk.TextBlockParam{Text: m.Content})
			continue
		case llm.RoleUser:
			p.Messages = append(p.Messages, asdk.NewUserMessage(asdk.NewTextBlock(m.Content)))
		case llm.RoleTool:
			block := asdk.NewToolResultBlock(m.ToolCallID, m.Content, false)
			if toolResults == len(p.Messages)-1 && toolResults >= 0 {
				last := p.Messages[toolResults].OfUser
				last.Content = append(last.Content, block)
				continue
			}
			p.Messages = append(p.Messages, asdk.NewUserMessage(block))
			toolResults = len(p.Messages) - 1
			continue
		case llm.RoleAssistant:
			var blocks []asdk.ContentBlockParamUnion
			if m.Content != "" {
				blocks = append(blocks, asdk.NewTextBlock(m.Content))
			}
			for _, tc := range m.ToolCalls {
				args := cmp.Or(tc.Arguments, "{}")
				if !json.Valid([]byte(args)) {
					return p, retry.Permanent(fmt.Errorf("%s: message %d: tool call %q arguments are not JSON", Provider, i, tc.ID))
				}
				blocks = append(blocks, asdk.NewToolUseBlock(tc.ID, json.RawMessage(args), tc.Name))
			}
			p.Messages = append(p.Messages, asdk.NewAssistantMessage(blocks...))
		default:
			return p, retry.Permanent(fmt.Errorf("%s: message %d: unknown role %q", Provider, i, m.Role))
		}
		toolResults = -1
	}
	for _, t := range req.Tools {
		schema := asdk.ToolInputSchemaParam{}
		if len(t.Parameters) > 0 {
			var s map[string]any
			if err := json.Unmarshal(t.Parameters, &s); err != nil {
				return p, retry.Permanent(fmt.Errorf("%s: tool %q: parameters are not a JSON object: %w", Provider, t.Name, err))
			}
			schema.Properties = s["properties"]
			if req, ok := s["required"].([]any); ok {
				for _, r := range req {
					if name, ok := r.(string); ok {
						schema.Required = append(schema.Required, name)
					}
				}
			}
			for k, v := range s {
				if k != "properties" && k != "required" && k != "type" {
					if schema.ExtraFields == nil {
						schema.ExtraFields = map[string]any{}
					}
					schema.ExtraFields[k] = v
				}
			}
		}
		tp := &asdk.ToolParam{Name: t.Name, InputSchema: schema}
		if t.Description != "" {
			tp.Description = asdk.String(t.Description)
		}
		p.Tools = append(p.Tools, asdk.ToolUnionParam{OfTool: tp})
	}
	return p, nil
}

// DecodeMessage parses a Messages API answer strictly: a JSON object of type
// "message" with a content array; tool_use blocks must name their tool. It never
// panics.
func DecodeMessage(raw []byte) (*llm.Response, error) {
	var m struct {
		ID      string `json:"id"`
		Type    string `json:"type"`
		Model   string `json:"model"`
		Content []struct {
			Type  string          `json:"type"`
			Text  string          `json:"text"`
			ID    string          `json:"id"`
			Name  string          `json:"name"`
			Input json.RawMessage `json:"input"`
		} `json:"content"`
		StopReason string `json:"stop_reason"`
		Usage      struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("decode message: %w", err)
	}
	if dec.More() {
		return nil, errors.New("decode message: trailing data after the JSON object")
	}
	if m.Type != "message" || m.Content == nil {
		return nil, fmt.Errorf("decode message: type %q with no content array", m.Type)
	}
	resp := &llm.Response{ID: m.ID, Model: m.Model, FinishReason: finishReason(m.StopReason), Raw: raw,
		Usage: llm.Usage{InputTokens: m.Usage.InputTokens, OutputTokens: m.Usage.OutputTokens}}
	var text strings.Builder
	for i, b := range m.Content {
		switch b.Type {
		case "text":
			text.WriteString(b.Text)
		case "tool_use":
			if b.Name == "" {
				return nil, fmt.Errorf("decode message: tool_use block %d has no name", i)
			}
			args := string(bytes.TrimSpace(b.Input))
			if args == "" || args == "null" {
				args = "{}"
			}
			resp.ToolCalls = append(resp.ToolCalls, llm.ToolCall{ID: b.ID, Name: b.Name, Arguments: args})
		}
	}
	resp.Content = text.String()
	return resp, nil
}

// finishReason maps Anthropic's stop reasons onto OpenAI's vocabulary.
func finishReason(stop string) string {
	switch stop {
	case "end_turn", "stop_sequence", "pause_turn":
		return llm.FinishStop
	case "max_tokens", "model_context_window_exceeded":
		return llm.FinishLength
	case "tool_use":
		return llm.FinishToolCalls
	case "refusal":
		return llm.FinishContentFilter
	}
	return stop
}

// mapError turns an SDK error into an *llm.APIError when the server answered with an
// error (an error status, or an error event inside a stream), else wraps it.
func mapError(err error, httpResp *http.Response) error {
	var apiErr *asdk.Error
	if errors.As(err, &apiErr) {
		var h http.Header
		if apiErr.Response != nil {
			h = apiErr.Response.Header
		}
		body := []byte(apiErr.RawJSON())
		if len(body) == 0 && apiErr.StatusCode >= 400 {
			body = llm.PeekBody(apiErr.Response)
		}
		e := llm.NewAPIError(Provider, apiErr.StatusCode, h, body, time.Now(), err)
		e.Type = cmp.Or(e.Type, string(apiErr.Type()))
		e.Code = cmp.Or(e.Code, string(apiErr.ErrorCode()))
		e.RequestID = cmp.Or(e.RequestID, apiErr.RequestID)
		return creditCode(e)
	}
	if httpResp != nil && httpResp.StatusCode >= 400 {
		return creditCode(llm.NewAPIError(Provider, httpResp.StatusCode, httpResp.Header, llm.PeekBody(httpResp), time.Now(), err))
	}
	return fmt.Errorf("%s: %w", Provider, err)
}

// CodeCreditBalanceTooLow is the code mapError gives Anthropic's answer to an
// organisation out of prepaid credits, which carries none of its own: HTTP 400
// invalid_request_error, "Your credit balance is too low to access the Anthropic API".
// It is a quota marker (retry.IsQuota), so the answer stops the provider instead of
// dead-lettering each job that meets it.
const CodeCreditBalanceTooLow = "credit_balance_too_low"

// creditCode sets CodeCreditBalanceTooLow on e when it is that answer. This is the one
// place that reads Anthropic's message text.
func creditCode(e *llm.APIError) *llm.APIError {
	if e.Code == "" && e.StatusCode == http.StatusBadRequest && strings.Contains(strings.ToLower(e.Message), "credit balance is too low") {
		e.Code = CodeCreditBalanceTooLow
	}
	return e
}

// mapStreamError maps an error that ended a stream.
func mapStreamError(err error, httpResp *http.Response, requestID string) error {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	if errors.As(err, &syn) || errors.As(err, &typ) {
		return llm.Malformed(Provider, requestID, err)
	}
	return mapError(err, httpResp)
}

func requestIDOf(resp *http.Response) string {
	if resp == nil {
		return ""
	}
	return resp.Header.Get("Request-Id")
}
