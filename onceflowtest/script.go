package onceflowtest

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"iter"
	"sync"

	"github.com/onceflow/onceflow/llm"
)

// Turn is one answer of a ScriptedModel: tool calls, or text when it has none.
type Turn struct {
	// ToolCalls are the calls the answer makes (Name and Arguments; an empty ID gets one
	// from the script, see ScriptedModel.RandomIDs).
	ToolCalls []llm.ToolCall `json:"tool_calls,omitempty"`
	// Text is the answer's text (the final answer when ToolCalls is empty).
	Text string `json:"text,omitempty"`
}

// Call returns a tool call of tool name with args encoded as JSON, for a Turn.
func Call(name string, args any) llm.ToolCall {
	b, err := json.Marshal(args)
	if err != nil {
		panic(fmt.Sprintf("onceflowtest.Call %s: %v", name, err))
	}
	return llm.ToolCall{Name: name, Arguments: string(b)}
}

// ScriptedModel is an in-process llm.Client for agent loops: it answers a request with
// the turn whose index is the number of tool-result messages (llm.RoleTool) in its
// conversation, the last turn once the script is exhausted, as `onceflow fake-llm
// --script` does over HTTP. Safe for concurrent use.
type ScriptedModel struct {
	// Turns is the script.
	Turns []Turn
	// RandomIDs gives every answer fresh tool-call ids, as most providers do when a
	// request is made again; otherwise a call's id is "call_<turn>_<index>".
	RandomIDs bool
	// Model names the model in answers. Default: "scripted".
	Model string

	mu       sync.Mutex
	requests []*llm.Request
}

// Requests returns a copy of every request the model was asked, in order.
func (m *ScriptedModel) Requests() []*llm.Request {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]*llm.Request(nil), m.requests...)
}

// Complete answers req from the script.
func (m *ScriptedModel) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	cp := *req
	cp.Messages = append([]llm.Message(nil), req.Messages...)
	m.requests = append(m.requests, &cp)
	n := len(m.requests)
	m.mu.Unlock()
	if len(m.Turns) == 0 {
		return nil, fmt.Errorf("onceflowtest.ScriptedModel: no turns")
	}
	results := 0
	for _, msg := range req.Messages {
		if msg.Role == llm.RoleTool {
			results++
		}
	}
	i := min(results, len(m.Turns)-1)
	t := m.Turns[i]
	model := m.Model
	if model == "" {
		model = "scripted"
	}
	resp := &llm.Response{ID: fmt.Sprintf("scripted-%d", n), Model: model, Content: t.Text, FinishReason: llm.FinishStop,
		Usage: llm.Usage{InputTokens: 10 * len(req.Messages), OutputTokens: 5}}
	for j, c := range t.ToolCalls {
		if c.ID == "" {
			c.ID = fmt.Sprintf("call_%d_%d", i, j)
			if m.RandomIDs {
				c.ID = "call_" + rand.Text()
			}
		}
		resp.ToolCalls = append(resp.ToolCalls, c)
	}
	if len(resp.ToolCalls) > 0 {
		resp.FinishReason = llm.FinishToolCalls
	}
	resp.Raw, _ = json.Marshal(resp)
	return resp, nil
}

// Stream answers req from the script: the text in one chunk, then the final chunk.
func (m *ScriptedModel) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		resp, err := m.Complete(ctx, req)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if resp.Content != "" && !yield(llm.Chunk{ID: resp.ID, Content: resp.Content, Raw: resp.Raw}, nil) {
			return
		}
		usage := resp.Usage
		yield(llm.Chunk{ID: resp.ID, Done: true, FinishReason: resp.FinishReason, ToolCalls: resp.ToolCalls, Usage: &usage}, nil)
	}
}
