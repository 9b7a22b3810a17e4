package fakeserver

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// responsesDialect is OpenAI's Responses API wire format (POST /v1/responses). Its
// errors, rate-limit answers and headers are those of Chat Completions, which it
// embeds; its request (input items, instructions, flat function tools), its answer (a
// response object whose output holds a message or a function_call item) and its
// stream (named, numbered events ending in response.completed, without [DONE]) are
// its own.
type responsesDialect struct{ openaiDialect }

func (responsesDialect) endpoint() string { return "responses" }
func (responsesDialect) idPrefix() string { return "resp_" }

// rsRequest is a Responses API request: the fields the fake reads or echoes in its
// answer. Others (include, reasoning, truncation, service_tier, ...) are accepted
// and ignored.
type rsRequest struct {
	Model              string            `json:"model"`
	Input              json.RawMessage   `json:"input"`
	Instructions       json.RawMessage   `json:"instructions"`
	MaxOutputTokens    *int              `json:"max_output_tokens"`
	Temperature        *float64          `json:"temperature"`
	TopP               *float64          `json:"top_p"`
	Stream             bool              `json:"stream"`
	Tools              []json.RawMessage `json:"tools"`
	ToolChoice         json.RawMessage   `json:"tool_choice"`
	ParallelToolCalls  *bool             `json:"parallel_tool_calls"`
	Store              *bool             `json:"store"`
	Metadata           json.RawMessage   `json:"metadata"`
	PreviousResponseID *string           `json:"previous_response_id"`
	Text               json.RawMessage   `json:"text"`
	Reasoning          json.RawMessage   `json:"reasoning"`
	User               *string           `json:"user"`

	// instructions is Instructions read (nil when absent or null); tools the echo of
	// Tools, function tools with their defaults filled in. Set by parse.
	instructions *string
	tools        []json.RawMessage
}

// rsItem is one input item: a message (type "message" or absent, with a role), a
// function_call or a function_call_output. Other types (reasoning, item_reference,
// hosted tools' calls) are skipped.
type rsItem struct {
	Type      string          `json:"type"`
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
}

// rsFunctionTool is a function tool, as requested and as echoed.
type rsFunctionTool struct {
	Type        string          `json:"type"`
	Name        string          `json:"name"`
	Description *string         `json:"description"`
	Parameters  json.RawMessage `json:"parameters"`
	Strict      *bool           `json:"strict"`
}

