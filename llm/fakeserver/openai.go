package fakeserver

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// openaiDialect is OpenAI's Chat Completions wire format.
type openaiDialect struct{}

func (openaiDialect) endpoint() string        { return "chat_completions" }
func (openaiDialect) requestIDHeader() string { return "X-Request-Id" }
func (openaiDialect) idPrefix() string        { return "chatcmpl-" }
func (openaiDialect) toolIDPrefix() string    { return "call_" }

type oaRequest struct {
	Model               string          `json:"model"`
	Messages            []oaMessage     `json:"messages"`
	Temperature         *float64        `json:"temperature"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Tools               []oaTool        `json:"tools"`
	ToolChoice          json.RawMessage `json:"tool_choice"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

type oaMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	ToolCallID string          `json:"tool_call_id"`
	ToolCalls  []struct {
		ID       string `json:"id"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

type oaTool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string          `json:"name"`
		Description string          `json:"description"`
		Parameters  json.RawMessage `json:"parameters"`
	} `json:"function"`
}

func (d openaiDialect) parse(body []byte) (*chatRequest, *apiError) {
	invalid := func(param, format string, args ...any) *apiError {
		e := d.errorOf(errInvalid, fmt.Sprintf(format, args...), nil)
		e.param = param
		return &e
	}
	var in oaRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&in); err != nil {
		return nil, invalid("", "We could not parse the JSON body of your request. (%s)", cleanErr(err))
	}
	if in.Model == "" {
		return nil, invalid("model", "you must provide a model parameter")
	}
	if len(in.Messages) == 0 {
		return nil, invalid("messages", "[] is too short - 'messages'")
	}
	if in.Temperature != nil && (*in.Temperature < 0 || *in.Temperature > 2) {
		return nil, invalid("temperature", "%v is not between 0 and 2 - 'temperature'", *in.Temperature)
	}
	req := &chatRequest{Model: in.Model, Temperature: in.Temperature, Stream: in.Stream}
	if in.StreamOptions != nil {
		req.IncludeUsage = in.StreamOptions.IncludeUsage
	}
	for _, p := range []*int{in.MaxTokens, in.MaxCompletionTokens} {
		if p != nil {
			if *p < 1 {
				return nil, invalid("max_tokens", "%d is less than the minimum of 1 - 'max_tokens'", *p)
			}
			req.MaxTokens = *p
		}
	}
	for i, m := range in.Messages {
		role := llm.Role(m.Role)
		switch m.Role {
		case "system", "developer":
			role = llm.RoleSystem
		case "user", "assistant", "tool":
		default:
			return nil, invalid(fmt.Sprintf("messages[%d].role", i), "'%s' is not one of ['system', 'assistant', 'user', 'tool', 'developer'] - 'messages.%d.role'", truncateStr(m.Role, 40), i)
		}
		text, ok := contentText(m.Content)
		if !ok {
			return nil, invalid(fmt.Sprintf("messages[%d].content", i), "Invalid type for 'messages[%d].content': expected a string or an array of content parts.", i)
		}
		if role == llm.RoleTool {
			req.ToolResults++
		}
		msg := llm.Message{Role: role, Content: text, ToolCallID: m.ToolCallID}
		for _, tc := range m.ToolCalls {
			msg.ToolCalls = append(msg.ToolCalls, llm.ToolCall{ID: tc.ID, Name: tc.Function.Name, Arguments: tc.Function.Arguments})
		}
		req.Messages = append(req.Messages, msg)
	}
	for i, t := range in.Tools {
		if t.Function.Name == "" {
			return nil, invalid(fmt.Sprintf("tools[%d].function.name", i), "Missing required parameter: 'tools[%d].function.name'.", i)
		}
		req.Tools = append(req.Tools, llm.Tool{Name: t.Function.Name, Description: t.Function.Description, Parameters: t.Function.Parameters})
	}
	choice, msg := oaToolChoice(in.ToolChoice)
	switch {
	case msg != "":
		return nil, invalid("tool_choice", "Invalid value for 'tool_choice': %s", msg)
	case choice.mode != choiceAuto && choice.mode != choiceNone && len(req.Tools) == 0:
		return nil, invalid("tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.")
	case choice.mode == choiceNamed && req.declares(choice.name) == nil:
		return nil, invalid("tool_choice", "Invalid value for 'tool_choice': no function named '%s' was specified in the 'tools' parameter.", truncateStr(choice.name, 64))
	}
	req.Choice = choice
	return req, nil
}

// oaToolChoice reads OpenAI's tool_choice: absent, null, "auto", "none", "required" or
// {"type": "function", "function": {"name": ...}}; msg says what is wrong otherwise.
func oaToolChoice(raw json.RawMessage) (c toolChoice, msg string) {
	c, msg, done := oaChoiceMode(raw)
	if done {
		return c, msg
	}
	var named struct {
		Type     string `json:"type"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if json.Unmarshal(raw, &named) != nil || named.Type != "function" || named.Function.Name == "" {
		return toolChoice{}, "expected 'none', 'auto', 'required' or an object naming a function."
	}
	return toolChoice{mode: choiceNamed, name: named.Function.Name}, ""
}

// oaChoiceMode reads the part both OpenAI APIs' tool_choice share: absent or null (no
// choice), or a string mode "auto", "none", "required"; done is false when raw is
// neither (an object, for the caller to read).
func oaChoiceMode(raw json.RawMessage) (c toolChoice, msg string, done bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return toolChoice{}, "", true
	}
	var mode string
	if json.Unmarshal(raw, &mode) != nil {
		return toolChoice{}, "", false
	}
	switch mode {
	case "auto":
		return toolChoice{mode: choiceAuto}, "", true
	case "none":
		return toolChoice{mode: choiceNone}, "", true
	case "required":
		return toolChoice{mode: choiceRequired}, "", true
	}
	return toolChoice{}, fmt.Sprintf("'%s' is not one of ['none', 'auto', 'required'].", truncateStr(mode, 40)), true
}

