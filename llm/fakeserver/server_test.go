package fakeserver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// start serves a fake server on a loopback port for the test's lifetime.
func start(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, string) {
	t.Helper()
	s, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(func() { s.Close(); ts.Close() })
	return s, ts.URL
}

const prompt = "Summarise for the account team:\n\nThe March invoice was charged twice and the customer wants a refund by Friday."

func chatBody(extra string) string {
	b, _ := json.Marshal(prompt)
	return `{"model":"gpt-4.1-mini","messages":[{"role":"system","content":"be brief"},{"role":"user","content":` + string(b) + `}]` + extra + `}`
}

func post(t *testing.T, url, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp, b
}

type oaCompletion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Message struct {
			Content   *string `json:"content"`
			ToolCalls []struct {
				ID       string `json:"id"`
				Type     string `json:"type"`
				Function struct{ Name, Arguments string }
			} `json:"tool_calls"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

func decode(t *testing.T, b []byte) oaCompletion {
	t.Helper()
	var c oaCompletion
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return c
}

func TestChatCompletionIsDeterministicPerPromptWithFreshIDs(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	resp, b := post(t, url+"/v1/chat/completions", chatBody(""))
	if resp.StatusCode != 200 || resp.Header.Get("X-Request-Id") == "" || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
	}
	a := decode(t, b)
	want := fake.Summary(prompt)
	if a.Object != "chat.completion" || !strings.HasPrefix(a.ID, "chatcmpl-") || a.Model != "gpt-4.1-mini" || len(a.Choices) != 1 ||
		*a.Choices[0].Message.Content != want || a.Choices[0].FinishReason != "stop" || a.Usage.TotalTokens != a.Usage.PromptTokens+a.Usage.CompletionTokens {
		t.Fatalf("completion %s", b)
	}
	_, b2 := post(t, url+"/v1/chat/completions", chatBody(`,"temperature":0`))
	c := decode(t, b2)
	if c.ID == a.ID || *c.Choices[0].Message.Content != want {
		t.Fatalf("second answer: id %s (first %s), content %q", c.ID, a.ID, *c.Choices[0].Message.Content)
	}
}

func TestTemperatureAboveZeroSamples(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{Seed: 7})
	_, b1 := post(t, url+"/v1/chat/completions", chatBody(`,"temperature":1`))
	_, b2 := post(t, url+"/v1/chat/completions", chatBody(`,"temperature":1`))
	c1, c2 := *decode(t, b1).Choices[0].Message.Content, *decode(t, b2).Choices[0].Message.Content
	if c1 == c2 || !strings.HasPrefix(c1, fake.Summary(prompt)+" [sample ") {
		t.Fatalf("contents %q and %q: want the summary plus different samples", c1, c2)
	}
}

// sse reads a server-sent event stream and returns each event's data.
func sse(t *testing.T, r io.Reader) ([]string, error) {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, d)
		}
	}
	return out, sc.Err()
}

func TestChatCompletionStream(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	resp, b := post(t, url+"/v1/chat/completions", chatBody(`,"stream":true,"stream_options":{"include_usage":true}`))
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	events, _ := sse(t, bytes.NewReader(b))
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("last event %q", events[len(events)-1])
	}
	var content strings.Builder
	var finish string
	var usage int
	for _, e := range events[:len(events)-1] {
		var ch struct {
			ID      string
			Object  string
			Choices []struct {
				Delta        struct{ Content string }
				FinishReason *string `json:"finish_reason"`
			}
			Usage *struct {
				TotalTokens int `json:"total_tokens"`
			}
		}
		if err := json.Unmarshal([]byte(e), &ch); err != nil || ch.Object != "chat.completion.chunk" || !strings.HasPrefix(ch.ID, "chatcmpl-") {
			t.Fatalf("chunk %s: %v", e, err)
		}
		for _, c := range ch.Choices {
			content.WriteString(c.Delta.Content)
			if c.FinishReason != nil {
				finish = *c.FinishReason
			}
		}
		if ch.Usage != nil {
			usage = ch.Usage.TotalTokens
		}
	}
	if content.String() != fake.Summary(prompt) || finish != "stop" || usage == 0 {
		t.Fatalf("content %q finish %q usage %d", content.String(), finish, usage)
	}
}

const toolsJSON = `,"tools":[{"type":"function","function":{"name":"send_email","parameters":{"type":"object","properties":{"to":{"type":"string"},"urgent":{"type":"boolean"}}}}},{"type":"function","function":{"name":"other"}}]`

func TestToolCallIDsStableAndRandom(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{fakeserver.ToolCallIDsStable, fakeserver.ToolCallIDsRandom} {
		_, url := start(t, fakeserver.Config{ToolCallIDs: mode})
		var ids, args []string
		for range 2 {
			_, b := post(t, url+"/v1/chat/completions", chatBody(toolsJSON))
			c := decode(t, b)
			if c.Choices[0].FinishReason != "tool_calls" || len(c.Choices[0].Message.ToolCalls) != 1 || c.Choices[0].Message.Content != nil {
				t.Fatalf("%s: %s", mode, b)
			}
			tc := c.Choices[0].Message.ToolCalls[0]
			if tc.Function.Name != "send_email" || tc.Type != "function" || !strings.HasPrefix(tc.ID, "call_") {
				t.Fatalf("%s: tool call %+v", mode, tc)
			}
			ids, args = append(ids, tc.ID), append(args, tc.Function.Arguments)
		}
		if args[0] != args[1] || args[0] != fake.ToolArguments(json.RawMessage(`{"properties":{"to":{"type":"string"},"urgent":{"type":"boolean"}}}`), prompt) {
			t.Fatalf("%s: arguments %q not deterministic", mode, args)
		}
		if (ids[0] == ids[1]) != (mode == fakeserver.ToolCallIDsStable) {
			t.Fatalf("%s: ids %v", mode, ids)
		}
	}
}

func TestHonourIdempotency(t *testing.T) {
	t.Parallel()
	for _, honour := range []bool{false, true} {
		s, url := start(t, fakeserver.Config{HonourIdempotency: honour})
		r1, b1 := post(t, url+"/v1/chat/completions", chatBody(`,"temperature":1`), "Idempotency-Key", "job-1")
		r2, b2 := post(t, url+"/v1/chat/completions", chatBody(`,"temperature":1`), "Idempotency-Key", "job-1")
		_, b3 := post(t, url+"/v1/chat/completions", chatBody(`,"temperature":1`), "Idempotency-Key", "job-2")
		if honour {
			if !bytes.Equal(b1, b2) || r2.Header.Get("Idempotent-Replayed") != "true" || r1.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("honour: second answer not a byte-identical replay:\n%s\n%s", b1, b2)
			}
			if decode(t, b3).ID == decode(t, b1).ID {
				t.Fatal("honour: another key got the same answer")
			}
		} else if decode(t, b1).ID == decode(t, b2).ID || bytes.Equal(b1, b2) {
			t.Fatalf("ignore: a repeated key was replayed:\n%s\n%s", b1, b2)
		}
		st, err := fakeserver.FetchStats(context.Background(), nil, url+"/v1")
		if err != nil {
			t.Fatal(err)
		}
		wantReplayed := int64(0)
		if honour {
			wantReplayed = 1
		}
		if st.Requests != 3 || st.ByIdempotencyKey["job-1"] != 2 || st.ByIdempotencyKey["job-2"] != 1 || st.Replayed != wantReplayed || st.ByStatus["200"] != 3 {
			t.Fatalf("honour=%t: stats %+v", honour, st)
		}
		if s.Stats().Requests != 3 {
			t.Fatal("in-process Stats disagrees with /stats")
		}
	}
}

func TestRepeatedKeyWhileInProgressGets409(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{HonourIdempotency: true, Latency: 300 * time.Millisecond})
	var wg sync.WaitGroup
	codes := make([]int, 2)
	for i := range 2 {
		wg.Go(func() {
			if i == 1 {
				time.Sleep(100 * time.Millisecond) // arrive while the first is being produced
			}
			resp, b := post(t, url+"/v1/chat/completions", chatBody(""), "Idempotency-Key", "same")
			codes[i] = resp.StatusCode
			if resp.StatusCode == 409 {
				if eb, ok := llm.ParseErrorBody(b); !ok || eb.Code != "idempotency_key_in_use" || resp.Header.Get("Retry-After") == "" {
					t.Errorf("409 body %s", b)
				}
			}
		})
	}
	wg.Wait()
	if codes[0] != 200 || codes[1] != 409 {
		t.Fatalf("codes %v, want [200 409]", codes)
	}
	if resp, _ := post(t, url+"/v1/chat/completions", chatBody(""), "Idempotency-Key", "same"); resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatal("after the first finished, a repeat is not a replay")
	}
}

func TestErrorFaultsAreProviderShaped(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{RetryAfter: 2 * time.Second, MaxInputChars: 50})
	dateHeader := http.Header{"Retry-After": {"Wed, 21 Oct 2026 07:28:00 GMT"}, "Retry-After-Ms": {"1500"}}
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429}, fakeserver.Fault{Kind: fakeserver.Fault429, Header: dateHeader},
		fakeserver.Fault{Kind: fakeserver.Fault503}, fakeserver.Fault{Kind: fakeserver.FaultQuota}, fakeserver.Fault{Kind: fakeserver.FaultMalformed})
	cases := []struct {
		status     int
		typ, code  string
		retryAfter string
	}{
		{429, "requests", "rate_limit_exceeded", "2"},
		{429, "requests", "rate_limit_exceeded", "Wed, 21 Oct 2026 07:28:00 GMT"},
		{503, "server_error", "", ""},
		{429, "insufficient_quota", "insufficient_quota", ""},
	}
	short := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	for i, tc := range cases {
		resp, b := post(t, url+"/v1/chat/completions", short)
		eb, ok := llm.ParseErrorBody(b)
		if resp.StatusCode != tc.status || !ok || eb.Type != tc.typ || eb.Code != tc.code || eb.Message == "" || resp.Header.Get("Retry-After") != tc.retryAfter {
			t.Fatalf("fault %d: %d %s Retry-After %q", i, resp.StatusCode, b, resp.Header.Get("Retry-After"))
		}
		if i == 1 && resp.Header.Get("Retry-After-Ms") != "1500" {
			t.Fatal("scripted header missing")
		}
	}
	resp, b := post(t, url+"/v1/chat/completions", short)
	if resp.StatusCode != 200 || json.Valid(b) {
		t.Fatalf("malformed: %d %s", resp.StatusCode, b)
	}
	resp, b = post(t, url+"/v1/chat/completions", chatBody(""))
	if eb, _ := llm.ParseErrorBody(b); resp.StatusCode != 400 || eb.Code != "context_length_exceeded" || eb.Param != "messages" {
		t.Fatalf("context length: %d %s", resp.StatusCode, b)
	}
	st := s.Stats()
	if st.Requests != 6 || st.ByStatus["429"] != 3 || st.ByStatus["503"] != 1 || st.ByStatus["400"] != 1 || st.ByStatus["200"] != 1 ||
		st.ByFault["fail_429"] != 2 || st.ByFault["malformed"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestForcedFault switches a provider outage on and off at run time through POST
// /_fault: every request in between gets the fault, the script waits, and the
// endpoint refuses kinds it cannot force.
func TestForcedFault(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429})
	short := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	ctx := context.Background()
	if err := fakeserver.SetFault(ctx, nil, url+"/v1", fakeserver.Fault503); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if resp, b := post(t, url+"/v1/chat/completions", short); resp.StatusCode != 503 {
			t.Fatalf("request %d while 503 is forced: %d %s", i, resp.StatusCode, b)
		}
	}
	resp, err := http.Get(url + "/_fault")
	if err != nil {
		t.Fatal(err)
	}
	var got struct{ Fault string }
	_ = json.NewDecoder(resp.Body).Decode(&got)
	resp.Body.Close()
	if got.Fault != "fail_503" {
		t.Fatalf("GET /_fault: %+v", got)
	}
	for _, bad := range []string{`{"fault":"teapot"}`, `{}`, `{"fault":"fail_503","extra":1}`} {
		if resp, b := post(t, url+"/_fault", bad); resp.StatusCode != 400 {
			t.Errorf("POST /_fault %s: %d %s", bad, resp.StatusCode, b)
		}
	}
	if err := fakeserver.SetFault(ctx, nil, url, "teapot"); err == nil || !strings.Contains(err.Error(), "400") {
		t.Errorf("SetFault(teapot) = %v, want the 400", err)
	}
	if err := s.Force("teapot"); !errors.Is(err, fakeserver.ErrUnknownFault) {
		t.Errorf("Force(teapot) = %v, want ErrUnknownFault", err)
	}
	if err := fakeserver.SetFault(ctx, nil, url, fakeserver.FaultNone); err != nil {
		t.Fatal(err)
	}
	// The scripted 429 waited for the outage to end, then the server answers again.
	if resp, b := post(t, url+"/v1/chat/completions", short); resp.StatusCode != 429 {
		t.Fatalf("first request after the outage: %d %s, want the scripted 429", resp.StatusCode, b)
	}
	if resp, b := post(t, url+"/v1/chat/completions", short); resp.StatusCode != 200 {
		t.Fatalf("second request after the outage: %d %s", resp.StatusCode, b)
	}
	if st := s.Stats(); st.Requests != 5 || st.ByStatus["503"] != 3 || st.ByFault["fail_503"] != 3 || st.ByStatus["200"] != 1 {
		t.Fatalf("stats %+v", st)
	}
	forced, _ := start(t, fakeserver.Config{Fault: fakeserver.FaultHang})
	if forced.Forced() != fakeserver.FaultHang {
		t.Fatalf("Config.Fault hang: forced %q", forced.Forced())
	}
}

func TestBadRequests(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	for _, body := range []string{`not json`, `{}`, `{"model":"m"}`, `{"model":"m","messages":[{"role":"wizard","content":"x"}]}`,
		`{"model":"m","messages":[{"role":"user","content":5}]}`, `{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}`} {
		resp, b := post(t, url+"/v1/chat/completions", body)
		if eb, ok := llm.ParseErrorBody(b); resp.StatusCode != 400 || !ok || eb.Type != "invalid_request_error" {
			t.Errorf("%s: %d %s", body, resp.StatusCode, b)
		}
	}
	resp, _ := post(t, url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"`+strings.Repeat("x", fakeserver.MaxBodyBytes)+`"}]}`)
	if resp.StatusCode != 413 {
		t.Errorf("oversized body: %d", resp.StatusCode)
	}
	resp, err := http.Get(url + "/v1/nothing")
	if err != nil || resp.StatusCode != 404 {
		t.Fatalf("unknown path: %v %v", resp, err)
	}
	resp.Body.Close()
}

