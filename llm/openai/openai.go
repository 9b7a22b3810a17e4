// Package openai is the llm.Client for OpenAI and any OpenAI-compatible endpoint (Chat
// Completions API), built on github.com/openai/openai-go/v3.
//
// The SDK's own retries are off (option.WithMaxRetries(0)): package retry owns the
// policy, so a delivery's four attempts are four requests, not twelve. Errors are
// mapped with errors.As on the SDK's *openai.Error onto *llm.APIError, keeping the
// status, error type and code, Retry-After / retry-after-ms, x-should-retry and
// x-request-id; an error answer whose body the SDK cannot parse (an HTML 502 from a
// proxy) still becomes an *llm.APIError with its status. Transport errors, the
// per-call context deadline included, pass through wrapped for retry.Classify. A
// response that is not a chat completion is a permanent error matching
// llm.ErrMalformedResponse.
//
// The per-call timeout is the context's deadline: the SDK and net/http honour it for
// the whole exchange, reading the body included, so a server that drips one byte a
// second cannot hold a call open past it.
package openai

import (
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

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/ssestream"
	"github.com/openai/openai-go/v3/shared"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/internal/chatwire"
	"github.com/onceflow/onceflow/retry"
)

// Provider is the name this adapter gives its errors (llm.APIError.Provider).
const Provider = "openai"

// Defaults of Config's fields.
const (
	DefaultBaseURL = "https://api.openai.com/v1"
	DefaultModel   = "gpt-4.1-mini"
)

// Config configures a Client.
type Config struct {
	// BaseURL is the API root, /v1 included (http://127.0.0.1:9090/v1 for onceflow
	// fake-llm). Default: https://api.openai.com/v1.
	BaseURL string
	// APIKey is sent as a bearer token. Default: none (the SDK then falls back to
	// OPENAI_API_KEY). Never logged.
	APIKey string
	// Model is used when a request names none. Default: gpt-4.1-mini.
	Model string
	// HTTPClient sends the requests. Default: a client on a clone of
	// http.DefaultTransport keeping llm.DefaultMaxIdleConnsPerHost idle connections (not
	// net/http's 2), with no overall timeout: each call's context deadline
	// bounds it.
	HTTPClient *http.Client
	// Options are extra SDK request options (organization, project, headers), applied
	// after the adapter's own.
	Options []option.RequestOption
}

// Client is the OpenAI adapter. It is safe for concurrent use.
type Client struct {
	sdk   oai.Client
	model string
}

var _ llm.Client = (*Client)(nil)

// New returns a Client for cfg.
func New(cfg Config) *Client {
	hc := cfg.HTTPClient
	if hc == nil {
		hc = llm.NewHTTPClient()
	}
	opts := []option.RequestOption{
		option.WithBaseURL(cmp.Or(cfg.BaseURL, DefaultBaseURL)),
		option.WithHTTPClient(hc),
		option.WithMaxRetries(0), // one layer owns retries: package retry
	}
	if cfg.APIKey != "" {
		opts = append(opts, option.WithAPIKey(cfg.APIKey))
	}
	opts = append(opts, cfg.Options...)
	return &Client{sdk: oai.NewClient(opts...), model: cmp.Or(cfg.Model, DefaultModel)}
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
	if _, err := c.sdk.Chat.Completions.New(ctx, params, opts...); err != nil {
		return nil, mapError(err, httpResp)
	}
	requestID := requestIDOf(httpResp)
	resp, err := DecodeCompletion(raw)
	if err != nil {
		return nil, llm.Malformed(Provider, requestID, err)
	}
	resp.RequestID = requestID
	if httpResp != nil {
		resp.RateLimit = llm.RateLimitOf(httpResp.Header, time.Now())
	}
	if resp.Model == "" {
		resp.Model = string(params.Model)
	}
	return resp, nil
}

// Stream implements llm.Client. It asks for usage in the last event
// (stream_options.include_usage). Each chunk's Raw is its event's data.
func (c *Client) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		params, err := c.params(req)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		params.StreamOptions = oai.ChatCompletionStreamOptionsParam{IncludeUsage: oai.Bool(true)}
		var httpResp *http.Response
		stream := c.sdk.Chat.Completions.NewStreaming(ctx, params, callOptions(req, &httpResp)...)
		defer stream.Close()
		requestID := requestIDOf(httpResp)

		type toolAcc struct {
			id, name string
			args     strings.Builder
		}
		var (
			calls   []*toolAcc
			byIndex = map[int64]*toolAcc{}
			id      string
			finish  string
			usage   *llm.Usage
		)
		for stream.Next() {
			ch := stream.Current()
			if ch.ID != "" {
				id = ch.ID
			}
			var text strings.Builder
			for _, choice := range ch.Choices {
				if choice.Index != 0 {
					continue // only the first choice is requested
				}
				text.WriteString(choice.Delta.Content)
				for _, tc := range choice.Delta.ToolCalls {
					acc := byIndex[tc.Index]
					if acc == nil {
						acc = &toolAcc{}
						byIndex[tc.Index] = acc
						calls = append(calls, acc)
					}
					if tc.ID != "" {
						acc.id = tc.ID
					}
					if tc.Function.Name != "" {
						acc.name = tc.Function.Name
					}
					acc.args.WriteString(tc.Function.Arguments)
				}
				if choice.FinishReason != "" {
					finish = choice.FinishReason
				}
			}
			if ch.JSON.Usage.Valid() {
				usage = &llm.Usage{InputTokens: int(ch.Usage.PromptTokens), OutputTokens: int(ch.Usage.CompletionTokens)}
			}
			if !yield(llm.Chunk{Content: text.String(), ID: id, RequestID: requestID, Raw: []byte(ch.RawJSON())}, nil) {
				return
			}
		}
		if err := stream.Err(); err != nil {
			yield(llm.Chunk{}, mapStreamError(err, httpResp, requestID))
			return
		}
		if finish == "" {
			yield(llm.Chunk{}, fmt.Errorf("%s: stream ended before a finish reason: %w", Provider, io.ErrUnexpectedEOF))
			return
		}
		final := llm.Chunk{Done: true, ID: id, RequestID: requestID, FinishReason: finish, Usage: usage}
		if httpResp != nil {
			final.RateLimit = llm.RateLimitOf(httpResp.Header, time.Now())
		}
		for _, acc := range calls {
			final.ToolCalls = append(final.ToolCalls, llm.ToolCall{ID: acc.id, Name: acc.name, Arguments: acc.args.String()})
		}
		yield(final, nil)
	}
}

