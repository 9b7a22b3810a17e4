package fakeserver_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// sdk is the official openai-go client of the fake server at url, without retries,
// so one call is one request.
func sdk(url string) openai.Client {
	return openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("sk-test"), option.WithMaxRetries(0))
}

// rsParams is a Responses request of prompt with instructions, as the chat tests'
// chatBody is one of a system and a user message.
func rsParams() responses.ResponseNewParams {
	return responses.ResponseNewParams{
		Model:        "gpt-4.1-mini",
		Instructions: openai.String("be brief"),
		Input:        responses.ResponseNewParamsInputUnion{OfString: openai.String(prompt)},
	}
}

var sendEmailSchema = map[string]any{"type": "object", "properties": map[string]any{"to": map[string]any{"type": "string"}, "urgent": map[string]any{"type": "boolean"}}}

// The unary answer through the official SDK: a completed response whose one message
// item holds the summary the chat dialect gives for the same prompt, with the same
// usage, and fresh ids.
func TestResponsesThroughOpenAIGoSDK(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{})
	client := sdk(url)
	ctx := context.Background()
	var httpResp *http.Response
	resp, err := client.Responses.New(ctx, rsParams(), option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatal(err)
	}
	want := fake.Summary(prompt)
	if resp.OutputText() != want || !strings.HasPrefix(resp.ID, "resp_") || resp.Object != "response" || resp.Status != responses.ResponseStatusCompleted ||
		resp.Model != "gpt-4.1-mini" || resp.CreatedAt == 0 || resp.CompletedAt == 0 || resp.Instructions.OfString != "be brief" || len(resp.Output) != 1 {
		t.Fatalf("response %s", resp.RawJSON())
	}
	if httpResp.Header.Get("X-Request-Id") == "" || !strings.HasPrefix(httpResp.Header.Get("Content-Type"), "application/json") {
		t.Fatalf("headers %v", httpResp.Header)
	}
	item := resp.Output[0]
	msg := item.AsMessage()
	if item.Type != "message" || !strings.HasPrefix(msg.ID, "msg_") || msg.Status != responses.ResponseOutputMessageStatusCompleted || msg.Role != "assistant" ||
		len(msg.Content) != 1 || msg.Content[0].Type != "output_text" || !msg.Content[0].JSON.Annotations.Valid() {
		t.Fatalf("output item %s", item.RawJSON())
	}
	// Every field the SDK marks required is there.
	for name, f := range map[string]interface{ Valid() bool }{"id": resp.JSON.ID, "access_programs": resp.JSON.AccessPrograms, "created_at": resp.JSON.CreatedAt,
		"error": resp.JSON.Error, "incomplete_details": resp.JSON.IncompleteDetails, "instructions": resp.JSON.Instructions, "metadata": resp.JSON.Metadata,
		"model": resp.JSON.Model, "object": resp.JSON.Object, "output": resp.JSON.Output, "parallel_tool_calls": resp.JSON.ParallelToolCalls,
		"temperature": resp.JSON.Temperature, "tool_choice": resp.JSON.ToolChoice, "tools": resp.JSON.Tools, "top_p": resp.JSON.TopP, "usage": resp.JSON.Usage} {
		if !f.Valid() && !strings.Contains(resp.RawJSON(), `"`+name+`":null`) {
			t.Errorf("field %s missing: %s", name, resp.RawJSON())
		}
	}

	// The chat dialect's answer to the same system and user message: the same text
	// and token counts.
	_, b := post(t, url+"/v1/chat/completions", chatBody(""))
	chat := decode(t, b)
	u := resp.Usage
	if u.InputTokens != int64(chat.Usage.PromptTokens) || u.OutputTokens != int64(chat.Usage.CompletionTokens) || u.TotalTokens != u.InputTokens+u.OutputTokens ||
		u.OutputTokens == 0 || !u.JSON.InputTokensDetails.Valid() || !u.OutputTokensDetails.JSON.ReasoningTokens.Valid() {
		t.Fatalf("usage %s, chat usage %+v", u.RawJSON(), chat.Usage)
	}

	// An input of items with content parts is the same prompt; the ids are fresh.
	p := rsParams()
	p.Input = responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
		responses.ResponseInputItemParamOfMessage(responses.ResponseInputMessageContentListParam{
			{OfInputText: &responses.ResponseInputTextParam{Text: prompt}},
		}, responses.EasyInputMessageRoleUser),
	}}
	again, err := client.Responses.New(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if again.OutputText() != want || again.ID == resp.ID || again.Output[0].ID == msg.ID || again.Usage.InputTokens != u.InputTokens {
		t.Fatalf("items input: %s (first id %s)", again.RawJSON(), resp.ID)
	}
	if st := s.Stats(); st.ByEndpoint["responses"] != 2 || st.ByEndpoint["chat_completions"] != 1 || st.ByStatus["200"] != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// The stream through the official SDK: numbered events from response.created to
// response.completed, the text in several deltas, and the completed response equal
// to the unary one but for ids.
func TestResponsesStreamThroughOpenAIGoSDK(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	client := sdk(url)
	stream := client.Responses.NewStreaming(context.Background(), rsParams())
	var types []string
	var text strings.Builder
	var doneText string
	var completed *responses.Response
	var itemID string
	for stream.Next() {
		ev := stream.Current()
		if ev.SequenceNumber != int64(len(types)) {
			t.Fatalf("event %d (%s) has sequence_number %d", len(types), ev.Type, ev.SequenceNumber)
		}
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.created", "response.in_progress":
			if r := ev.Response; r.Status != responses.ResponseStatusInProgress || len(r.Output) != 0 || !strings.HasPrefix(r.ID, "resp_") {
				t.Fatalf("%s: %s", ev.Type, ev.RawJSON())
			}
		case "response.output_item.added":
			itemID = ev.Item.ID
			if ev.Item.Type != "message" || ev.Item.Status != "in_progress" || ev.OutputIndex != 0 {
				t.Fatalf("%s: %s", ev.Type, ev.RawJSON())
			}
		case "response.content_part.added":
			if ev.Part.Type != "output_text" || ev.ItemID != itemID || ev.ContentIndex != 0 {
				t.Fatalf("%s: %s", ev.Type, ev.RawJSON())
			}
		case "response.output_text.delta":
			if ev.ItemID != itemID {
				t.Fatalf("%s: %s", ev.Type, ev.RawJSON())
			}
			text.WriteString(ev.Delta)
		case "response.output_text.done":
			doneText = ev.Text
		case "response.completed":
			r := ev.AsResponseCompleted().Response
			completed = &r
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	want := fake.Summary(prompt)
	if text.String() != want || doneText != want || completed == nil || completed.OutputText() != want || completed.Status != responses.ResponseStatusCompleted ||
		completed.Usage.OutputTokens == 0 || completed.Usage.TotalTokens != completed.Usage.InputTokens+completed.Usage.OutputTokens || completed.Output[0].ID != itemID {
		t.Fatalf("deltas %q, done %q, completed %+v", text.String(), doneText, completed)
	}
	head := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
	tail := []string{"response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"}
	deltas := len(types) - len(head) - len(tail)
	if deltas < 3 || strings.Join(types[:len(head)], " ") != strings.Join(head, " ") || strings.Join(types[len(types)-len(tail):], " ") != strings.Join(tail, " ") {
		t.Fatalf("events %v", types)
	}

	// On the wire: each event named as its type, no [DONE].
	resp, b := post(t, url+"/v1/responses", `{"model":"gpt-4.1-mini","input":`+jsonString(prompt)+`,"stream":true}`)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") || bytes.Contains(b, []byte("[DONE]")) {
		t.Fatalf("%d %v\n%s", resp.StatusCode, resp.Header, b)
	}
	for _, block := range strings.Split(strings.TrimSuffix(string(b), "\n\n"), "\n\n") {
		name, data, ok := strings.Cut(block, "\n")
		var ev struct{ Type string }
		if !ok || json.Unmarshal([]byte(strings.TrimPrefix(data, "data: ")), &ev) != nil || name != "event: "+ev.Type {
			t.Fatalf("event block %q", block)
		}
	}
}

// A request with function tools is answered with a function_call item (a call_ id and
// an fc_ item id, deterministic arguments), unary and streamed; tool_choice none gets
// text and a named function gets a call to it.
func TestResponsesFunctionCall(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	client := sdk(url)
	ctx := context.Background()
	p := rsParams()
	p.Tools = []responses.ToolUnionParam{responses.ToolParamOfFunction("send_email", sendEmailSchema, false), responses.ToolParamOfFunction("other", nil, false)}
	wantArgs := fake.ToolArguments(json.RawMessage(`{"properties":{"to":{"type":"string"},"urgent":{"type":"boolean"}}}`), prompt)

	resp, err := client.Responses.New(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	call := resp.Output[0].AsFunctionCall()
	if len(resp.Output) != 1 || resp.Output[0].Type != "function_call" || call.Name != "send_email" || call.Arguments != wantArgs ||
		!strings.HasPrefix(call.CallID, "call_") || !strings.HasPrefix(call.ID, "fc_") || call.Status != "completed" || resp.OutputText() != "" {
		t.Fatalf("response %s", resp.RawJSON())
	}
	if len(resp.Tools) != 2 || resp.Tools[0].Name != "send_email" || resp.Tools[0].Type != "function" {
		t.Fatalf("tools echoed %s", resp.JSON.Tools.Raw())
	}

	stream := client.Responses.NewStreaming(ctx, p)
	var args strings.Builder
	var types []string
	var final responses.Response
	for stream.Next() {
		ev := stream.Current()
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_item.added":
			if ev.Item.Type != "function_call" || ev.Item.Name != "send_email" || ev.Item.Arguments.OfString != "" || ev.Item.Status != "in_progress" {
				t.Fatalf("%s: %s", ev.Type, ev.RawJSON())
			}
		case "response.function_call_arguments.delta":
			args.WriteString(ev.Delta)
		case "response.function_call_arguments.done":
			if ev.Arguments != wantArgs {
				t.Fatalf("%s: %s", ev.Type, ev.RawJSON())
			}
		case "response.completed":
			final = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if args.String() != wantArgs || final.Output[0].AsFunctionCall().Arguments != wantArgs || types[len(types)-1] != "response.completed" {
		t.Fatalf("streamed arguments %q, events %v, final %s", args.String(), types, final.RawJSON())
	}

	p.ToolChoice = responses.ResponseNewParamsToolChoiceUnion{OfToolChoiceMode: openai.Opt(responses.ToolChoiceOptionsNone)}
	if resp, err := client.Responses.New(ctx, p); err != nil || resp.OutputText() != fake.Summary(prompt) {
		t.Fatalf("tool_choice none: %v %s", err, resp.RawJSON())
	}
	p.ToolChoice = responses.ResponseNewParamsToolChoiceUnion{OfFunctionTool: &responses.ToolChoiceFunctionParam{Name: "other"}}
	if resp, err := client.Responses.New(ctx, p); err != nil || resp.Output[0].AsFunctionCall().Name != "other" {
		t.Fatalf("tool_choice other: %v %s", err, resp.RawJSON())
	}
}

// A conversation of items (a function call and its output) is read: the prompt is the
// last user message, and a tool's output counts in the input tokens.
func TestResponsesInputItems(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	client := sdk(url)
	p := rsParams()
	p.Input = responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
		responses.ResponseInputItemParamOfMessage(prompt, responses.EasyInputMessageRoleUser),
		responses.ResponseInputItemParamOfFunctionCall(`{"to":"a@example.com"}`, "call_1", "send_email"),
		responses.ResponseInputItemParamOfFunctionCallOutput("sent"),
		responses.ResponseInputItemParamOfMessage("Thanks.", responses.EasyInputMessageRoleAssistant),
	}}
	p.Input.OfInputItemList[2].OfFunctionCallOutput.CallID = openai.String("call_1")
	resp, err := client.Responses.New(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	if resp.OutputText() != fake.Summary(prompt) {
		t.Fatalf("text %q", resp.OutputText())
	}
	// A function_call_output whose output is neither a string nor parts is refused,
	// OpenAI-shaped.
	_, b := post(t, url+"/v1/responses", `{"model":"m","input":[{"role":"user","content":"hi"},{"type":"function_call_output","call_id":"c","output":5}]}`)
	if eb, ok := llm.ParseErrorBody(b); !ok || eb.Param != "input[1].output" || eb.Type != "invalid_request_error" || eb.Code != "invalid_type" {
		t.Fatalf("bad output: %s", b)
	}
}

// DropStream cuts a stream halfway through its events: the SDK sees some events, then
// an error, and never response.completed.
func TestResponsesDropStream(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop})
	client := sdk(url)
	stream := client.Responses.NewStreaming(context.Background(), rsParams())
	var types []string
	for stream.Next() {
		types = append(types, stream.Current().Type)
	}
	if stream.Err() == nil || len(types) < 3 || types[0] != "response.created" || strings.Contains(strings.Join(types, " "), "response.completed") {
		t.Fatalf("events %v, err %v: want some events, an error, no response.completed", types, stream.Err())
	}

	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop})
	resp, err := http.Post(url+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"hi","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !errors.Is(err, io.ErrUnexpectedEOF) || !bytes.Contains(b, []byte("event: response.created")) || bytes.Contains(b, []byte("response.completed")) {
		t.Fatalf("raw: err %v after\n%s", err, b)
	}
	if st := s.Stats(); st.ByFault["drop_stream"] != 2 || st.ByEndpoint["responses"] != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// A stream failing mid-generation ends with OpenAI's error event, numbered after the