func (d responsesDialect) parse(body []byte) (*chatRequest, *apiError) {
	invalid := func(param, code, format string, args ...any) *apiError {
		e := d.errorOf(errInvalid, fmt.Sprintf(format, args...), nil)
		e.param, e.code = param, code
		return &e
	}
	var in rsRequest
	if err := json.NewDecoder(bytes.NewReader(body)).Decode(&in); err != nil {
		return nil, invalid("", "", "We could not parse the JSON body of your request. (%s)", cleanErr(err))
	}
	if in.Model == "" {
		return nil, invalid("model", "missing_required_parameter", "Missing required parameter: 'model'.")
	}
	if t := in.Temperature; t != nil && (*t < 0 || *t > 2) {
		code, bound := "decimal_above_max_value", "<= 2"
		if *t < 0 {
			code, bound = "decimal_below_min_value", ">= 0"
		}
		return nil, invalid("temperature", code, "Invalid 'temperature': %s. Expected a value %s, but got %v instead.", strings.ReplaceAll(code, "_", " "), bound, *t)
	}
	if m := in.MaxOutputTokens; m != nil && *m < 16 {
		return nil, invalid("max_output_tokens", "integer_below_min_value", "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got %d instead.", *m)
	}
	req := &chatRequest{Model: in.Model, Temperature: in.Temperature, Stream: in.Stream, IncludeUsage: true}
	if in.MaxOutputTokens != nil {
		req.MaxTokens = *in.MaxOutputTokens
	}
	if raw := bytes.TrimSpace(in.Instructions); len(raw) > 0 && string(raw) != "null" {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return nil, invalid("instructions", "invalid_type", "Invalid type for 'instructions': expected a string, but got another type instead.")
		}
		in.instructions = &s
		if s != "" {
			req.Messages = append(req.Messages, llm.Message{Role: llm.RoleSystem, Content: s})
		}
	}
	msgs, perr := d.input(in.Input, invalid)
	if perr != nil {
		return nil, perr
	}
	req.Messages = append(req.Messages, msgs...)
	for _, m := range msgs {
		if m.Role == llm.RoleTool { // a function_call_output item
			req.ToolResults++
		}
	}

	for i, raw := range in.Tools {
		var t rsFunctionTool
		if json.Unmarshal(raw, &t) != nil {
			return nil, invalid(fmt.Sprintf("tools[%d]", i), "invalid_type", "Invalid type for 'tools[%d]': expected a tool object, but got another type instead.", i)
		}
		if t.Type == "" {
			return nil, invalid(fmt.Sprintf("tools[%d].type", i), "missing_required_parameter", "Missing required parameter: 'tools[%d].type'.", i)
		}
		if t.Type != "function" { // a hosted tool (web_search, file_search, ...): echoed, never called
			in.tools = append(in.tools, raw)
			continue
		}
		if t.Name == "" {
			return nil, invalid(fmt.Sprintf("tools[%d].name", i), "missing_required_parameter", "Missing required parameter: 'tools[%d].name'.", i)
		}
		req.Tools = append(req.Tools, llm.Tool{Name: t.Name, Description: deref(t.Description), Parameters: t.Parameters})
		if t.Strict == nil {
			strict := true // the Responses API's default
			t.Strict = &strict
		}
		echo, _ := json.Marshal(t)
		in.tools = append(in.tools, echo)
	}
	choice, msg := rsToolChoice(in.ToolChoice)
	switch {
	case msg != "":
		return nil, invalid("tool_choice", "invalid_value", "Invalid value for 'tool_choice': %s", msg)
	case choice.mode == choiceRequired && len(req.Tools) == 0:
		return nil, invalid("tool_choice", "invalid_value", "Tool choice 'required' must be specified with 'tools' parameter.")
	case choice.mode == choiceNamed && req.declares(choice.name) == nil:
		return nil, invalid("tool_choice", "invalid_value", "Tool choice 'function' not found in 'tools' parameter: no function named '%s'.", truncateStr(choice.name, 64))
	}
	req.Choice = choice
	req.Echo = &in
	return req, nil
}

// input reads a request's input: a string (one user message) or an array of items.
func (responsesDialect) input(raw json.RawMessage, invalid func(param, code, format string, args ...any) *apiError) ([]llm.Message, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, invalid("input", "missing_required_parameter", "Missing required parameter: 'input'.")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []llm.Message{{Role: llm.RoleUser, Content: s}}, nil
	}
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return nil, invalid("input", "invalid_type", "Invalid type for 'input': expected one of a string or array of input items, but got another type instead.")
	}
	if len(items) == 0 {
		return nil, invalid("input", "empty_array", "Invalid 'input': empty array. Expected an array with minimum length 1, but got an empty array instead.")
	}
	var msgs []llm.Message
	for i, rawItem := range items {
		var it rsItem
		if json.Unmarshal(rawItem, &it) != nil {
			return nil, invalid(fmt.Sprintf("input[%d]", i), "invalid_type", "Invalid type for 'input[%d]': expected an input item object, but got another type instead.", i)
		}
		switch it.Type {
		case "", "message":
			role := llm.Role(it.Role)
			switch it.Role {
			case "system", "developer":
				role = llm.RoleSystem
			case "user", "assistant":
			case "":
				return nil, invalid(fmt.Sprintf("input[%d].role", i), "missing_required_parameter", "Missing required parameter: 'input[%d].role'.", i)
			default:
				return nil, invalid(fmt.Sprintf("input[%d].role", i), "invalid_value", "Invalid value: '%s'. Supported values are: 'assistant', 'system', 'developer', and 'user'.", truncateStr(it.Role, 40))
			}
			text, ok := rsText(it.Content)
			if !ok {
				return nil, invalid(fmt.Sprintf("input[%d].content", i), "invalid_type", "Invalid type for 'input[%d].content': expected one of a string or array of input content parts, but got another type instead.", i)
			}
			msgs = append(msgs, llm.Message{Role: role, Content: text})
		case "function_call":
			msgs = append(msgs, llm.Message{Role: llm.RoleAssistant, ToolCalls: []llm.ToolCall{{ID: it.CallID, Name: it.Name, Arguments: it.Arguments}}})
		case "function_call_output":
			text, ok := rsText(it.Output)
			if !ok {
				return nil, invalid(fmt.Sprintf("input[%d].output", i), "invalid_type", "Invalid type for 'input[%d].output': expected one of a string or array of content parts, but got another type instead.", i)
			}
			msgs = append(msgs, llm.Message{Role: llm.RoleTool, Content: text, ToolCallID: it.CallID})
		}
	}
	return msgs, nil
}

