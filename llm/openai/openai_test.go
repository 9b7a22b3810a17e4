package openai_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/retry"
)

// fakeLLM starts fake-llm in-process and returns it, its /v1 base URL and an adapter
// pointed at it.
func fakeLLM(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, string, *openai.Client) {
	t.Helper()
	s, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return fakeLLMFromServer(t, s)
}

func fakeLLMFromServer(t testing.TB, s *fakeserver.Server) (*fakeserver.Server, string, *openai.Client) {
	t.Helper()
	ts := httptest.NewServer(s)
	t.Cleanup(func() { s.Close(); ts.Close() })
	base := ts.URL + "/v1"
	return s, base, openai.New(openai.Config{BaseURL: base, APIKey: "sk-test-not-a-real-key"})
}

// stats reads /stats over HTTP, as an operator would.
func stats(t *testing.T, base string) fakeserver.Stats {
	t.Helper()
	st, err := fakeserver.FetchStats(context.Background(), nil, base)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

const text = "The March invoice was charged twice and the customer wants a refund by Friday."

func summarise(key string) *llm.Request {
	return &llm.Request{
		Messages: []llm.Message{
			{Role: llm.RoleSystem, Content: "You write short summaries for the account team."},
			{Role: llm.RoleUser, Content: "Summarise for the account team:\n\n" + text},
		},
		Temperature:    llm.Float(0),
		MaxTokens:      200,
		IdempotencyKey: key,
	}
}

func TestComplete(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{})
	req := summarise("job-123")
	resp, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Content != fake.Summary(req.Messages[1].Content) || !strings.HasPrefix(resp.ID, "chatcmpl-") || resp.Model != "gpt-4.1-mini" ||
		resp.FinishReason != llm.FinishStop || resp.Usage.InputTokens == 0 || resp.Usage.OutputTokens == 0 || !strings.HasPrefix(resp.RequestID, "req_") {
		t.Fatalf("response %+v", resp)
	}
	var raw struct{ ID string }
	if err := json.Unmarshal(resp.Raw, &raw); err != nil || raw.ID != resp.ID {
		t.Fatalf("Raw %s", resp.Raw)
	}
	if st := stats(t, base); st.Requests != 1 || st.ByIdempotencyKey["job-123"] != 1 {
		t.Fatalf("stats %+v: the Idempotency-Key header was not sent", st)
	}
}

func TestRawIsByteIdenticalToTheServerAnswer(t *testing.T) {
	t.Parallel()
	// With keys honoured, the second answer is the server's recorded bytes: Raw must be
	// exactly those bytes for the ledger to replay them.
	_, _, c := fakeLLM(t, fakeserver.Config{HonourIdempotency: true})
	req := summarise("job-raw")
	req.Temperature = llm.Float(1)
	a, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Raw, b.Raw) || a.ID != b.ID || a.Content != b.Content {
		t.Fatalf("replayed answer differs:\n%s\n%s", a.Raw, b.Raw)
	}
	req.IdempotencyKey = "job-other"
	if c2, _ := c.Complete(context.Background(), req); c2.ID == a.ID || c2.Content == a.Content {
		t.Fatal("another key got the same answer")
	}
}

