// Package llm is onceflow's seam to language model providers: a small Client interface,
// provider-neutral request and response types, and a typed *APIError that package retry
// can classify without knowing any provider.
//
// Implementations live in subpackages, one per dependency: openai (OpenAI and any
// OpenAI-compatible endpoint, through github.com/openai/openai-go/v3), anthropic
// (through github.com/anthropics/anthropic-sdk-go/v2), fake (in-process and
// deterministic, for unit tests of consumers) and fakeserver (an HTTP server speaking
// both providers' wire formats with injectable faults, behind `onceflow fake-llm`).
//
// Adapters turn their SDK's retries off: one layer, package retry, owns the policy, so
// four attempts mean four requests and not twelve. They map every SDK error with
// errors.As onto *APIError (status, provider type and code, Retry-After /
// retry-after-ms, x-should-retry, request id), pass transport errors through unchanged
// for retry.Classify, and report a response they cannot parse as a permanent error
// matching ErrMalformedResponse, never a panic.
package llm

import (
	"context"
	"encoding/json"
	"iter"
	"net/http"
	"strings"
)

// Client is a language model provider. Implementations are safe for concurrent use.
type Client interface {
	// Complete sends one request and returns the whole response. A provider's error
	// answer is an *APIError; transport errors (timeouts, resets) come back as they are
	// so that retry.Classify can read them; an unparseable answer matches
	// ErrMalformedResponse and is permanent.
	Complete(ctx context.Context, req *Request) (*Response, error)
	// Stream sends one request and yields the response as it arrives: text deltas,
	// then one final chunk (Done) with the finish reason, complete tool calls and usage.
	// An error ends the sequence as its last element; a stream that ends without a
	// finish reason yields an error wrapping io.ErrUnexpectedEOF (retryable). Stopping
	// the iteration early closes the connection.
	Stream(ctx context.Context, req *Request) iter.Seq2[Chunk, error]
}

// Role is who wrote a message.
type Role string

// The roles of a conversation.
const (
	RoleSystem    Role = "system"
	RoleUser      Role = "user"
	RoleAssistant Role = "assistant"
	// RoleTool carries a tool's result back to the model, with ToolCallID set.
	RoleTool Role = "tool"
)

// Message is one turn of the conversation.
type Message struct {
	Role    Role   `json:"role"`
	Content string `json:"content"`
	// ToolCalls are the calls an assistant message made (to replay a conversation).
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
	// ToolCallID names the call a RoleTool message answers.
	ToolCallID string `json:"tool_call_id,omitempty"`
}

// Tool is a function the model may call.
type Tool struct {
	Name        string `json:"name"`
	Description string `json:"description,omitempty"`
	// Parameters is the JSON Schema of the arguments (an object schema); nil means none.
	Parameters json.RawMessage `json:"parameters,omitempty"`
}

// ToolCall is the model's request to call a tool.
type ToolCall struct {
	// ID is the provider's id of the call. Derive downstream idempotency keys from it
	// only if the provider keeps it stable for a repeated request (see
	// fakeserver's --tool-call-ids); otherwise from Name and Arguments.
	ID   string `json:"id"`
	Name string `json:"name"`
	// Arguments is the JSON object of arguments, as the model wrote it.
	Arguments string `json:"arguments"`
}

// Request is one model call.
type Request struct {
	// Model is the model name; empty means the adapter's configured default.
	Model    string    `json:"model,omitempty"`
	Messages []Message `json:"messages"`
	// Temperature is the sampling temperature; nil leaves the provider's default.
	Temperature *float64 `json:"temperature,omitempty"`
	// MaxTokens bounds the output; 0 leaves the adapter's default.
	MaxTokens int    `json:"max_tokens,omitempty"`
	Tools     []Tool `json:"tools,omitempty"`
	// IdempotencyKey, when set, is sent as the Idempotency-Key header so a provider (or
	// onceflow gateway) that honours it replays the first response to a repeat. Derive
	// it from the work (job id, tool-call id), never per attempt.
	IdempotencyKey string `json:"-"`
}

