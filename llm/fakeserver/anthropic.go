package fakeserver

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// anthropicDialect is Anthropic's Messages wire format. Overload answers 529
// overloaded_error, as Anthropic does, where OpenAI answers 503.
type anthropicDialect struct{}

func (anthropicDialect) endpoint() string        { return "messages" }
func (anthropicDialect) requestIDHeader() string { return "Request-Id" }
func (anthropicDialect) idPrefix() string        { return "msg_" }
func (anthropicDialect) toolIDPrefix() string    { return "toolu_" }

type anRequest struct {
	Model       string          `json:"model"`
	MaxTokens   int             `json:"max_tokens"`
	Messages    []anMessage     `json:"messages"`
	System      json.RawMessage `json:"system"`
	Temperature *float64        `json:"temperature"`
	Tools       []struct {
		Name        string          `json:"name"`
		Description string          `json:"description"`
		InputSchema json.RawMessage `json:"input_schema"`
	} `json:"tools"`
	ToolChoice *struct {
		Type string `json:"type"`
		Name string `json:"name"`
	} `json:"tool_choice"`
	Stream bool `json:"stream"`
}

type anMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type anBlock struct {
	Type      string          `json:"type"`
	Text      string          `json:"text"`
	ID        string          `json:"id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	ToolUseID string          `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"`
}