// events sent, and the SDK reports it.
func TestResponsesStreamError(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultStreamError})
	_, b := post(t, url+"/v1/responses", `{"model":"m","input":"hello there","stream":true}`)
	events, _ := sse(t, bytes.NewReader(b))
	var last struct {
		Type           string
		SequenceNumber int `json:"sequence_number"`
		Error          struct{ Type, Code, Message string }
	}
	if err := json.Unmarshal([]byte(events[len(events)-1]), &last); err != nil || last.Type != "error" || last.SequenceNumber != len(events)-1 ||
		last.Error.Code != "server_error" || last.Error.Message == "" || bytes.Contains(b, []byte("response.completed")) {
		t.Fatalf("last event %s (of %d): %v", events[len(events)-1], len(events), err)
	}

	s.Script(fakeserver.Fault{Kind: fakeserver.FaultStreamError})
	client := sdk(url)
	stream := client.Responses.NewStreaming(context.Background(), rsParams())
	n := 0
	for stream.Next() {
		n++
	}
	if stream.Err() == nil || !strings.Contains(stream.Err().Error(), "server_error") || n == 0 {
		t.Fatalf("%d events, err %v", n, stream.Err())
	}
}

// Fail429 answers OpenAI's 429 (rate_limit_exceeded, Retry-After) on the Responses
// endpoint, which the SDK reads as an *openai.Error; the other error faults follow.
func TestResponsesErrorFaults(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{RetryAfter: 2 * time.Second, MaxInputChars: 50})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429}, fakeserver.Fault{Kind: fakeserver.Fault503}, fakeserver.Fault{Kind: fakeserver.FaultQuota})
	client := sdk(url)
	for _, want := range []struct {
		status     int
		typ, code  string
		retryAfter string
	}{{429, "requests", "rate_limit_exceeded", "2"}, {503, "server_error", "", ""}, {429, "insufficient_quota", "insufficient_quota", ""}} {
		short := rsParams()
		short.Instructions = openai.String("")
		short.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String("hi")}
		_, err := client.Responses.New(context.Background(), short)
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != want.status || apiErr.Type != want.typ || apiErr.Code != want.code || apiErr.Message == "" ||
			apiErr.Response.Header.Get("Retry-After") != want.retryAfter {
			t.Fatalf("want %+v, got %v", want, err)
		}
		if want.status == 429 && want.code == "rate_limit_exceeded" {
			if b := apiErr.DumpResponse(true); !bytes.Contains(b, []byte(`"error":{"message":"Rate limit reached for gpt-4.1-mini`)) {
				t.Fatalf("429 body:\n%s", b)
			}
		}
	}
	// The context window, in the Responses API's words.
	_, err := client.Responses.New(context.Background(), rsParams())
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Code != "context_length_exceeded" || apiErr.Param != "input" {
		t.Fatalf("context length: %v", err)
	}
	if st := s.Stats(); st.ByStatus["429"] != 2 || st.ByStatus["503"] != 1 || st.ByStatus["400"] != 1 || st.ByFault["fail_429"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// A limited server sends OpenAI's x-ratelimit-* headers on the Responses endpoint,
// and refuses a request over the limit with OpenAI's 429.
func TestResponsesRateLimitHeaders(t *testing.T) {
	t.Parallel()
	// 10 tokens a second refill: the token headers stay within a second or two of
	// the charge.
	s, url := start(t, fakeserver.Config{RPM: 2, TPM: 600})
	client := sdk(url)
	ctx := context.Background()
	p := rsParams()
	p.MaxOutputTokens = openai.Int(16) // the estimate (prompt plus 16) fits the token limit twice
	var httpResp *http.Response
	resp, err := client.Responses.New(ctx, p, option.WithResponseInto(&httpResp))
	if err != nil {
		t.Fatal(err)
	}
	h := httpResp.Header
	if h.Get("X-Ratelimit-Limit-Requests") != "2" || h.Get("X-Ratelimit-Remaining-Requests") != "1" || h.Get("X-Ratelimit-Limit-Tokens") != "600" ||
		h.Get("X-Ratelimit-Reset-Requests") == "" || h.Get("X-Ratelimit-Reset-Tokens") == "" || h.Get("Anthropic-Ratelimit-Requests-Limit") != "" {
		t.Fatalf("headers %v", h)
	}
	rl, ok := llm.ParseRateLimit(h, time.Now())
	// A plain answer's token charge is corrected to its usage before its headers.
	if left := 600 - resp.Usage.TotalTokens; !ok || rl.Requests.Limit != 2 || rl.Tokens.Limit != 600 || rl.Tokens.Remaining < left-1 || rl.Tokens.Remaining > left+20 {
		t.Fatalf("parsed %+v (usage %d)", rl, resp.Usage.TotalTokens)
	}

	stream := client.Responses.NewStreaming(ctx, p, option.WithResponseInto(&httpResp))
	for stream.Next() {
	}
	if stream.Err() != nil || httpResp.Header.Get("X-Ratelimit-Remaining-Requests") != "0" {
		t.Fatalf("stream: %v, headers %v", stream.Err(), httpResp.Header)
	}

	_, err = client.Responses.New(ctx, p)
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 || apiErr.Type != "requests" || apiErr.Code != "rate_limit_exceeded" ||
		apiErr.Response.Header.Get("Retry-After") == "" || apiErr.Response.Header.Get("Retry-After-Ms") == "" ||
		apiErr.Response.Header.Get("X-Ratelimit-Limit-Requests") != "2" {
		t.Fatalf("over the limit: %v", err)
	}
	if st := s.Stats(); st.RateLimited != 1 || st.ByEndpoint["responses"] != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// HonourIdempotency replays the first answer to a repeated Idempotency-Key on the
// Responses endpoint, plain and streamed (each its own), and /stats counts the keys.
func TestResponsesHonourIdempotency(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{HonourIdempotency: true})
	client := sdk(url)
	ctx := context.Background()
	p := rsParams()
	p.Temperature = openai.Float(1) // samples differ unless replayed
	var r1, r2 *http.Response
	a, err := client.Responses.New(ctx, p, option.WithHeader("Idempotency-Key", "job-1"), option.WithResponseInto(&r1))
	if err != nil {
		t.Fatal(err)
	}
	b, err := client.Responses.New(ctx, p, option.WithHeader("Idempotency-Key", "job-1"), option.WithResponseInto(&r2))
	if err != nil {
		t.Fatal(err)
	}
	if a.RawJSON() != b.RawJSON() || r2.Header.Get("Idempotent-Replayed") != "true" || r1.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("not a replay:\n%s\n%s", a.RawJSON(), b.RawJSON())
	}
	c, err := client.Responses.New(ctx, p, option.WithHeader("Idempotency-Key", "job-2"))
	if err != nil || c.ID == a.ID || c.OutputText() == a.OutputText() {
		t.Fatalf("another key: %v %s", err, c.RawJSON())
	}

	streamed := func() (string, string) {
		var hr *http.Response
		stream := client.Responses.NewStreaming(ctx, p, option.WithHeader("Idempotency-Key", "job-1"), option.WithResponseInto(&hr))
		var id string
		for stream.Next() {
			if ev := stream.Current(); ev.Type == "response.completed" {
				id = ev.Response.ID
			}
		}
		if stream.Err() != nil {
			t.Fatal(stream.Err())
		}
		return id, hr.Header.Get("Idempotent-Replayed")
	}
	id1, replayed1 := streamed()
	id2, replayed2 := streamed()
	if id1 == "" || id1 == a.ID || id1 != id2 || replayed1 != "" || replayed2 != "true" {
		t.Fatalf("streams: %s (%q) then %s (%q); plain %s", id1, replayed1, id2, replayed2, a.ID)
	}
	if st := s.Stats(); st.Requests != 5 || st.ByEndpoint["responses"] != 5 || st.ByIdempotencyKey["job-1"] != 4 || st.ByIdempotencyKey["job-2"] != 1 || st.Replayed != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestResponsesBadRequests(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	for _, tc := range []struct{ body, param string }{
		{`not json`, ""},
		{`{"input":"x"}`, "model"},
		{`{"model":"m"}`, "input"},
		{`{"model":"m","input":[]}`, "input"},
		{`{"model":"m","input":5}`, "input"},
		{`{"model":"m","input":[{"role":"wizard","content":"x"}]}`, "input[0].role"},
		{`{"model":"m","input":[{"type":"message","content":"x"}]}`, "input[0].role"},
		{`{"model":"m","input":[{"role":"user","content":5}]}`, "input[0].content"},
		{`{"model":"m","input":"x","temperature":3}`, "temperature"},
		{`{"model":"m","input":"x","max_output_tokens":5}`, "max_output_tokens"},
		{`{"model":"m","input":"x","instructions":7}`, "instructions"},
		{`{"model":"m","input":"x","tools":[{"type":"function"}]}`, "tools[0].name"},
		{`{"model":"m","input":"x","tool_choice":"required"}`, "tool_choice"},
		{`{"model":"m","input":"x","tool_choice":"sometimes"}`, "tool_choice"},
		{`{"model":"m","input":"x","tools":[{"type":"function","name":"a"}],"tool_choice":{"type":"function","name":"b"}}`, "tool_choice"},
	} {
		resp, b := post(t, url+"/v1/responses", tc.body)
		if eb, ok := llm.ParseErrorBody(b); resp.StatusCode != 400 || !ok || eb.Type != "invalid_request_error" || eb.Param != tc.param || eb.Message == "" {
			t.Errorf("%s: %d %s", tc.body, resp.StatusCode, b)
		}
	}
	// Hosted tools are echoed and never called; their tool_choice gets text.
	resp, b := post(t, url+"/v1/responses", `{"model":"m","input":"x","tools":[{"type":"web_search_preview"}],"tool_choice":{"type":"web_search_preview"}}`)
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"tools":[{"type":"web_search_preview"}]`) || !strings.Contains(string(b), `"type":"output_text"`) {
		t.Fatalf("hosted tool: %d %s", resp.StatusCode, b)
	}
}

// FuzzResponsesRequest sends arbitrary bodies to /v1/responses: the server answers 200
// (valid JSON, or a stream ending in response.completed) or a 4xx with OpenAI's error
// body, never a 5xx or a panic.
func FuzzResponsesRequest(f *testing.F) {
	f.Add([]byte(`{"model":"m","input":"hello","instructions":"be brief","max_output_tokens":64}`))
	f.Add([]byte(`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hi"},{"type":"input_image","image_url":"x"}]}],"stream":true}`))
	f.Add([]byte(`{"model":"m","input":[{"type":"function_call","call_id":"c","name":"n","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":[{"type":"input_text","text":"r"}]},{"type":"reasoning","id":"rs_1"}]}`))
	f.Add([]byte(`{"model":"m","input":"x","tools":[{"type":"function","name":"f","parameters":{"properties":{"a":{"type":"integer"}}}}],"tool_choice":{"type":"allowed_tools","mode":"required","tools":[]},"stream":true}`))
	f.Add([]byte(`{"model":"m","input":"x","temperature":0.5,"metadata":{"k":"v"},"text":{"format":{"type":"json_object"}},"store":false}`))
	f.Add([]byte("{\"model\":\"m\",\"input\":\"x\",\"stream\":true,\n \"metadata\": {\n  \"k\": \"v\"\n },\n \"tools\": [ {\"type\": \"web_search\"\n} ]}"))
	s, err := fakeserver.New(fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsStable, MaxInputChars: 1000})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		w := httptest.NewRecorder()
		s.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/responses", bytes.NewReader(body)))
		switch {
		case w.Code == 200 && strings.HasPrefix(w.Header().Get("Content-Type"), "text/event-stream"):
			if !bytes.HasSuffix(w.Body.Bytes(), []byte("}\n\n")) || !bytes.Contains(w.Body.Bytes(), []byte("event: response.completed\n")) {
				t.Fatalf("stream without response.completed: %s", w.Body.Bytes())
			}
			for _, block := range strings.Split(strings.TrimSuffix(w.Body.String(), "\n\n"), "\n\n") {
				if name, data, _ := strings.Cut(block, "\n"); !strings.HasPrefix(name, "event: ") || !strings.HasPrefix(data, "data: ") || !json.Valid([]byte(data[6:])) {
					t.Fatalf("event block %q", block)
				}
			}
		case w.Code == 200:
			if !json.Valid(w.Body.Bytes()) {
				t.Fatalf("200 with invalid JSON: %s", w.Body.Bytes())
			}
		case w.Code >= 400 && w.Code < 500:
			if eb, ok := llm.ParseErrorBody(w.Body.Bytes()); !ok || eb.Type == "" {
				t.Fatalf("%d without an OpenAI error body: %s", w.Code, w.Body.Bytes())
			}
		default:
			t.Fatalf("status %d for %q", w.Code, body)
		}
	})
}
