package anthropic_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// fakeLLM starts fake-llm in-process; the Anthropic SDK talks to its /v1/messages.
func fakeLLM(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, string, *anthropic.Client) {
	t.Helper()
	s, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(func() { s.Close(); ts.Close() })
	return s, ts.URL, anthropic.New(anthropic.Config{BaseURL: ts.URL, APIKey: "sk-ant-test-not-real", Model: "claude-sonnet-4-5"})
}

func stats(t *testing.T, base string) fakeserver.Stats {
	t.Helper()
	st, err := fakeserver.FetchStats(context.Background(), nil, base)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

const prompt = "Summarise for the account team:\n\nThe March invoice was charged twice and the customer wants a refund by Friday."

func summarise(key string) *llm.Request {
	return &llm.Request{
		Messages: []llm.Message{
			{Role: llm.RoleSystem, Content: "You write short summaries."},
			{Role: llm.RoleUser, Content: prompt},
		},
		MaxTokens:      300,
		IdempotencyKey: key,
	}
}

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestCompleteAndStream(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{})
	resp, err := c.Complete(context.Background(), summarise("job-a"))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Content != fake.Summary(prompt) || !strings.HasPrefix(resp.ID, "msg_") || resp.FinishReason != llm.FinishStop ||
		resp.Usage.OutputTokens == 0 || !strings.HasPrefix(resp.RequestID, "req_") || !json.Valid(resp.Raw) {
		t.Fatalf("response %+v", resp)
	}
	streamed, err := llm.Collect(c.Stream(context.Background(), summarise("job-a")))
	if err != nil {
		t.Fatal(err)
	}
	if streamed.Content != resp.Content || !strings.HasPrefix(streamed.ID, "msg_") || streamed.FinishReason != llm.FinishStop ||
		streamed.Usage.InputTokens == 0 || streamed.Usage.OutputTokens == 0 {
		t.Fatalf("streamed %+v", streamed)
	}
	if st := stats(t, base); st.ByEndpoint["messages"] != 2 || st.ByIdempotencyKey["job-a"] != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestRawReplayedByteForByte(t *testing.T) {
	t.Parallel()
	_, _, c := fakeLLM(t, fakeserver.Config{HonourIdempotency: true})
	a, err := c.Complete(context.Background(), summarise("job-r"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Complete(context.Background(), summarise("job-r"))
	if err != nil || !bytes.Equal(a.Raw, b.Raw) || a.ID != b.ID {
		t.Fatalf("replay differs (%v):\n%s\n%s", err, a.Raw, b.Raw)
	}
}

func TestToolUseRoundTrip(t *testing.T) {
	t.Parallel()
	_, _, c := fakeLLM(t, fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsStable})
	schema := json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"},"amount":{"type":"number"}},"required":["order_id"],"additionalProperties":false}`)
	req := summarise("")
	req.Tools = []llm.Tool{{Name: "issue_refund", Description: "Refund an order", Parameters: schema}}
	resp, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	want := fake.ToolArguments(schema, prompt)
	if resp.FinishReason != llm.FinishToolCalls || len(resp.ToolCalls) != 1 || !strings.HasPrefix(resp.ToolCalls[0].ID, "toolu_") ||
		resp.ToolCalls[0].Name != "issue_refund" || !jsonEqual(resp.ToolCalls[0].Arguments, want) {
		t.Fatalf("response %+v, want arguments %s", resp, want)
	}
	streamed, err := llm.Collect(c.Stream(context.Background(), req))
	if err != nil || len(streamed.ToolCalls) != 1 || streamed.ToolCalls[0].ID != resp.ToolCalls[0].ID || !jsonEqual(streamed.ToolCalls[0].Arguments, want) {
		t.Fatalf("streamed %+v (%v)", streamed.ToolCalls, err)
	}
	req.Tools = nil
	req.Messages = append(req.Messages,
		llm.Message{Role: llm.RoleAssistant, Content: "Refunding.", ToolCalls: resp.ToolCalls},
		llm.Message{Role: llm.RoleTool, ToolCallID: resp.ToolCalls[0].ID, Content: `{"refunded":true}`},
		llm.Message{Role: llm.RoleTool, ToolCallID: "other", Content: `{"ok":true}`})
	if _, err := c.Complete(context.Background(), req); err != nil {
		t.Fatalf("follow-up with tool results: %v", err)
	}
}

func jsonEqual(a, b string) bool {
	var x, y any
	if json.Unmarshal([]byte(a), &x) != nil || json.Unmarshal([]byte(b), &y) != nil {
		return false
	}
	xb, _ := json.Marshal(x)
	yb, _ := json.Marshal(y)
	return bytes.Equal(xb, yb)
}

func TestRateLimitAndOverloadAreRetried(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{RetryAfter: 2 * time.Second})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429}, fakeserver.Fault{Kind: fakeserver.Fault503})
	clock := retrytest.NewClock(t0)
	var retries []retry.Retry
	p := retry.Policy{Clock: clock, OnRetry: func(r retry.Retry) { retries = append(retries, r) }}
	resp, err := retry.Do(context.Background(), p, retry.AfterOn(clock, time.Minute), func(ctx context.Context) (*llm.Response, error) {
		return c.Complete(ctx, summarise("job-rl"))
	})
	if err != nil || resp.Content == "" {
		t.Fatalf("Do: %v", err)
	}
	if len(retries) != 2 || retries[0].Class != retry.ClassRateLimited || retries[1].Class != retry.ClassServerError {
		t.Fatalf("retries %+v", retries)
	}
	var overloaded *llm.APIError
	if !errors.As(retries[1].Err, &overloaded) || overloaded.StatusCode != 529 || overloaded.Type != "overloaded_error" || overloaded.RequestID == "" {
		t.Fatalf("529 mapped to %#v", retries[1].Err)
	}
	if sl := clock.Sleeps(); len(sl) != 2 || sl[0] != 2*time.Second || sl[1] != 2*time.Second {
		t.Fatalf("sleeps %v, want the retry-after of 2s twice", sl)
	}
	if st := stats(t, base); st.Requests != 3 || st.ByStatus["429"] != 1 || st.ByStatus["529"] != 1 || st.ByStatus["200"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPermanentErrorsReachTheServerOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		cfg    fakeserver.Config
		script []fakeserver.Fault
		class  retry.Class
		code   string
	}{
		{"spend limit 429", fakeserver.Config{}, []fakeserver.Fault{{Kind: fakeserver.FaultQuota}}, retry.ClassQuota, "enforced_spend_limit_reached"},
		{"prompt too long", fakeserver.Config{MaxInputChars: 20}, nil, retry.ClassClientError, ""},
		{"malformed", fakeserver.Config{}, []fakeserver.Fault{{Kind: fakeserver.FaultMalformed}}, retry.ClassPermanent, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, base, c := fakeLLM(t, tc.cfg)
			s.Script(tc.script...)
			_, err := retry.Do(context.Background(), retry.Policy{Clock: retrytest.NewClock(t0)}, retry.After(time.Minute),
				func(ctx context.Context) (*llm.Response, error) { return c.Complete(ctx, summarise("")) })
			v := retry.Classify(err)
			if v.Retryable || v.Class != tc.class {
				t.Fatalf("err %v: verdict %+v, want permanent %s", err, v, tc.class)
			}
			var apiErr *llm.APIError
			if tc.code != "" && (!errors.As(err, &apiErr) || apiErr.Code != tc.code) {
				t.Fatalf("err %#v, want code %s", err, tc.code)
			}
			if st := stats(t, base); st.Requests != 1 {
				t.Fatalf("stats %+v, want one request", st)
			}
		})
	}
}