// rsText reads a Responses API content: a string, null, or an array of parts whose
// text parts (input_text, output_text) are joined; images, files and refusals add
// nothing.
func rsText(raw json.RawMessage) (string, bool) { return textOf(raw, "input_text", "output_text") }

// rsToolChoice reads the Responses API's tool_choice: absent, null, "auto", "none",
// "required", {"type":"function","name":...}, {"type":"allowed_tools","mode":...}
// (its mode; the list does not narrow the fake's pick), or a hosted tool's choice
// ({"type":"web_search_preview"}, ...), which the fake cannot run: a text answer.
// msg says what is wrong otherwise.
func rsToolChoice(raw json.RawMessage) (c toolChoice, msg string) {
	c, msg, done := oaChoiceMode(raw)
	if done {
		return c, msg
	}
	var obj struct {
		Type string `json:"type"`
		Name string `json:"name"`
		Mode string `json:"mode"`
	}
	if json.Unmarshal(raw, &obj) != nil || obj.Type == "" {
		return toolChoice{}, "expected 'none', 'auto', 'required' or an object with a 'type'."
	}
	switch obj.Type {
	case "function":
		if obj.Name == "" {
			return toolChoice{}, "missing required parameter 'tool_choice.name'."
		}
		return toolChoice{mode: choiceNamed, name: obj.Name}, ""
	case "allowed_tools":
		switch obj.Mode {
		case "auto":
			return toolChoice{mode: choiceAuto}, ""
		case "required":
			return toolChoice{mode: choiceRequired}, ""
		}
		return toolChoice{}, fmt.Sprintf("'tool_choice.mode' '%s' is not one of ['auto', 'required'].", truncateStr(obj.Mode, 40))
	}
	return toolChoice{mode: choiceNone}, ""
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func (d responsesDialect) errorOf(k errKind, detail string, req *chatRequest) apiError {
	if k == errContextLength {
		limit, got, _ := strings.Cut(detail, "|")
		return apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "context_length_exceeded", param: "input",
			message: fmt.Sprintf("Your input exceeds the context window of this model (%s characters; your input has %s). Please adjust your input and try again.", limit, got)}
	}
	return d.openaiDialect.errorOf(k, detail, req)
}

// errorEvent is the event the Responses API sends when a stream fails mid-generation,
// numbered after the events sent. It carries the error nested, as OpenAI sends it
// (the API reference puts code and message at the top; the wire does not), so that
// the SDKs, which look for a top-level "error", raise it.
func (responsesDialect) errorEvent(sent int) []byte {
	return []byte(`event: error` + "\n" + `data: {"type":"error","sequence_number":` + strconv.Itoa(sent) +
		`,"error":{"type":"server_error","code":"server_error","message":"An error occurred while processing your request. You can retry your request, or contact us through our help center at help.openai.com if the error persists.","param":null}}` + "\n\n")
}