// contentText reads a Chat Completions message content: a string, null, or an array of
// parts whose "text" parts are joined.
func contentText(raw json.RawMessage) (string, bool) { return textOf(raw, "text") }

// textOf reads a content as the providers write it: a string, null (""), or an array
// of typed parts whose parts of the given types are joined (images, files, tool
// results and the like add nothing). It reports false for anything else.
func textOf(raw json.RawMessage, types ...string) (string, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", true
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, true
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) != nil {
		return "", false
	}
	var b strings.Builder
	for _, p := range parts {
		if slices.Contains(types, p.Type) {
			b.WriteString(p.Text)
		}
	}
	return b.String(), true
}

func (d openaiDialect) errorOf(k errKind, detail string, req *chatRequest) apiError {
	model := "gpt-4.1-mini"
	if req != nil {
		model = req.Model
	}
	switch k {
	case errRateLimit:
		h := http.Header{}
		h.Set("Retry-After", detail)
		// An injected 429 says nothing is left until its Retry-After, but claims no
		// limit: a limiter learning from it must not take a size for the window.
		h.Set("X-Ratelimit-Remaining-Requests", "0")
		h.Set("X-Ratelimit-Reset-Requests", detail+"s")
		return apiError{status: http.StatusTooManyRequests, typ: "requests", code: "rate_limit_exceeded", header: h,
			message: fmt.Sprintf("Rate limit reached for %s in organization org-onceflowfake on requests per min (RPM): Limit 60, Used 60, Requested 1. Please try again in %ss.", truncateStr(model, 64), detail)}
	case errQuota:
		return apiError{status: http.StatusTooManyRequests, typ: "insufficient_quota", code: "insufficient_quota",
			message: "You exceeded your current quota, please check your plan and billing details."}
	case errOverloaded:
		return apiError{status: http.StatusServiceUnavailable, typ: "server_error",
			message: "The server is overloaded or not ready yet."}
	case errContextLength:
		limit, got, _ := strings.Cut(detail, "|")
		return apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "context_length_exceeded", param: "messages",
			message: fmt.Sprintf("This model's maximum context length is %s characters. However, your messages resulted in %s characters. Please reduce the length of the messages.", limit, got)}
	case errConflict:
		h := http.Header{}
		h.Set("Retry-After", "1")
		return apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "idempotency_key_in_use", header: h,
			message: "Another request with this Idempotency-Key is still in progress."}
	case errTooLarge:
		return apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error",
			message: fmt.Sprintf("Request body exceeds %d bytes.", MaxBodyBytes)}
	}
	return apiError{status: http.StatusBadRequest, typ: "invalid_request_error", message: detail}
}