func TestModelsListsTheDefaultModel(t *testing.T) {
	t.Parallel()
	_, url := start(t, fakeserver.Config{})
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Object string
		Data   []struct{ ID, Object string }
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || list.Object != "list" || len(list.Data) == 0 || list.Data[0].ID != "gpt-4.1-mini" {
		t.Fatalf("models %+v %v", list, err)
	}
}

func TestHangNeverAnswersButCounts(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{Hang: 1})
	client := &http.Client{Timeout: 200 * time.Millisecond}
	_, err := client.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("")))
	if err == nil {
		t.Fatal("a hung request answered")
	}
	st := s.Stats()
	if st.Requests != 1 || st.ByFault["hang"] != 1 || len(st.ByStatus) != 0 {
		t.Fatalf("stats %+v", st)
	}
	waitFor(t, func() bool { return s.Stats().InFlight == 0 }) // the handler ends when the client leaves
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestDripSendsOneByteAtATime(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{DripInterval: time.Millisecond})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrip})
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got []byte
	reads := 0
	buf := make([]byte, 64)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			reads++
			got = append(got, buf[:n]...)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if !json.Valid(got) || reads < len(got)/2 {
		t.Fatalf("%d bytes in %d reads (valid JSON %t): not dripped", len(got), reads, json.Valid(got))
	}
	if s.Stats().ByFault["drip"] != 1 {
		t.Fatal("drip not counted")
	}
}