func (d anthropicDialect) parse(body []byte) (*chatRequest, *apiError) {
	invalid := func(format string, args ...any) *apiError {
		e := d.errorOf(errInvalid, fmt.Sprintf(format, args...), nil)
		return &e
	}
	var in anRequest
	if err := json.NewDecoder(bytes.NewReader(body)).Decode(&in); err != nil {
		return nil, invalid("invalid JSON body: %s", cleanErr(err))
	}
	switch {
	case in.Model == "":
		return nil, invalid("model: Field required")
	case in.MaxTokens < 1:
		return nil, invalid("max_tokens: Field required (at least 1)")
	case len(in.Messages) == 0:
		return nil, invalid("messages: at least one message is required")
	case in.Temperature != nil && (*in.Temperature < 0 || *in.Temperature > 1):
		return nil, invalid("temperature: Input should be less than or equal to 1")
	}
	req := &chatRequest{Model: in.Model, MaxTokens: in.MaxTokens, Temperature: in.Temperature, Stream: in.Stream, IncludeUsage: true}
	if sys, ok := anText(in.System); !ok {
		return nil, invalid("system: Input should be a valid string or list of text blocks")
	} else if sys != "" {
		req.Messages = append(req.Messages, llm.Message{Role: llm.RoleSystem, Content: sys})
	}
	for i, m := range in.Messages {
		if m.Role != "user" && m.Role != "assistant" {
			return nil, invalid("messages.%d.role: Input should be 'user' or 'assistant'", i)
		}
		msg := llm.Message{Role: llm.Role(m.Role)}
		var s string
		if json.Unmarshal(m.Content, &s) == nil {
			msg.Content = s
			req.Messages = append(req.Messages, msg)
			continue
		}
		var blocks []anBlock
		if json.Unmarshal(m.Content, &blocks) != nil {
			return nil, invalid("messages.%d.content: Input should be a valid string or list of content blocks", i)
		}
		var text strings.Builder
		for _, b := range blocks {
			switch b.Type {
			case "text":
				text.WriteString(b.Text)
			case "tool_use":
				msg.ToolCalls = append(msg.ToolCalls, llm.ToolCall{ID: b.ID, Name: b.Name, Arguments: string(b.Input)})
			case "tool_result":
				req.ToolResults++
				result, _ := anText(b.Content)
				text.WriteString(result)
				msg.ToolCallID = b.ToolUseID
			}
		}
		msg.Content = text.String()
		req.Messages = append(req.Messages, msg)
	}
	for i, t := range in.Tools {
		if t.Name == "" {
			return nil, invalid("tools.%d.name: Field required", i)
		}
		req.Tools = append(req.Tools, llm.Tool{Name: t.Name, Description: t.Description, Parameters: t.InputSchema})
	}
	if tc := in.ToolChoice; tc != nil {
		switch tc.Type {
		case "auto":
		case "none":
			req.Choice.mode = choiceNone
		case "any":
			req.Choice.mode = choiceRequired
		case "tool":
			if tc.Name == "" {
				return nil, invalid("tool_choice.name: Field required")
			}
			if req.declares(tc.Name) == nil {
				return nil, invalid("tool_choice: Tool '%s' not found in provided tools", truncateStr(tc.Name, 64))
			}
			req.Choice = toolChoice{mode: choiceNamed, name: tc.Name}
		default:
			return nil, invalid("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
		}
		if req.Choice.mode != choiceAuto && req.Choice.mode != choiceNone && len(req.Tools) == 0 {
			return nil, invalid("tool_choice: tools must be provided when tool_choice is %s", tc.Type)
		}
	}
	return req, nil
}

// anText reads a string or a list of text blocks; absent or null is "".
func anText(raw json.RawMessage) (string, bool) { return textOf(raw, "text") }

func (d anthropicDialect) errorOf(k errKind, detail string, _ *chatRequest) apiError {
	switch k {
	case errRateLimit:
		h := http.Header{}
		h.Set("Retry-After", detail)
		h.Set("Anthropic-Ratelimit-Requests-Remaining", "0")
		return apiError{status: http.StatusTooManyRequests, typ: "rate_limit_error", header: h,
			message: "This request would exceed your organization's rate limit of 50 requests per minute. Please try again later."}
	case errQuota:
		return apiError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "enforced_spend_limit_reached",
			message: "Your organization has reached the monthly API usage limit of its tier."}
	case errOverloaded:
		h := http.Header{}
		h.Set("Retry-After", detail)
		return apiError{status: 529, typ: "overloaded_error", message: "Overloaded", header: h}
	case errContextLength:
		limit, got, _ := strings.Cut(detail, "|")
		return apiError{status: http.StatusBadRequest, typ: "invalid_request_error",
			message: fmt.Sprintf("prompt is too long: %s characters > %s maximum", got, limit)}
	case errConflict:
		h := http.Header{}
		h.Set("Retry-After", "1")
		return apiError{status: http.StatusConflict, typ: "conflict_error", header: h,
			message: "Another request with this Idempotency-Key is still in progress."}
	case errTooLarge:
		return apiError{status: http.StatusRequestEntityTooLarge, typ: "request_too_large",
			message: fmt.Sprintf("Request exceeds the maximum allowed number of bytes (%d).", MaxBodyBytes)}
	}
	return apiError{status: http.StatusBadRequest, typ: "invalid_request_error", message: detail}
}

// rateLimited is Anthropic's 429 for a request over a rate limit: rate_limit_error
// with retry-after in whole seconds (rounded up).
func (anthropicDialect) rateLimited(r rejection, _ *chatRequest) apiError {
	h := http.Header{}
	h.Set("Retry-After", strconv.FormatInt(retryAfterSeconds(r.wait), 10))
	return apiError{status: http.StatusTooManyRequests, typ: "rate_limit_error", header: h,
		message: fmt.Sprintf("This request would exceed the rate limit for your organization (org-onceflowfake) of %d %s per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later.", r.limit, r.kind)}
}

// rateHeaders sets Anthropic's anthropic-ratelimit-{requests,tokens}-{limit,remaining,
// reset} headers of st; a reset is the RFC 3339 time (whole seconds, rounded up) when
// the bucket is full again.
func (anthropicDialect) rateHeaders(h http.Header, st rateState) {
	for kind, w := range map[string]*rateWindow{"Requests": st.requests, "Tokens": st.tokens} {
		if w == nil {
			continue
		}
		h.Set("Anthropic-Ratelimit-"+kind+"-Limit", strconv.FormatInt(w.limit, 10))
		if w.remaining >= 0 {
			h.Set("Anthropic-Ratelimit-"+kind+"-Remaining", strconv.FormatInt(w.remaining, 10))
		}
		if w.reset >= 0 {
			t := st.now.Add(w.reset)
			if t2 := t.Truncate(time.Second); !t2.Equal(t) {
				t = t2.Add(time.Second)
			}
			h.Set("Anthropic-Ratelimit-"+kind+"-Reset", t.UTC().Format(time.RFC3339))
		}
	}
}

