package fakeserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// agentRequest declares two tools, as an agent's turn does.
func agentRequest() *llm.Request {
	return &llm.Request{
		Model:     "gpt-4.1-mini",
		MaxTokens: 200,
		Messages:  []llm.Message{{Role: llm.RoleUser, Content: "Order A-17 arrived broken; I want my money back."}},
		Tools: []llm.Tool{
			{Name: "lookup_order", Parameters: json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"}}}`)},
			{Name: "issue_refund", Parameters: json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"},"amount_cents":{"type":"integer"}}}`)},
		},
	}
}

// adapters returns both wire formats' clients of one fake server.
func adapters(t *testing.T, cfg fakeserver.Config) map[string]llm.Client {
	t.Helper()
	_, url := start(t, cfg)
	return map[string]llm.Client{
		"openai":    openai.New(openai.Config{BaseURL: url + "/v1", APIKey: "k"}),
		"anthropic": anthropic.New(anthropic.Config{BaseURL: url, APIKey: "k"}),
	}
}

// answer calls c plainly or streamed and returns the answer.
func answer(t *testing.T, c llm.Client, stream bool, req *llm.Request) *llm.Response {
	t.Helper()
	ctx := context.Background()
	var resp *llm.Response
	var err error
	if stream {
		resp, err = llm.Collect(c.Stream(ctx, req))
	} else {
		resp, err = c.Complete(ctx, req)
	}
	if err != nil {
		t.Fatalf("model call: %v", err)
	}
	return resp
}

// Config.ToolChoice picks the tool and its arguments, or no tool at all, in both wire
// formats, plain and streamed; a tool the request does not declare gets a text answer.
func TestToolChoiceConfigPicksTheToolOrNone(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	pick := func(req *llm.Request) (string, json.RawMessage, bool) {
		calls.Add(1)
		switch {
		case strings.Contains(fake.Prompt(req.Messages), "money back"):
			return "issue_refund", json.RawMessage(`{"order_id": "A-17", "amount_cents": 1299}`), true
		case strings.Contains(fake.Prompt(req.Messages), "undeclared"):
			return "delete_everything", nil, true
		}
		return "", nil, false
	}
	for name, c := range adapters(t, fakeserver.Config{ToolChoice: pick}) {
		for _, stream := range []bool{false, true} {
			resp := answer(t, c, stream, agentRequest())
			if resp.FinishReason != llm.FinishToolCalls || len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Name != "issue_refund" {
				t.Fatalf("%s stream=%v: %+v, want a call to issue_refund", name, stream, resp)
			}
			var args map[string]any
			if err := json.Unmarshal([]byte(resp.ToolCalls[0].Arguments), &args); err != nil || args["order_id"] != "A-17" || args["amount_cents"] != 1299.0 {
				t.Fatalf("%s stream=%v: arguments %q, want the configured ones", name, stream, resp.ToolCalls[0].Arguments)
			}

			req := agentRequest()
			req.Messages[0].Content = "Where is my parcel?"
			resp = answer(t, c, stream, req)
			if resp.FinishReason != llm.FinishStop || len(resp.ToolCalls) != 0 || resp.Content != fake.Summary(req.Messages[0].Content) {
				t.Fatalf("%s stream=%v: %+v, want a text answer and no tool call", name, stream, resp)
			}

			req.Messages[0].Content = "Call an undeclared tool."
			if resp = answer(t, c, stream, req); len(resp.ToolCalls) != 0 || resp.FinishReason != llm.FinishStop {
				t.Fatalf("%s stream=%v: %+v, want no call of a tool the request does not declare", name, stream, resp)
			}
		}
	}
	if n := calls.Load(); n != 12 {
		t.Fatalf("ToolChoice called %d times, want once per request (12)", n)
	}
}

// CallTool with nil arguments calls the named tool with the deterministic arguments of
// its schema; NoToolCalls answers in text although tools are declared.
func TestCallToolAndNoToolCalls(t *testing.T) {
	t.Parallel()
	req := agentRequest()
	for name, c := range adapters(t, fakeserver.Config{ToolChoice: fakeserver.CallTool("issue_refund", nil)}) {
		resp := answer(t, c, false, req)
		want := fake.ToolArguments(req.Tools[1].Parameters, req.Messages[0].Content)
		if len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Name != "issue_refund" || !sameJSON(resp.ToolCalls[0].Arguments, want) {
			t.Fatalf("%s: %+v, want issue_refund(%s)", name, resp.ToolCalls, want)
		}
	}
	for name, c := range adapters(t, fakeserver.Config{ToolChoice: fakeserver.NoToolCalls}) {
		for _, stream := range []bool{false, true} {
			if resp := answer(t, c, stream, req); len(resp.ToolCalls) != 0 || resp.Content == "" {
				t.Fatalf("%s stream=%v: %+v, want text", name, stream, resp)
			}
		}
	}
}

func sameJSON(a, b string) bool {
	var x, y any
	if json.Unmarshal([]byte(a), &x) != nil || json.Unmarshal([]byte(b), &y) != nil {
		return false
	}
	ja, _ := json.Marshal(x)
	jb, _ := json.Marshal(y)
	return string(ja) == string(jb)
}

const refundTools = `,"tools":[{"type":"function","function":{"name":"lookup_order","parameters":{"type":"object","properties":{"order_id":{"type":"string"}}}}},` +
	`{"type":"function","function":{"name":"issue_refund","parameters":{"type":"object","properties":{"amount_cents":{"type":"integer"}}}}}]`

// The request's own tool_choice wins, as on OpenAI: "none" answers in text, a named
// function is called whatever the configuration says, "required" calls a tool even
// when the configuration would not; a named function the request does not declare,
// or a tool_choice without tools, is a 400.
func TestRequestToolChoiceOpenAI(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{ToolChoice: fakeserver.NoToolCalls})
	_, defaults := start(t, fakeserver.Config{})
	for _, tc := range []struct {
		name, url, extra string
		wantTool         string // "" for a text answer
	}{
		{"none", defaults, refundTools + `,"tool_choice":"none"`, ""},
		{"auto with the default", defaults, refundTools + `,"tool_choice":"auto"`, "lookup_order"},
		{"auto with NoToolCalls", url, refundTools + `,"tool_choice":"auto"`, ""},
		{"required with NoToolCalls", url, refundTools + `,"tool_choice":"required"`, "lookup_order"},
		{"named", url, refundTools + `,"tool_choice":{"type":"function","function":{"name":"issue_refund"}}`, "issue_refund"},
	} {
		resp, b := post(t, tc.url+"/v1/chat/completions", chatBody(tc.extra))
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", tc.name, resp.StatusCode, b)
		}
		c := decode(t, b)
		calls := c.Choices[0].Message.ToolCalls
		switch {
		case tc.wantTool == "" && (len(calls) != 0 || c.Choices[0].FinishReason != "stop" || c.Choices[0].Message.Content == nil):
			t.Fatalf("%s: %s, want a text answer", tc.name, b)
		case tc.wantTool != "" && (len(calls) != 1 || calls[0].Function.Name != tc.wantTool || c.Choices[0].FinishReason != "tool_calls"):
			t.Fatalf("%s: %s, want a call to %s", tc.name, b, tc.wantTool)
		}
	}
	for _, extra := range []string{
		refundTools + `,"tool_choice":{"type":"function","function":{"name":"drop_tables"}}`,
		refundTools + `,"tool_choice":"sometimes"`,
		`,"tool_choice":"required"`,
	} {
		resp, b := post(t, defaults+"/v1/chat/completions", chatBody(extra))
		eb, ok := llm.ParseErrorBody(b)
		if resp.StatusCode != 400 || !ok || eb.Type != "invalid_request_error" || eb.Param != "tool_choice" {
			t.Fatalf("tool_choice %s: %d %s, want 400 on param tool_choice", extra, resp.StatusCode, b)
		}
	}
}