func TestDroppedStreamIsRetryable(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop})
	resp, err := retry.Do(context.Background(), retry.Policy{Clock: retrytest.NewClock(t0)}, retry.After(time.Minute),
		func(ctx context.Context) (*llm.Response, error) { return llm.Collect(c.Stream(ctx, summarise(""))) })
	if err != nil || resp.Content != fake.Summary(prompt) {
		t.Fatalf("Do: %+v %v", resp, err)
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestDripIsCutByTheWallClockTimeout(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{DripInterval: 50 * time.Millisecond})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrip})
	start := time.Now()
	_, err := retry.Do(context.Background(), retry.Policy{PerCallTimeout: 400 * time.Millisecond, MaxAttempts: 1}, retry.After(time.Minute),
		func(ctx context.Context) (*llm.Response, error) { return c.Complete(ctx, summarise("")) })
	var at *retry.AttemptTimeoutError
	if !errors.As(err, &at) {
		t.Fatalf("err %v, want the per-call timeout", err)
	}
	// The answer is several hundred bytes: dripping it whole would take 10s or more.
	if took := time.Since(start); took > 5*time.Second || stats(t, base).DrippedBytes < 3 {
		t.Fatalf("took %v, dripped %d bytes", took, stats(t, base).DrippedBytes)
	}
}

func TestSDKRetriesAreOff(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{Fail503: 1})
	if _, err := c.Complete(context.Background(), summarise("")); err == nil {
		t.Fatal("a 529 succeeded")
	}
	for range c.Stream(context.Background(), summarise("")) {
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v: the SDK retried on its own", st)
	}
}

func TestHTMLErrorPage(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusBadGateway)
		_, _ = w.Write([]byte("<html>502 Bad Gateway</html>"))
	}))
	defer srv.Close()
	_, err := anthropic.New(anthropic.Config{BaseURL: srv.URL}).Complete(context.Background(), summarise(""))
	var apiErr *llm.APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 502 || !retry.Retryable(err) {
		t.Fatalf("err %T %v", err, err)
	}
}

func FuzzDecodeMessage(f *testing.F) {
	f.Add([]byte(`{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":1,"output_tokens":1}}`))
	f.Add([]byte(`{"id":"msg_1","type":"message","content":[{"type":"tool_use","id":"t","name":"n","input":{"a":1}}],"stop_reason":"tool_use"}`))
	f.Add([]byte(`{"type":"message","content":null}`))
	f.Add([]byte(`{"type":"error","error":{"type":"overloaded_error"}}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		resp, err := anthropic.DecodeMessage(raw)
		if err != nil {
			return
		}
		for _, tc := range resp.ToolCalls {
			if tc.Name == "" || !json.Valid([]byte(tc.Arguments)) {
				t.Fatalf("bad tool call accepted: %+v", tc)
			}
		}
	})
}

func TestOverloadedEventMidStreamIsRetried(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultStreamError})
	var retries []retry.Retry
	p := retry.Policy{Clock: retrytest.NewClock(t0), OnRetry: func(r retry.Retry) { retries = append(retries, r) }}
	resp, err := retry.Do(context.Background(), p, retry.After(time.Minute), func(ctx context.Context) (*llm.Response, error) {
		return llm.Collect(c.Stream(ctx, summarise("")))
	})
	if err != nil || resp.Content != fake.Summary(prompt) {
		t.Fatalf("Do: %+v %v", resp, err)
	}
	var apiErr *llm.APIError
	if len(retries) != 1 || !errors.As(retries[0].Err, &apiErr) || apiErr.Type != "overloaded_error" || retries[0].Class != retry.ClassServerError {
		t.Fatalf("retries %+v (err %#v)", retries, retries)
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v", st)
	}
}