// Usage counts tokens.
type Usage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

// Finish reasons, in OpenAI's vocabulary; adapters map other providers' reasons onto
// these (Anthropic's end_turn is FinishStop, tool_use FinishToolCalls, max_tokens
// FinishLength) and pass unknown ones through.
const (
	FinishStop          = "stop"
	FinishLength        = "length"
	FinishToolCalls     = "tool_calls"
	FinishContentFilter = "content_filter"
)

// Response is a complete model answer.
type Response struct {
	// ID is the provider's response id (chatcmpl-..., msg_...). A provider that honours
	// Idempotency-Key returns the same ID for a repeated key.
	ID           string     `json:"id"`
	Model        string     `json:"model"`
	Content      string     `json:"content"`
	ToolCalls    []ToolCall `json:"tool_calls,omitempty"`
	FinishReason string     `json:"finish_reason"`
	Usage        Usage      `json:"usage"`
	// RequestID is the provider's request id header (x-request-id, request-id), for
	// support tickets.
	RequestID string `json:"request_id,omitempty"`
	// Raw is the response body exactly as received, for byte-identical replay. For a
	// collected stream it is each event's data, one per line.
	Raw []byte `json:"-"`
	// RateLimit is what the answer's headers said of the provider's rate limits (see
	// ParseRateLimit); nil when they said nothing, and for an answer replayed from a
	// record.
	RateLimit *RateLimit `json:"-"`
}

// Chunk is one piece of a streamed answer.
type Chunk struct {
	// Content is the text delta of this chunk.
	Content string
	// ID is the provider's response id, once known.
	ID string
	// RequestID is the provider's request id header.
	RequestID string
	// Raw is this event's data as received; nil for the final chunk.
	Raw []byte
	// Done marks the final chunk, which carries FinishReason, ToolCalls and Usage.
	Done         bool
	FinishReason string
	ToolCalls    []ToolCall
	Usage        *Usage
	// RateLimit, on the final chunk, is what the stream's response headers said of the
	// provider's rate limits; nil when they said nothing.
	RateLimit *RateLimit
}

// Collect drains a stream into a Response: the concatenated content, the final chunk's
// finish reason, tool calls and usage, and Raw as every event's data, one per line. It
// returns the first error the stream yields, with the partial response so far.
func Collect(seq iter.Seq2[Chunk, error]) (*Response, error) {
	resp := &Response{}
	var content strings.Builder
	for c, err := range seq {
		if err != nil {
			resp.Content = content.String()
			return resp, err
		}
		content.WriteString(c.Content)
		if c.ID != "" {
			resp.ID = c.ID
		}
		if c.RequestID != "" {
			resp.RequestID = c.RequestID
		}
		if c.Raw != nil {
			resp.Raw = append(append(resp.Raw, c.Raw...), '\n')
		}
		if c.Done {
			resp.FinishReason = c.FinishReason
			resp.ToolCalls = c.ToolCalls
			resp.RateLimit = c.RateLimit
			if c.Usage != nil {
				resp.Usage = *c.Usage
			}
		}
	}
	resp.Content = content.String()
	return resp, nil
}

// Float returns a pointer to v, for Request.Temperature.
func Float(v float64) *float64 { return &v }

// DefaultMaxIdleConnsPerHost is how many idle connections the adapters keep to their
// provider. net/http keeps 2, so a worker with dozens of calls in flight to one host would
// re-dial (and re-handshake TLS) for most of them; one worker process may hold
// ONCEFLOW_WORKER_CONCURRENCY calls at once.
const DefaultMaxIdleConnsPerHost = 256

// NewHTTPClient returns the HTTP client the adapters use by default: a clone of
// http.DefaultTransport keeping DefaultMaxIdleConnsPerHost idle connections per host, and
// no overall timeout (each call's context deadline bounds it).
func NewHTTPClient() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns = max(t.MaxIdleConns, DefaultMaxIdleConnsPerHost)
	t.MaxIdleConnsPerHost = DefaultMaxIdleConnsPerHost
	return &http.Client{Transport: t}
}