func TestStream(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{})
	req := summarise("job-stream")
	var chunks int
	var final llm.Chunk
	var content strings.Builder
	for ch, err := range c.Stream(context.Background(), req) {
		if err != nil {
			t.Fatal(err)
		}
		chunks++
		content.WriteString(ch.Content)
		if ch.Done {
			final = ch
		} else if !json.Valid(ch.Raw) {
			t.Fatalf("chunk Raw %q", ch.Raw)
		}
	}
	if content.String() != fake.Summary(req.Messages[1].Content) || chunks < 4 || final.FinishReason != llm.FinishStop ||
		final.Usage == nil || final.Usage.OutputTokens == 0 || !strings.HasPrefix(final.ID, "chatcmpl-") || final.RequestID == "" {
		t.Fatalf("%d chunks, content %q, final %+v", chunks, content.String(), final)
	}
	if st := stats(t, base); st.ByIdempotencyKey["job-stream"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

var refundTool = llm.Tool{Name: "issue_refund", Description: "Refund an order",
	Parameters: json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"},"amount":{"type":"number"}},"required":["order_id"]}`)}

func TestToolCallsCompleteAndStream(t *testing.T) {
	t.Parallel()
	_, _, c := fakeLLM(t, fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsStable})
	req := summarise("")
	req.Tools = []llm.Tool{refundTool, {Name: "noop"}}
	resp, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.FinishReason != llm.FinishToolCalls || len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Name != "issue_refund" ||
		!strings.HasPrefix(resp.ToolCalls[0].ID, "call_") || resp.ToolCalls[0].Arguments != fake.ToolArguments(refundTool.Parameters, req.Messages[1].Content) {
		t.Fatalf("response %+v", resp)
	}
	streamed, err := llm.Collect(c.Stream(context.Background(), req))
	if err != nil {
		t.Fatal(err)
	}
	if len(streamed.ToolCalls) != 1 || streamed.ToolCalls[0] != resp.ToolCalls[0] || streamed.FinishReason != llm.FinishToolCalls {
		t.Fatalf("streamed tool calls %+v, complete %+v (stable ids: the same)", streamed.ToolCalls, resp.ToolCalls)
	}

	// The conversation continues with the call and its result: the SDK must encode
	// assistant tool calls and tool messages the server accepts.
	req.Messages = append(req.Messages,
		llm.Message{Role: llm.RoleAssistant, ToolCalls: resp.ToolCalls},
		llm.Message{Role: llm.RoleTool, ToolCallID: resp.ToolCalls[0].ID, Content: `{"refunded":true}`})
	req.Tools = nil
	if _, err := c.Complete(context.Background(), req); err != nil {
		t.Fatalf("follow-up with tool result: %v", err)
	}
}

func TestBadRequestsArePermanentBeforeSending(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{})
	for _, req := range []*llm.Request{
		{Messages: []llm.Message{{Role: "wizard", Content: "x"}}},
		{Messages: []llm.Message{{Role: llm.RoleUser, Content: "x"}}, Tools: []llm.Tool{{Name: "t", Parameters: json.RawMessage(`[1]`)}}},
	} {
		if _, err := c.Complete(context.Background(), req); err == nil || !retry.IsPermanent(err) {
			t.Errorf("%+v: err %v, want permanent", req, err)
		}
	}
	if st := stats(t, base); st.Requests != 0 {
		t.Fatalf("invalid requests reached the server: %+v", st)
	}
}

func TestNonJSONErrorBodyStillAnAPIError(t *testing.T) {
	t.Parallel()
	calls := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.Header().Set("Content-Type", "text/html")
		w.Header().Set("Retry-After", "4")
		w.WriteHeader(http.StatusBadGateway)
		_, _ = w.Write([]byte("<html><body><h1>502 Bad Gateway</h1></body></html>"))
	}))
	defer srv.Close()
	c := openai.New(openai.Config{BaseURL: srv.URL + "/v1"})
	_, err := c.Complete(context.Background(), summarise(""))
	var apiErr *llm.APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 502 || !strings.Contains(string(apiErr.Body), "Bad Gateway") {
		t.Fatalf("err %T %v, want an APIError 502 with the HTML body", err, err)
	}
	if v := retry.Classify(err); !v.Retryable || v.Class != retry.ClassServerError || v.RetryAfter.Seconds() != 4 {
		t.Fatalf("verdict %+v", v)
	}
	if calls != 1 {
		t.Fatalf("%d requests: the SDK retried on its own", calls)
	}
}

// FuzzDecodeCompletion feeds arbitrary bodies to the response parser: it returns a
// response with at least one choice's worth of data or an error, never panics.
func FuzzDecodeCompletion(f *testing.F) {
	f.Add([]byte(`{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`))
	f.Add([]byte(`{"id":"x","choices":[{"message":{"content":null,"tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}`))
	f.Add([]byte(`{"choices":[]}`))
	f.Add([]byte(`{"choices":"nope"}`))
	f.Add([]byte(`<html>`))
	f.Add([]byte(`{"id":"broken","choices":[{"message":{"role":"assis`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		resp, err := openai.DecodeCompletion(raw)
		if err != nil {
			if resp != nil {
				t.Fatal("error with a response")
			}
			return
		}
		if !bytes.Equal(resp.Raw, raw) {
			t.Fatal("Raw is not the input")
		}
		for _, tc := range resp.ToolCalls {
			if tc.Name == "" {
				t.Fatal("tool call without a name accepted")
			}
		}
	})
}