// rateLimited is OpenAI's 429 for a request over a rate limit: type "requests" or
// "tokens", code rate_limit_exceeded, Retry-After in whole seconds (rounded up) and
// retry-after-ms.
func (openaiDialect) rateLimited(r rejection, req *chatRequest) apiError {
	h := http.Header{}
	h.Set("Retry-After", strconv.FormatInt(retryAfterSeconds(r.wait), 10))
	h.Set("Retry-After-Ms", strconv.FormatInt(r.wait.Milliseconds(), 10))
	abbr := map[string]string{"requests": "RPM", "tokens": "TPM"}[r.kind]
	return apiError{status: http.StatusTooManyRequests, typ: r.kind, code: "rate_limit_exceeded", header: h,
		message: fmt.Sprintf("Rate limit reached for %s in organization org-onceflowfake on %s per min (%s): Limit %d, Used %d, Requested %d. Please try again in %s. Visit https://platform.openai.com/account/rate-limits to learn more.",
			truncateStr(req.Model, 64), r.kind, abbr, r.limit, r.used, r.requested, r.wait)}
}

// rateHeaders sets OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}
// headers of st; the resets are Go duration strings ("1s", "6m0s", "20ms"), as OpenAI
// sends them.
func (openaiDialect) rateHeaders(h http.Header, st rateState) {
	for kind, w := range map[string]*rateWindow{"Requests": st.requests, "Tokens": st.tokens} {
		if w == nil {
			continue
		}
		h.Set("X-Ratelimit-Limit-"+kind, strconv.FormatInt(w.limit, 10))
		if w.remaining >= 0 {
			h.Set("X-Ratelimit-Remaining-"+kind, strconv.FormatInt(w.remaining, 10))
		}
		if w.reset >= 0 {
			h.Set("X-Ratelimit-Reset-"+kind, w.reset.String())
		}
	}
}

func (openaiDialect) writeError(w http.ResponseWriter, e apiError) {
	for k, vs := range e.header {
		w.Header()[k] = vs
	}
	writeJSON(w, e.status, oaErrorBody(e))
}

// oaError is the inner object of OpenAI's error body.
type oaError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// oaErrorBody is OpenAI's error body of e, {"error": {"message", "type", "param",
// "code"}}: what an error answer sends, and what a batch's error file holds as the
// body of a failed request.
func oaErrorBody(e apiError) map[string]oaError {
	b := oaError{Message: e.message, Type: e.typ}
	if e.param != "" {
		b.Param = &e.param
	}
	if e.code != "" {
		b.Code = &e.code
	}
	return map[string]oaError{"error": b}
}

// errorEvent is the event OpenAI sends when a stream fails mid-generation.
func (openaiDialect) errorEvent(int) []byte {
	return []byte(`data: {"error":{"message":"The server had an error while processing your request. Sorry about that!","type":"server_error","param":null,"code":null}}` + "\n\n")
}

type oaUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type oaFunction struct {
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments"`
}

type oaToolCall struct {
	Index    *int       `json:"index,omitempty"`
	ID       string     `json:"id,omitempty"`
	Type     string     `json:"type,omitempty"`
	Function oaFunction `json:"function"`
}