// Anthropic's tool_choice: none, auto, any and a named tool, plain and streamed.
func TestRequestToolChoiceAnthropic(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{ToolChoice: fakeserver.NoToolCalls})
	const tools = `"tools":[{"name":"lookup_order","input_schema":{"type":"object","properties":{"order_id":{"type":"string"}}}},` +
		`{"name":"issue_refund","input_schema":{"type":"object","properties":{"amount_cents":{"type":"integer"}}}}]`
	body := func(choice string, stream bool) string {
		return `{"model":"claude-haiku-4-5","max_tokens":100,"stream":` + map[bool]string{true: "true", false: "false"}[stream] +
			`,"messages":[{"role":"user","content":"Refund order A-17."}],` + tools + `,"tool_choice":` + choice + `}`
	}
	for _, tc := range []struct{ choice, wantTool string }{
		{`{"type":"none"}`, ""},
		{`{"type":"auto"}`, ""},
		{`{"type":"any"}`, "lookup_order"},
		{`{"type":"tool","name":"issue_refund"}`, "issue_refund"},
	} {
		for _, stream := range []bool{false, true} {
			resp, b := post(t, url+"/v1/messages", body(tc.choice, stream))
			if resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", tc.choice, resp.StatusCode, b)
			}
			var got llm.Response
			var err error
			if stream {
				got.ToolCalls, got.FinishReason, err = anthropicStreamTools(t, b)
			} else {
				var r *llm.Response
				r, err = anthropic.DecodeMessage(b)
				if r != nil {
					got = *r
				}
			}
			if err != nil {
				t.Fatalf("%s stream=%v: %v in %s", tc.choice, stream, err, b)
			}
			if tc.wantTool == "" && (len(got.ToolCalls) != 0 || got.FinishReason != llm.FinishStop) ||
				tc.wantTool != "" && (len(got.ToolCalls) != 1 || got.ToolCalls[0].Name != tc.wantTool) {
				t.Fatalf("%s stream=%v: %+v, want tool %q", tc.choice, stream, got, tc.wantTool)
			}
		}
	}
	for _, choice := range []string{`{"type":"tool","name":"drop_tables"}`, `{"type":"tool"}`, `{"type":"sometimes"}`} {
		resp, b := post(t, url+"/v1/messages", body(choice, false))
		if eb, ok := llm.ParseErrorBody(b); resp.StatusCode != 400 || !ok || eb.Type != "invalid_request_error" {
			t.Fatalf("tool_choice %s: %d %s, want 400", choice, resp.StatusCode, b)
		}
	}
}

