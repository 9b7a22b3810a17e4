// Package fake is an in-process, deterministic llm.Client for unit tests of code that
// calls a model: the same request always gets the same response (id, content, tool
// calls), errors can be scripted, and every call is recorded. Its answers are the
// summaries and tool arguments fakeserver gives over HTTP (Summary, ToolArguments).
//
// It has no network and no faults of its own; to test retries, timeouts and SDK error
// mapping, run fakeserver behind a real adapter instead.
package fake

import (
	"cmp"
	"context"
	"encoding/json"
	"iter"
	"slices"
	"strings"
	"sync"

	"github.com/onceflow/onceflow/llm"
)

// DefaultModel is the model name reported when a request names none.
const DefaultModel = "gpt-4.1-mini"

// Client is the deterministic fake. The zero value is ready to use and safe for
// concurrent use.
type Client struct {
	mu       sync.Mutex
	requests []llm.Request
	fail     []error
}

var _ llm.Client = (*Client)(nil)

// New returns a Client.
func New() *Client { return &Client{} }

// FailNext makes the next len(errs) calls return errs in order instead of answering;
// a nil entry lets that call answer normally.
func (c *Client) FailNext(errs ...error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.fail = append(c.fail, errs...)
}

// Calls returns the number of Complete and Stream calls so far.
func (c *Client) Calls() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.requests)
}

// Requests returns a copy of every request received, in order.
func (c *Client) Requests() []llm.Request {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.requests)
}

// record counts the call and returns its scripted error, if any.
func (c *Client) record(req *llm.Request) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.requests = append(c.requests, *req)
	if len(c.fail) == 0 {
		return nil
	}
	err := c.fail[0]
	c.fail = c.fail[1:]
	return err
}

// Complete returns the deterministic response to req, a scripted error, or ctx's error.
func (c *Client) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := c.record(req); err != nil {
		return nil, err
	}
	return Answer(req), nil
}

// Stream yields Answer(req) word by word, then the final chunk.
func (c *Client) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		if err := ctx.Err(); err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if err := c.record(req); err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		resp := Answer(req)
		for _, piece := range SplitWords(resp.Content) {
			if err := ctx.Err(); err != nil {
				yield(llm.Chunk{}, err)
				return
			}
			if !yield(llm.Chunk{Content: piece, ID: resp.ID, RequestID: resp.RequestID}, nil) {
				return
			}
		}
		usage := resp.Usage
		yield(llm.Chunk{Done: true, ID: resp.ID, RequestID: resp.RequestID, FinishReason: resp.FinishReason, ToolCalls: resp.ToolCalls, Usage: &usage}, nil)
	}
}

// Answer is the deterministic response to req: a tool call to the first tool when
// req has tools, else the Summary of the prompt. Its ID, tool-call id and request id
// derive from RequestHash, and Raw is the answer in OpenAI's JSON wire format.
func Answer(req *llm.Request) *llm.Response {
	h := RequestHash(req)
	prompt := Prompt(req.Messages)
	resp := &llm.Response{
		ID:           "fake-" + h[:24],
		Model:        cmp.Or(req.Model, DefaultModel),
		FinishReason: llm.FinishStop,
		RequestID:    "req_fake_" + h[24:40],
	}
	var inChars int
	for _, m := range req.Messages {
		inChars += len([]rune(m.Content))
	}
	if len(req.Tools) > 0 {
		t := req.Tools[0]
		resp.ToolCalls = []llm.ToolCall{{ID: "call_" + h[:24], Name: t.Name, Arguments: ToolArguments(t.Parameters, prompt)}}
		resp.FinishReason = llm.FinishToolCalls
	} else {
		resp.Content = Summary(prompt)
	}
	resp.Usage = llm.Usage{InputTokens: (inChars + 3) / 4, OutputTokens: EstimateTokens(resp.Content + toolText(resp.ToolCalls))}
	resp.Raw = openAIJSON(resp)
	return resp
}

func toolText(calls []llm.ToolCall) string {
	var b strings.Builder
	for _, c := range calls {
		b.WriteString(c.Name + c.Arguments)
	}
	return b.String()
}

// openAIJSON renders resp as an OpenAI chat.completion object.
func openAIJSON(resp *llm.Response) []byte {
	type fn struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	}
	type call struct {
		ID       string `json:"id"`
		Type     string `json:"type"`
		Function fn     `json:"function"`
	}
	msg := map[string]any{"role": "assistant", "content": nil}
	if resp.Content != "" {
		msg["content"] = resp.Content
	}
	if len(resp.ToolCalls) > 0 {
		var calls []call
		for _, c := range resp.ToolCalls {
			calls = append(calls, call{c.ID, "function", fn{c.Name, c.Arguments}})
		}
		msg["tool_calls"] = calls
	}
	b, _ := json.Marshal(map[string]any{
		"id": resp.ID, "object": "chat.completion", "created": 0, "model": resp.Model,
		"choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": resp.FinishReason}},
		"usage": map[string]int{"prompt_tokens": resp.Usage.InputTokens, "completion_tokens": resp.Usage.OutputTokens,
			"total_tokens": resp.Usage.InputTokens + resp.Usage.OutputTokens},
	})
	return b
}

// SplitWords splits s into pieces of one word each, keeping the spaces, so that the
// pieces concatenate back to s.
func SplitWords(s string) []string {
	var out []string
	for len(s) > 0 {
		i := strings.IndexByte(s, ' ')
		if i < 0 {
			out = append(out, s)
			break
		}
		out = append(out, s[:i+1])
		s = s[i+1:]
	}
	return out
}