// callOptions are the per-call SDK options: capture the response, send the key.
func callOptions(req *llm.Request, httpResp **http.Response) []option.RequestOption {
	opts := []option.RequestOption{option.WithResponseInto(httpResp)}
	if req.IdempotencyKey != "" {
		opts = append(opts, option.WithHeader("Idempotency-Key", req.IdempotencyKey))
	}
	return opts
}

// params maps an llm.Request onto the SDK's parameters. Its errors are permanent: the
// request itself is wrong.
func (c *Client) params(req *llm.Request) (oai.ChatCompletionNewParams, error) {
	p := oai.ChatCompletionNewParams{Model: shared.ChatModel(cmp.Or(req.Model, c.model))}
	if req.Temperature != nil {
		p.Temperature = oai.Float(*req.Temperature)
	}
	if req.MaxTokens > 0 {
		p.MaxCompletionTokens = oai.Int(int64(req.MaxTokens))
	}
	for i, m := range req.Messages {
		switch m.Role {
		case llm.RoleSystem:
			p.Messages = append(p.Messages, oai.SystemMessage(m.Content))
		case llm.RoleUser:
			p.Messages = append(p.Messages, oai.UserMessage(m.Content))
		case llm.RoleTool:
			p.Messages = append(p.Messages, oai.ToolMessage(m.Content, m.ToolCallID))
		case llm.RoleAssistant:
			a := oai.ChatCompletionAssistantMessageParam{}
			if m.Content != "" || len(m.ToolCalls) == 0 {
				a.Content.OfString = oai.String(m.Content)
			}
			for _, tc := range m.ToolCalls {
				a.ToolCalls = append(a.ToolCalls, oai.ChatCompletionMessageToolCallUnionParam{OfFunction: &oai.ChatCompletionMessageFunctionToolCallParam{
					ID: tc.ID, Function: oai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: tc.Name, Arguments: tc.Arguments}}})
			}
			p.Messages = append(p.Messages, oai.ChatCompletionMessageParamUnion{OfAssistant: &a})
		default:
			return p, retry.Permanent(fmt.Errorf("%s: message %d: unknown role %q", Provider, i, m.Role))
		}
	}
	for _, t := range req.Tools {
		fd := shared.FunctionDefinitionParam{Name: t.Name}
		if t.Description != "" {
			fd.Description = oai.String(t.Description)
		}
		if len(t.Parameters) > 0 {
			var schema map[string]any
			if err := json.Unmarshal(t.Parameters, &schema); err != nil {
				return p, retry.Permanent(fmt.Errorf("%s: tool %q: parameters are not a JSON object: %w", Provider, t.Name, err))
			}
			fd.Parameters = schema
		}
		p.Tools = append(p.Tools, oai.ChatCompletionFunctionTool(fd))
	}
	return p, nil
}

// DecodeCompletion parses a chat.completion body strictly: it must be a JSON object
// with at least one choice, each tool call naming its function. It never panics.
func DecodeCompletion(raw []byte) (*llm.Response, error) { return chatwire.Decode(raw) }

// mapError turns an SDK error into an *llm.APIError when the server answered with an
// error status, and otherwise wraps it (transport errors, context deadlines).
func mapError(err error, httpResp *http.Response) error {
	var apiErr *oai.Error
	if errors.As(err, &apiErr) {
		resp := apiErr.Response
		var h http.Header
		var body []byte
		if resp != nil {
			h = resp.Header
			body = llm.PeekBody(resp)
		}
		e := llm.NewAPIError(Provider, apiErr.StatusCode, h, body, time.Now(), err)
		e.Type, e.Code, e.Param = cmp.Or(e.Type, apiErr.Type), cmp.Or(e.Code, apiErr.Code), cmp.Or(e.Param, apiErr.Param)
		return e
	}
	if httpResp != nil && httpResp.StatusCode >= 400 {
		// An error answer whose body the SDK could not parse (an HTML page from a proxy).
		return llm.NewAPIError(Provider, httpResp.StatusCode, httpResp.Header, llm.PeekBody(httpResp), time.Now(), err)
	}
	return fmt.Errorf("%s: %w", Provider, err)
}

// mapStreamError maps an error that ended a stream: an HTTP error answer, an error
// event inside the stream, an undecodable event, or a transport error.
func mapStreamError(err error, httpResp *http.Response, requestID string) error {
	var se *ssestream.StreamError
	if errors.As(err, &se) {
		status := http.StatusOK
		var h http.Header
		if httpResp != nil {
			status, h = httpResp.StatusCode, httpResp.Header
		}
		return llm.NewAPIError(Provider, status, h, se.Event.Data, time.Now(), err)
	}
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
	return resp.Header.Get("X-Request-Id")
}