func (openaiDialect) render(req *chatRequest, c completion) *recorded {
	finish := llm.FinishStop
	if len(c.Tools) > 0 {
		finish = llm.FinishToolCalls
	}
	usage := oaUsage{c.InTokens, c.OutToken, c.InTokens + c.OutToken}
	h := http.Header{}
	h.Set("Openai-Processing-Ms", "1")
	h.Set("Openai-Version", "2020-10-01")
	if !req.Stream {
		type message struct {
			Role        string       `json:"role"`
			Content     *string      `json:"content"`
			Refusal     *string      `json:"refusal"`
			ToolCalls   []oaToolCall `json:"tool_calls,omitempty"`
			Annotations []any        `json:"annotations"`
		}
		type choice struct {
			Index        int     `json:"index"`
			Message      message `json:"message"`
			Logprobs     any     `json:"logprobs"`
			FinishReason string  `json:"finish_reason"`
		}
		msg := message{Role: "assistant", Annotations: []any{}}
		for _, t := range c.Tools {
			msg.ToolCalls = append(msg.ToolCalls, oaToolCall{ID: t.ID, Type: "function", Function: oaFunction{t.Name, t.Arguments}})
		}
		if len(c.Tools) == 0 {
			msg.Content = &c.Content
		}
		body, _ := json.Marshal(struct {
			ID                string   `json:"id"`
			Object            string   `json:"object"`
			Created           int64    `json:"created"`
			Model             string   `json:"model"`
			Choices           []choice `json:"choices"`
			Usage             oaUsage  `json:"usage"`
			ServiceTier       string   `json:"service_tier"`
			SystemFingerprint string   `json:"system_fingerprint"`
		}{c.ID, "chat.completion", c.Created, c.Model, []choice{{Message: msg, FinishReason: finish}}, usage, "default", "fp_onceflow"})
		h.Set("Content-Type", "application/json")
		return &recorded{header: h, body: body}
	}

	type delta struct {
		Role      string       `json:"role,omitempty"`
		Content   *string      `json:"content,omitempty"`
		ToolCalls []oaToolCall `json:"tool_calls,omitempty"`
	}
	type choice struct {
		Index        int     `json:"index"`
		Delta        delta   `json:"delta"`
		Logprobs     any     `json:"logprobs"`
		FinishReason *string `json:"finish_reason"`
	}
	type chunk struct {
		ID                string   `json:"id"`
		Object            string   `json:"object"`
		Created           int64    `json:"created"`
		Model             string   `json:"model"`
		SystemFingerprint string   `json:"system_fingerprint"`
		Choices           []choice `json:"choices"`
		Usage             *oaUsage `json:"usage,omitempty"`
	}
	var buf bytes.Buffer
	event := func(ch []choice, u *oaUsage) {
		b, _ := json.Marshal(chunk{c.ID, "chat.completion.chunk", c.Created, c.Model, "fp_onceflow", ch, u})
		buf.WriteString("data: ")
		buf.Write(b)
		buf.WriteString("\n\n")
	}
	empty := ""
	event([]choice{{Delta: delta{Role: "assistant", Content: &empty}}}, nil)
	for j, t := range c.Tools {
		event([]choice{{Delta: delta{ToolCalls: []oaToolCall{{Index: &j, ID: t.ID, Type: "function", Function: oaFunction{Name: t.Name}}}}}}, nil)
		for _, piece := range splitRunes(t.Arguments, 12) {
			event([]choice{{Delta: delta{ToolCalls: []oaToolCall{{Index: &j, Function: oaFunction{Arguments: piece}}}}}}, nil)
		}
	}
	if len(c.Tools) == 0 {
		for _, piece := range fake.SplitWords(c.Content) {
			event([]choice{{Delta: delta{Content: &piece}}}, nil)
		}
	}
	event([]choice{{Delta: delta{}, FinishReason: &finish}}, nil)
	if req.IncludeUsage {
		event([]choice{}, &usage)
	}
	buf.WriteString("data: [DONE]\n\n")
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	return &recorded{header: h, body: buf.Bytes(), sse: true}
}

// splitRunes cuts s into pieces of about n bytes on rune boundaries.
func splitRunes(s string, n int) []string {
	var out []string
	for len(s) > 0 {
		cut := min(n, len(s))
		for cut < len(s) && !utf8.RuneStart(s[cut]) {
			cut++
		}
		out = append(out, s[:cut])
		s = s[cut:]
	}
	return out
}

func truncateStr(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// cleanErr renders a JSON decoding error without echoing large input.
func cleanErr(err error) string { return truncateStr(strconv.Quote(err.Error()), 200) }