func (anthropicDialect) writeError(w http.ResponseWriter, e apiError) {
	for k, vs := range e.header {
		w.Header()[k] = vs
	}
	writeJSON(w, e.status, map[string]any{"type": "error", "error": anErrorObject(e)})
}

// anErrorObject is the inner object of Anthropic's error body of e, {"type",
// "message"} (and "details" for a code): what an error answer sends under "error",
// and what an errored batch result holds.
func anErrorObject(e apiError) map[string]any {
	inner := map[string]any{"type": e.typ, "message": e.message}
	if e.code != "" {
		inner["details"] = map[string]string{"error_code": e.code}
	}
	return inner
}

// errorEvent is the event Anthropic sends when a stream fails mid-generation.
func (anthropicDialect) errorEvent(int) []byte {
	return []byte("event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n")
}

type anUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

func (anthropicDialect) render(req *chatRequest, c completion) *recorded {
	stop := "end_turn"
	var content []map[string]any
	for _, t := range c.Tools {
		stop = "tool_use"
		content = append(content, map[string]any{"type": "tool_use", "id": t.ID, "name": t.Name, "input": json.RawMessage(t.Arguments)})
	}
	if len(c.Tools) == 0 {
		content = []map[string]any{{"type": "text", "text": c.Content}}
	}
	h := http.Header{}
	type message struct {
		ID           string           `json:"id"`
		Type         string           `json:"type"`
		Role         string           `json:"role"`
		Model        string           `json:"model"`
		Content      []map[string]any `json:"content"`
		StopReason   *string          `json:"stop_reason"`
		StopSequence *string          `json:"stop_sequence"`
		Usage        anUsage          `json:"usage"`
	}
	if !req.Stream {
		body, _ := json.Marshal(message{c.ID, "message", "assistant", c.Model, content, &stop, nil, anUsage{c.InTokens, c.OutToken}})
		h.Set("Content-Type", "application/json")
		return &recorded{header: h, body: body}
	}

	var buf bytes.Buffer
	event := func(name string, v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(&buf, "event: %s\ndata: %s\n\n", name, b)
	}
	event("message_start", map[string]any{"type": "message_start",
		"message": message{c.ID, "message", "assistant", c.Model, []map[string]any{}, nil, nil, anUsage{c.InTokens, 1}}})
	for j, t := range c.Tools {
		event("content_block_start", map[string]any{"type": "content_block_start", "index": j,
			"content_block": map[string]any{"type": "tool_use", "id": t.ID, "name": t.Name, "input": map[string]any{}}})
		for _, piece := range splitRunes(t.Arguments, 12) {
			event("content_block_delta", map[string]any{"type": "content_block_delta", "index": j,
				"delta": map[string]any{"type": "input_json_delta", "partial_json": piece}})
		}
		event("content_block_stop", map[string]any{"type": "content_block_stop", "index": j})
	}
	if len(c.Tools) == 0 {
		event("content_block_start", map[string]any{"type": "content_block_start", "index": 0,
			"content_block": map[string]any{"type": "text", "text": ""}})
		event("ping", map[string]any{"type": "ping"})
		for _, piece := range fake.SplitWords(c.Content) {
			event("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
				"delta": map[string]any{"type": "text_delta", "text": piece}})
		}
		event("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0})
	}
	event("message_delta", map[string]any{"type": "message_delta",
		"delta": map[string]any{"stop_reason": stop, "stop_sequence": nil}, "usage": map[string]int{"output_tokens": c.OutToken}})
	event("message_stop", map[string]any{"type": "message_stop"})
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	return &recorded{header: h, body: buf.Bytes(), sse: true}
}