// anthropicStreamTools reads the tool calls and the stop reason of a Messages stream.
func anthropicStreamTools(t *testing.T, b []byte) ([]llm.ToolCall, string, error) {
	t.Helper()
	events, err := sse(t, strings.NewReader(string(b)))
	if err != nil {
		return nil, "", err
	}
	var calls []llm.ToolCall
	stop := ""
	for _, e := range events {
		var ev struct {
			Type         string `json:"type"`
			ContentBlock struct {
				Type, ID, Name string
			} `json:"content_block"`
			Delta struct {
				PartialJSON string `json:"partial_json"`
				StopReason  string `json:"stop_reason"`
			} `json:"delta"`
		}
		if err := json.Unmarshal([]byte(e), &ev); err != nil {
			return nil, "", err
		}
		switch {
		case ev.Type == "content_block_start" && ev.ContentBlock.Type == "tool_use":
			calls = append(calls, llm.ToolCall{ID: ev.ContentBlock.ID, Name: ev.ContentBlock.Name})
		case ev.Type == "content_block_delta" && len(calls) > 0:
			calls[len(calls)-1].Arguments += ev.Delta.PartialJSON
		case ev.Type == "message_delta":
			stop = map[string]string{"end_turn": llm.FinishStop, "tool_use": llm.FinishToolCalls}[ev.Delta.StopReason]
		}
	}
	return calls, stop, nil
}

// Arguments that are not a JSON object are the configuration's mistake: a 400 naming it.
func TestToolChoiceRefusesArgumentsThatAreNotAnObject(t *testing.T) {
	t.Parallel()
	for name, c := range adapters(t, fakeserver.Config{ToolChoice: fakeserver.CallTool("issue_refund", json.RawMessage(`[1,2`))}) {
		_, err := c.Complete(context.Background(), agentRequest())
		var ae *llm.APIError
		if !errors.As(err, &ae) || ae.StatusCode != 400 || !strings.Contains(ae.Message, "issue_refund") {
			t.Fatalf("%s: %v, want a 400 naming the tool", name, err)
		}
	}
}

// A rate limit's 429s are counted per Idempotency-Key as well as in all, so that calls
// of one model (production and a shadow of it) can be told apart; a request without a
// key counts in RateLimited only, and an injected 429 in ByFault only.
func TestRateLimitedCountedByIdempotencyKey(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{RPM: 2})
	send := func(body, key string, want int) {
		t.Helper()
		var header []string
		if key != "" {
			header = []string{"Idempotency-Key", key}
		}
		if resp, b := post(t, url+"/v1/chat/completions", body, header...); resp.StatusCode != want {
			t.Fatalf("key %q: %d %s, want %d", key, resp.StatusCode, b, want)
		}
	}
	send(chatBody(""), "prod-1", 200)
	send(chatBody(""), "shadow-1", 200) // the model's 2 requests of the minute
	send(chatBody(""), "prod-2", 429)
	send(chatBody(""), "prod-2", 429)
	send(chatBody(""), "shadow-1", 429)
	send(chatBody(""), "", 429)
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429})
	send(strings.Replace(chatBody(""), "gpt-4.1-mini", "gpt-4.1", 1), "prod-3", 429) // another model's bucket: the injected 429

	st := s.Stats()
	want := map[string]int64{"prod-2": 2, "shadow-1": 1}
	if st.RateLimited != 4 || len(st.RateLimitedByIdempotencyKey) != len(want) || st.ByFault[string(fakeserver.Fault429)] != 1 {
		t.Fatalf("rate_limited %d, by key %v, by fault %v; want 4, %v, 1 injected", st.RateLimited, st.RateLimitedByIdempotencyKey, st.ByFault, want)
	}
	for k, n := range want {
		if st.RateLimitedByIdempotencyKey[k] != n {
			t.Fatalf("rate_limited_by_idempotency_key %v, want %v", st.RateLimitedByIdempotencyKey, want)
		}
	}
	fetched, err := fakeserver.FetchStats(context.Background(), nil, url)
	if err != nil || fetched.RateLimitedByIdempotencyKey["prod-2"] != 2 {
		t.Fatalf("GET /stats: %+v %v", fetched, err)
	}
}