// The answer's parts, in the Responses API's field order.
type (
	rsOutputText struct {
		Type        string `json:"type"`
		Annotations []any  `json:"annotations"`
		Logprobs    []any  `json:"logprobs"`
		Text        string `json:"text"`
	}
	rsMessage struct {
		ID      string         `json:"id"`
		Type    string         `json:"type"`
		Status  string         `json:"status"`
		Content []rsOutputText `json:"content"`
		Role    string         `json:"role"`
	}
	rsFunctionCall struct {
		ID        string `json:"id"`
		Type      string `json:"type"`
		Status    string `json:"status"`
		Arguments string `json:"arguments"`
		CallID    string `json:"call_id"`
		Name      string `json:"name"`
	}
	rsUsage struct {
		InputTokens        int `json:"input_tokens"`
		InputTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
		OutputTokens        int `json:"output_tokens"`
		OutputTokensDetails struct {
			ReasoningTokens int `json:"reasoning_tokens"`
		} `json:"output_tokens_details"`
		TotalTokens int `json:"total_tokens"`
	}
	// rsResponse is the response object: the unary answer, and the snapshot the
	// stream's response.created, response.in_progress and response.completed carry.
	rsResponse struct {
		ID                 string            `json:"id"`
		Object             string            `json:"object"`
		CreatedAt          int64             `json:"created_at"`
		Status             string            `json:"status"`
		AccessPrograms     map[string]string `json:"access_programs"`
		Background         bool              `json:"background"`
		CompletedAt        *int64            `json:"completed_at"`
		Error              *struct{}         `json:"error"`
		IncompleteDetails  *struct{}         `json:"incomplete_details"`
		Instructions       *string           `json:"instructions"`
		MaxOutputTokens    *int              `json:"max_output_tokens"`
		MaxToolCalls       *int              `json:"max_tool_calls"`
		Model              string            `json:"model"`
		Output             []any             `json:"output"`
		ParallelToolCalls  bool              `json:"parallel_tool_calls"`
		PreviousResponseID *string           `json:"previous_response_id"`
		PromptCacheKey     *string           `json:"prompt_cache_key"`
		Reasoning          json.RawMessage   `json:"reasoning"`
		SafetyIdentifier   *string           `json:"safety_identifier"`
		ServiceTier        string            `json:"service_tier"`
		Store              bool              `json:"store"`
		Temperature        float64           `json:"temperature"`
		Text               json.RawMessage   `json:"text"`
		ToolChoice         json.RawMessage   `json:"tool_choice"`
		Tools              []json.RawMessage `json:"tools"`
		TopLogprobs        int               `json:"top_logprobs"`
		TopP               float64           `json:"top_p"`
		Truncation         string            `json:"truncation"`
		Usage              *rsUsage          `json:"usage"`
		User               *string           `json:"user"`
		Metadata           json.RawMessage   `json:"metadata"`
	}
)

// orJSON is raw, or def when raw is absent or null.
func orJSON(raw json.RawMessage, def string) json.RawMessage {
	if raw = bytes.TrimSpace(raw); len(raw) == 0 || string(raw) == "null" {
		return json.RawMessage(def)
	}
	return raw
}

// response is the response object of c for in, completed or (without output and
// usage) in progress.
func (in *rsRequest) response(c completion, output []any, usage *rsUsage) *rsResponse {
	r := &rsResponse{ID: c.ID, Object: "response", CreatedAt: c.Created, Status: "in_progress",
		AccessPrograms: map[string]string{"cyber": "standard"}, Instructions: in.instructions,
		MaxOutputTokens: in.MaxOutputTokens, Model: c.Model, Output: []any{}, ParallelToolCalls: true,
		PreviousResponseID: in.PreviousResponseID, Reasoning: orJSON(in.Reasoning, `{"effort":null,"summary":null}`),
		ServiceTier: "default", Store: true, Temperature: 1, Text: orJSON(in.Text, `{"format":{"type":"text"},"verbosity":"medium"}`),
		ToolChoice: orJSON(in.ToolChoice, `"auto"`), Tools: in.tools, TopP: 1, Truncation: "disabled", User: in.User,
		Metadata: orJSON(in.Metadata, `{}`)}
	if r.Tools == nil {
		r.Tools = []json.RawMessage{}
	}
	if in.ParallelToolCalls != nil {
		r.ParallelToolCalls = *in.ParallelToolCalls
	}
	if in.Store != nil {
		r.Store = *in.Store
	}
	if in.Temperature != nil {
		r.Temperature = *in.Temperature
	}
	if in.TopP != nil {
		r.TopP = *in.TopP
	}
	if output != nil {
		r.Status, r.CompletedAt, r.Output, r.Usage = "completed", &c.Created, output, usage
	}
	return r
}