func TestDropStreamClosesHalfway(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{DropStream: 1})
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(`,"stream":true`)))
	if err != nil {
		t.Fatal(err)
	}
	events, err := sse(t, resp.Body)
	resp.Body.Close()
	if !errors.Is(err, io.ErrUnexpectedEOF) || len(events) == 0 || events[len(events)-1] == "[DONE]" {
		t.Fatalf("%d events, last %q, err %v: want some events then unexpected EOF", len(events), events[len(events)-1], err)
	}
	resp, err = http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("")))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !errors.Is(err, io.ErrUnexpectedEOF) || len(b) == 0 {
		t.Fatalf("plain answer: %d bytes, err %v", len(b), err)
	}
	if st := s.Stats(); st.Requests != 2 || st.ByFault["drop_stream"] != 2 || st.ByStatus["200"] != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestAnthropicMessages(t *testing.T) {
	t.Parallel()
	s, url := start(t, fakeserver.Config{RetryAfter: 3 * time.Second})
	body := `{"model":"claude-sonnet-4-5","max_tokens":100,"system":"be brief","messages":[{"role":"user","content":[{"type":"text","text":` + jsonString(prompt) + `}]}]}`
	resp, b := post(t, url+"/v1/messages", body)
	var m struct {
		ID, Type, Role string
		Content        []struct{ Type, Text string }
		StopReason     string `json:"stop_reason"`
		Usage          struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		}
	}
	if err := json.Unmarshal(b, &m); err != nil || resp.StatusCode != 200 || !strings.HasPrefix(m.ID, "msg_") || m.Type != "message" ||
		m.Content[0].Text != fake.Summary(prompt) || m.StopReason != "end_turn" || m.Usage.OutputTokens == 0 || resp.Header.Get("Request-Id") == "" {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}

	_, b = post(t, url+"/v1/messages", strings.Replace(body, `"max_tokens":100,`, `"max_tokens":100,"stream":true,`, 1))
	events, _ := sse(t, bytes.NewReader(b))
	var text strings.Builder
	for _, e := range events {
		var ev struct {
			Type  string
			Delta struct{ Type, Text string }
		}
		_ = json.Unmarshal([]byte(e), &ev)
		if ev.Type == "content_block_delta" {
			text.WriteString(ev.Delta.Text)
		}
	}
	if text.String() != fake.Summary(prompt) || !strings.Contains(string(b), "event: message_stop") {
		t.Fatalf("stream text %q", text.String())
	}

	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429}, fakeserver.Fault{Kind: fakeserver.Fault503}, fakeserver.Fault{Kind: fakeserver.FaultQuota})
	for _, want := range []struct {
		status     int
		typ, code  string
		retryAfter string
	}{{429, "rate_limit_error", "", "3"}, {529, "overloaded_error", "", "3"}, {429, "rate_limit_error", "enforced_spend_limit_reached", ""}} {
		resp, b := post(t, url+"/v1/messages", body)
		eb, ok := llm.ParseErrorBody(b)
		if resp.StatusCode != want.status || !ok || eb.Type != want.typ || eb.Code != want.code || resp.Header.Get("Retry-After") != want.retryAfter ||
			!strings.Contains(string(b), `"type":"error"`) {
			t.Fatalf("%d %s (Retry-After %q), want %+v", resp.StatusCode, b, resp.Header.Get("Retry-After"), want)
		}
	}
	resp, b = post(t, url+"/v1/messages", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "max_tokens") {
		t.Fatalf("missing max_tokens: %d %s", resp.StatusCode, b)
	}
	if st := s.Stats(); st.ByEndpoint["messages"] != 6 || st.ByStatus["529"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

func TestProbabilitiesAreSeeded(t *testing.T) {
	t.Parallel()
	run := func() []int {
		_, url := start(t, fakeserver.Config{Fail429: 0.3, Fail503: 0.3, Seed: 99})
		var codes []int
		for range 20 {
			resp, _ := post(t, url+"/v1/chat/completions", chatBody(""))
			codes = append(codes, resp.StatusCode)
		}
		return codes
	}
	a, b := run(), run()
	seen := map[int]bool{}
	for i := range a {
		seen[a[i]] = true
		if a[i] != b[i] {
			t.Fatalf("same seed, different faults: %v vs %v", a, b)
		}
	}
	if !seen[200] || !seen[429] || !seen[503] {
		t.Fatalf("20 requests at 30%%/30%% gave only %v", a)
	}
}

func TestNewRefusesAnInvalidConfig(t *testing.T) {
	t.Parallel()
	for _, c := range []fakeserver.Config{{Fail429: 1.5}, {Hang: -0.1}, {ToolCallIDs: "sometimes"}, {MaxInputChars: -1}, {Latency: -time.Second}, {Fault: "teapot"}} {
		if _, err := fakeserver.New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
}

// FuzzRequest sends arbitrary bodies to both model endpoints: the server answers 200
// or a 4xx with a provider-shaped error body, never a 5xx or a panic.
func FuzzRequest(f *testing.F) {
	f.Add([]byte(chatBody("")), false)
	f.Add([]byte(chatBody(`,"stream":true,"stream_options":{"include_usage":true}`+toolsJSON)), false)
	f.Add([]byte(`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}]}],"tools":[{"name":"x","input_schema":{"properties":{"a":{"type":"integer"}}}}]}`), true)
	f.Add([]byte(`{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","function":{"name":"n","arguments":"{}"}}]}]}`), false)
	f.Add([]byte(`{"model":"m","max_tokens":1,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"\u0000"}]}`), true)
	f.Add([]byte(chatBody(toolsJSON+`,"tool_choice":{"type":"function","function":{"name":"other"}}`)), false)
	f.Add([]byte(`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}],"tools":[{"name":"x"}],"tool_choice":{"type":"tool","name":"x"}}`), true)
	s, err := fakeserver.New(fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsStable, MaxInputChars: 1000})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body []byte, anthropic bool) {
		path := "/v1/chat/completions"
		if anthropic {
			path = "/v1/messages"
		}
		w := httptest.NewRecorder()
		s.ServeHTTP(w, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		switch {
		case w.Code == 200:
			if strings.HasPrefix(w.Header().Get("Content-Type"), "application/json") && !json.Valid(w.Body.Bytes()) {
				t.Fatalf("200 with invalid JSON: %s", w.Body.Bytes())
			}
		case w.Code >= 400 && w.Code < 500:
			if _, ok := llm.ParseErrorBody(w.Body.Bytes()); !ok {
				t.Fatalf("%d without a provider error body: %s", w.Code, w.Body.Bytes())
			}
		default:
			t.Fatalf("status %d for %q", w.Code, body)
		}
	})
}