// field is one key and value of a stream event, in order.
type field struct {
	key   string
	value any
}

func (d responsesDialect) render(req *chatRequest, c completion) *recorded {
	in, _ := req.Echo.(*rsRequest)
	if in == nil {
		in = &rsRequest{}
	}
	suffix := strings.TrimPrefix(c.ID, d.idPrefix()) // item ids share the response's, as OpenAI's do
	usage := &rsUsage{InputTokens: c.InTokens, OutputTokens: c.OutToken, TotalTokens: c.InTokens + c.OutToken}
	// outputs are the answer's output items: a function_call item per tool call, or a
	// message; started is each as output_item.added announces it.
	type output struct {
		id            string
		item, started any
	}
	var outputs []output
	for j, t := range c.Tools {
		id := "fc_" + suffix
		if j > 0 {
			id += "_" + strconv.Itoa(j)
		}
		call := rsFunctionCall{ID: id, Type: "function_call", Status: "completed", Arguments: t.Arguments, CallID: t.ID, Name: t.Name}
		o := output{id: id, item: call}
		call.Status, call.Arguments = "in_progress", ""
		o.started = call
		outputs = append(outputs, o)
	}
	if len(c.Tools) == 0 {
		id := "msg_" + suffix
		outputs = []output{{id: id,
			item: rsMessage{ID: id, Type: "message", Status: "completed", Role: "assistant",
				Content: []rsOutputText{{Type: "output_text", Annotations: []any{}, Logprobs: []any{}, Text: c.Content}}},
			started: rsMessage{ID: id, Type: "message", Status: "in_progress", Role: "assistant", Content: []rsOutputText{}}}}
	}
	items := make([]any, len(outputs))
	for j, o := range outputs {
		items[j] = o.item
	}
	done := in.response(c, items, usage)
	h := http.Header{}
	h.Set("Openai-Processing-Ms", "1")
	h.Set("Openai-Version", "2020-10-01")
	if !req.Stream {
		body, _ := json.Marshal(done)
		h.Set("Content-Type", "application/json")
		return &recorded{header: h, body: body}
	}

	var buf bytes.Buffer
	seq := 0
	event := func(typ string, fields ...field) {
		fmt.Fprintf(&buf, "event: %s\ndata: {\"type\":%q,\"sequence_number\":%d", typ, typ, seq)
		for _, f := range fields {
			v, _ := json.Marshal(f.value)
			fmt.Fprintf(&buf, ",%q:%s", f.key, v)
		}
		buf.WriteString("}\n\n")
		seq++
	}
	event("response.created", field{"response", in.response(c, nil, nil)})
	event("response.in_progress", field{"response", in.response(c, nil, nil)})
	for j, o := range outputs {
		at := func(contentIndex bool) []field {
			fs := []field{{"item_id", o.id}, {"output_index", j}}
			if contentIndex {
				fs = append(fs, field{"content_index", 0})
			}
			return fs
		}
		event("response.output_item.added", field{"output_index", j}, field{"item", o.started})
		switch item := o.item.(type) {
		case rsFunctionCall:
			for _, piece := range splitRunes(item.Arguments, 12) {
				event("response.function_call_arguments.delta", append(at(false), field{"delta", piece})...)
			}
			event("response.function_call_arguments.done", append(at(false), field{"arguments", item.Arguments})...)
		case rsMessage:
			event("response.content_part.added", append(at(true), field{"part", rsOutputText{Type: "output_text", Annotations: []any{}, Logprobs: []any{}}})...)
			for _, piece := range fake.SplitWords(c.Content) {
				event("response.output_text.delta", append(at(true), field{"delta", piece}, field{"logprobs", []any{}})...)
			}
			event("response.output_text.done", append(at(true), field{"text", c.Content}, field{"logprobs", []any{}})...)
			event("response.content_part.done", append(at(true), field{"part", item.Content[0]})...)
		}
		event("response.output_item.done", field{"output_index", j}, field{"item", o.item})
	}
	event("response.completed", field{"response", done})
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	return &recorded{header: h, body: buf.Bytes(), sse: true}
}
