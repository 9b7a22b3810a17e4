// Package llmtest is the conformance suite every llm.Client adapter passes: what
// onceflow's retry layer, ledger and job handlers rely on an adapter for, checked
// through the adapter's real SDK against fake-llm (llm/fakeserver) speaking its wire
// format, and over HTTP/2 against servers that fail as provider edges do
// (internal/testenv/h2fault).
//
// An adapter's test file runs it with its constructor and the few things its wire
// format decides (ids, error codes, the overload status):
//
//	func TestConformance(t *testing.T) {
//		llmtest.Run(t, llmtest.Adapter{
//			New: func(base string, hc *http.Client) llm.Client {
//				return openai.New(openai.Config{BaseURL: base + "/v1", APIKey: "sk-test", HTTPClient: hc})
//			},
//			Endpoint: "chat_completions", Model: "gpt-4.1-mini", ...
//		})
//	}
//
// The suite imports only the standard library and this module's own packages.
package llmtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv/h2fault"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// Adapter is the adapter under test and what its wire format decides.
type Adapter struct {
	// New returns the adapter for the server at base (scheme://host:port, no path: the
	// adapter adds its own, such as OpenAI's /v1) using hc, or the adapter's own HTTP
	// client when hc is nil. It must not retry on its own (the SDK's retries off).
	New func(base string, hc *http.Client) llm.Client
	// Endpoint is fake-llm's name of the endpoint the adapter calls, as counted in
	// fakeserver.Stats.ByEndpoint: "chat_completions", "messages".
	Endpoint string
	// Model is the model the adapter asks for when the request names none, and so the
	// one its answers name.
	Model string
	// ResponseIDPrefix begins every response id: "chatcmpl-", "msg_".
	ResponseIDPrefix string
	// ToolCallIDPrefix begins every tool call id: "call_", "toolu_".
	ToolCallIDPrefix string
	// ToolArgumentsVerbatim says a tool call's arguments are the server's bytes (OpenAI
	// sends them as a JSON string), not a re-encoding of its JSON (Anthropic's input).
	ToolArgumentsVerbatim bool
	// RateLimitCode is the APIError.Code of a rate-limit 429 ("" when the wire format
	// has none).
	RateLimitCode string
	// QuotaCode is the APIError.Code of a 429 that is the account's quota or spend limit.
	QuotaCode string
	// ContextTooLongCode is the APIError.Code of a 400 for a prompt over the model's
	// context ("" when the wire format has none).
	ContextTooLongCode string
	// OverloadedStatus is the status of an overloaded provider's answer: 503, or
	// Anthropic's 529.
	OverloadedStatus int
	// OverloadedType is the APIError.Type of that answer: "server_error",
	// "overloaded_error".
	OverloadedType string
	// OverloadedRetryAfter says the overloaded answer carries Retry-After (Anthropic's
	// 529 does).
	OverloadedRetryAfter bool
	// NoTemperature says the adapter does not send Request.Temperature (Anthropic's v2
	// SDK has no such parameter): fake-llm then answers every key alike.
	NoTemperature bool
	// StreamErrorType is the APIError.Type of an error event in a started stream:
	// "server_error", "overloaded_error".
	StreamErrorType string
}

// Run runs the suite against a, each behaviour a parallel subtest with its own fake-llm.
func Run(t *testing.T, a Adapter) {
	for _, c := range []struct {
		name string
		run  func(*testing.T, Adapter)
	}{
		{"Complete returns the answer and sends the key", complete},
		{"Stream returns the answer in chunks and sends the key", stream},
		{"Raw is the server's bytes on a replay", rawReplay},
		{"tool calls complete and stream, and the conversation goes on", toolCalls},
		{"a scripted agent's calls and its text after the results", scripted},
		{"bad requests are permanent before sending", badRequests},
		{"an HTML error page is an APIError", htmlErrorPage},
		{"the SDK's own retries are off", sdkRetriesOff},
		{"a 429 and an overload are retried", rateLimitAndOverload},
		{"Retry-After is honoured", retryAfterHonoured},
		{"permanent errors reach the server once", permanentErrors},
		{"an error of our own is not retried", unknownErrorNotRetried},
		{"a 503 storm uses exactly MaxAttempts", overloadStorm},
		{"x-should-retry false stops a retry", shouldRetryHeaderWins},
		{"an always hanging model gives up within the deadline", alwaysHanging},
		{"a drip is cut by the per-call timeout", dripIsCut},
		{"a dropped stream is retried", droppedStream},
		{"an error event mid-stream is retried", errorEventMidStream},
		{"an HTTP/2 stream reset is retried", http2StreamReset},
		{"an HTTP/2 GOAWAY or lost connection is retried", http2GoAway},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, a)
		})
	}
}

// t0 is the manual clocks' start.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

const text = "The March invoice was charged twice and the customer wants a refund by Friday."

// userPrompt is the user message of every request; fake-llm's answer derives from it.
const userPrompt = "Summarise for the account team:\n\n" + text

// summarise is the suite's request, with key as its Idempotency-Key ("" for none).
func summarise(key string) *llm.Request {
	return &llm.Request{
		Messages: []llm.Message{
			{Role: llm.RoleSystem, Content: "You write short summaries for the account team."},
			{Role: llm.RoleUser, Content: userPrompt},
		},
		Temperature:    llm.Float(0),
		MaxTokens:      300,
		IdempotencyKey: key,
	}
}

// server starts fake-llm with cfg, and returns it, its root URL and the adapter
// pointed at it.
func server(t *testing.T, a Adapter, cfg fakeserver.Config) (*fakeserver.Server, string, llm.Client) {
	t.Helper()
	s, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(func() { s.Close(); ts.Close() })
	return s, ts.URL, a.New(ts.URL, nil)
}

// stats reads fake-llm's /stats over HTTP, as an operator would.
func stats(t *testing.T, base string) fakeserver.Stats {
	t.Helper()
	st, err := fakeserver.FetchStats(context.Background(), nil, base)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// retried runs call through retry.Do with p (its Clock a manual one at t0 unless set)
// and returns what OnRetry saw.
func retried(p retry.Policy, budget time.Duration, call func(ctx context.Context) (*llm.Response, error)) (*llm.Response, []retry.Retry, error) {
	var retries []retry.Retry
	if p.Clock == nil {
		p.Clock = retrytest.NewClock(t0)
	}
	p.OnRetry = func(r retry.Retry) { retries = append(retries, r) }
	resp, err := retry.Do(context.Background(), p, retry.AfterOn(p.Clock, budget), call)
	return resp, retries, err
}

// completeCall and streamCall are one call of req through c.
func completeCall(c llm.Client, req *llm.Request) func(context.Context) (*llm.Response, error) {
	return func(ctx context.Context) (*llm.Response, error) { return c.Complete(ctx, req) }
}

func streamCall(c llm.Client, req *llm.Request) func(context.Context) (*llm.Response, error) {
	return func(ctx context.Context) (*llm.Response, error) { return llm.Collect(c.Stream(ctx, req)) }
}

func complete(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{})
	resp, err := c.Complete(context.Background(), summarise("job-123"))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Content != fake.Summary(userPrompt) || !strings.HasPrefix(resp.ID, a.ResponseIDPrefix) || resp.Model != a.Model ||
		resp.FinishReason != llm.FinishStop || resp.Usage.InputTokens == 0 || resp.Usage.OutputTokens == 0 || !strings.HasPrefix(resp.RequestID, "req_") {
		t.Fatalf("response %+v", resp)
	}
	var raw struct{ ID string }
	if err := json.Unmarshal(resp.Raw, &raw); err != nil || raw.ID != resp.ID {
		t.Fatalf("Raw %s is not the answer's body", resp.Raw)
	}
	if st := stats(t, base); st.Requests != 1 || st.ByEndpoint[a.Endpoint] != 1 || st.ByIdempotencyKey["job-123"] != 1 {
		t.Fatalf("stats %+v: want one request to %s with the Idempotency-Key header", st, a.Endpoint)
	}
}

func stream(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{})
	var chunks int
	var final llm.Chunk
	var content strings.Builder
	for ch, err := range c.Stream(context.Background(), summarise("job-stream")) {
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
	if content.String() != fake.Summary(userPrompt) || chunks < 4 || final.FinishReason != llm.FinishStop || final.Usage == nil ||
		final.Usage.InputTokens == 0 || final.Usage.OutputTokens == 0 || !strings.HasPrefix(final.ID, a.ResponseIDPrefix) || final.RequestID == "" {
		t.Fatalf("%d chunks, content %q, final %+v", chunks, content.String(), final)
	}
	if st := stats(t, base); st.ByEndpoint[a.Endpoint] != 1 || st.ByIdempotencyKey["job-stream"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// With keys honoured, the second answer is the server's recorded bytes: Raw must be
// exactly those bytes for the ledger to replay them; another key gets another answer
// (at temperature 1, when the adapter sends it).
func rawReplay(t *testing.T, a Adapter) {
	_, _, c := server(t, a, fakeserver.Config{HonourIdempotency: true})
	req := summarise("job-raw")
	req.Temperature = llm.Float(1)
	first, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(first.Raw, again.Raw) || first.ID != again.ID || first.Content != again.Content {
		t.Fatalf("replayed answer differs:\n%s\n%s", first.Raw, again.Raw)
	}
	req.IdempotencyKey = "job-other"
	other, err := c.Complete(context.Background(), req)
	if err != nil || other.ID == first.ID || (!a.NoTemperature && other.Content == first.Content) {
		t.Fatalf("another key got the same answer (%v)", err)
	}
}

var refundTool = llm.Tool{Name: "issue_refund", Description: "Refund an order",
	Parameters: json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"},"amount":{"type":"number"}},"required":["order_id"],"additionalProperties":false}`)}

// jsonEqual reports whether a and b are the same JSON value, however spelled.
func jsonEqual(a, b string) bool {
	var x, y any
	if json.Unmarshal([]byte(a), &x) != nil || json.Unmarshal([]byte(b), &y) != nil {
		return false
	}
	xb, _ := json.Marshal(x)
	yb, _ := json.Marshal(y)
	return bytes.Equal(xb, yb)
}

// A tool call completes and streams alike (stable ids: the same call), and the
// conversation continues with the call and its results: the SDK encodes assistant tool
// calls and tool messages the server accepts.
func toolCalls(t *testing.T, a Adapter) {
	_, _, c := server(t, a, fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsStable})
	req := summarise("")
	req.Tools = []llm.Tool{refundTool, {Name: "noop", Parameters: json.RawMessage(`{"type":"object","properties":{}}`)}}
	resp, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	want := fake.ToolArguments(refundTool.Parameters, userPrompt)
	sameArguments := func(got string) bool { return got == want || (!a.ToolArgumentsVerbatim && jsonEqual(got, want)) }
	if resp.FinishReason != llm.FinishToolCalls || len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Name != "issue_refund" ||
		!strings.HasPrefix(resp.ToolCalls[0].ID, a.ToolCallIDPrefix) || !sameArguments(resp.ToolCalls[0].Arguments) {
		t.Fatalf("response %+v, want a call of issue_refund with %s", resp, want)
	}
	streamed, err := llm.Collect(c.Stream(context.Background(), req))
	if err != nil {
		t.Fatal(err)
	}
	if len(streamed.ToolCalls) != 1 || streamed.ToolCalls[0].ID != resp.ToolCalls[0].ID || streamed.ToolCalls[0].Name != resp.ToolCalls[0].Name ||
		!sameArguments(streamed.ToolCalls[0].Arguments) || streamed.FinishReason != llm.FinishToolCalls {
		t.Fatalf("streamed tool calls %+v, complete %+v (stable ids: the same)", streamed.ToolCalls, resp.ToolCalls)
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

// agentScript is fake-llm's script of an agent: two tool calls at once, then (the
// conversation holding their two results, past the end of the script: its last turn)
// the final text.
const agentScript = `[
  {"tool_calls": [
    {"name": "lookup_order", "arguments": {"order_id": "A-17"}},
    {"name": "issue_refund", "arguments": {"order_id": "A-17", "amount": 12.99}}
  ]},
  {"text": "Refunded order A-17: 12.99 EUR."}
]`

// The adapter reads a scripted model's answers (fake-llm --script), plain and
// streamed: several tool calls in one answer, each with its id, name and arguments and
// finish reason tool_calls, and, once the conversation carries the calls and their
// results, the text with finish reason stop.
func scripted(t *testing.T, a Adapter) {
	script, err := fakeserver.ParseScript([]byte(agentScript))
	if err != nil {
		t.Fatal(err)
	}
	_, _, c := server(t, a, fakeserver.Config{Script: script})
	lookup := llm.Tool{Name: "lookup_order", Parameters: json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"}}}`)}
	want := []llm.ToolCall{{Name: "lookup_order", Arguments: `{"order_id":"A-17"}`}, {Name: "issue_refund", Arguments: `{"order_id":"A-17","amount":12.99}`}}
	for _, stream := range []bool{false, true} {
		req := summarise("")
		req.Tools = []llm.Tool{lookup, refundTool}
		call := completeCall(c, req)
		if stream {
			call = streamCall(c, req)
		}
		resp, err := call(context.Background())
		if err != nil {
			t.Fatalf("stream=%v: %v", stream, err)
		}
		if resp.FinishReason != llm.FinishToolCalls || len(resp.ToolCalls) != len(want) || resp.Content != "" {
			t.Fatalf("stream=%v: %+v, want the script's %d calls", stream, resp, len(want))
		}
		for i, tc := range resp.ToolCalls {
			sameArguments := tc.Arguments == want[i].Arguments || (!a.ToolArgumentsVerbatim && jsonEqual(tc.Arguments, want[i].Arguments))
			if tc.Name != want[i].Name || !sameArguments || !strings.HasPrefix(tc.ID, a.ToolCallIDPrefix) || (i > 0 && tc.ID == resp.ToolCalls[0].ID) {
				t.Fatalf("stream=%v: call %d is %+v, want %s(%s) with an id of its own", stream, i, tc, want[i].Name, want[i].Arguments)
			}
		}
		req.Messages = append(req.Messages, llm.Message{Role: llm.RoleAssistant, ToolCalls: resp.ToolCalls})
		for _, tc := range resp.ToolCalls {
			req.Messages = append(req.Messages, llm.Message{Role: llm.RoleTool, ToolCallID: tc.ID, Content: `{"ok":true}`})
		}
		call = completeCall(c, req)
		if stream {
			call = streamCall(c, req)
		}
		if resp, err = call(context.Background()); err != nil {
			t.Fatalf("stream=%v, with the results: %v", stream, err)
		}
		if resp.FinishReason != llm.FinishStop || len(resp.ToolCalls) != 0 || resp.Content != "Refunded order A-17: 12.99 EUR." {
			t.Fatalf("stream=%v, with the results: %+v, want the scripted text", stream, resp)
		}
	}
}

// A request the adapter cannot encode (an unknown role, a tool whose parameters are not
// an object) is permanent and never reaches the server.
func badRequests(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{})
	for _, req := range []*llm.Request{
		{Messages: []llm.Message{{Role: "wizard", Content: "x"}}, MaxTokens: 100},
		{Messages: []llm.Message{{Role: llm.RoleUser, Content: "x"}}, MaxTokens: 100, Tools: []llm.Tool{{Name: "t", Parameters: json.RawMessage(`[1]`)}}},
	} {
		if _, err := c.Complete(context.Background(), req); err == nil || !retry.IsPermanent(err) {
			t.Errorf("%+v: err %v, want permanent", req, err)
		}
	}
	if st := stats(t, base); st.Requests != 0 {
		t.Fatalf("invalid requests reached the server: %+v", st)
	}
}

// A proxy's HTML error page (502, Retry-After) is an APIError with its status and body,
// retryable after the server's Retry-After, from one request.
func htmlErrorPage(t *testing.T, a Adapter) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Content-Type", "text/html")
		w.Header().Set("Retry-After", "4")
		w.WriteHeader(http.StatusBadGateway)
		_, _ = w.Write([]byte("<html><body><h1>502 Bad Gateway</h1></body></html>"))
	}))
	t.Cleanup(srv.Close)
	_, err := a.New(srv.URL, nil).Complete(context.Background(), summarise(""))
	var apiErr *llm.APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusBadGateway || !strings.Contains(string(apiErr.Body), "Bad Gateway") {
		t.Fatalf("err %T %v, want an APIError 502 with the HTML body", err, err)
	}
	if v := retry.Classify(err); !v.Retryable || v.Class != retry.ClassServerError || v.RetryAfter != 4*time.Second {
		t.Fatalf("verdict %+v", v)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d requests: the SDK retried on its own", n)
	}
}

// Without package retry, one call is one request, whatever the answer.
func sdkRetriesOff(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{Fail503: 1})
	if _, err := c.Complete(context.Background(), summarise("")); err == nil {
		t.Fatalf("a %d succeeded", a.OverloadedStatus)
	}
	for range c.Stream(context.Background(), summarise("")) {
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v: the SDK retried on its own", st)
	}
}

// A 429 then an overload: each is retried (rate_limited, then server_error) after the
// server's Retry-After where it sends one, with the same key, and mapped to an APIError
// carrying the status and the request id.
func rateLimitAndOverload(t *testing.T, a Adapter) {
	s, base, c := server(t, a, fakeserver.Config{RetryAfter: 2 * time.Second})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429}, fakeserver.Fault{Kind: fakeserver.Fault503})
	clock := retrytest.NewClock(t0)
	resp, retries, err := retried(retry.Policy{Clock: clock}, time.Minute, completeCall(c, summarise("job-1")))
	if err != nil || resp.Content == "" {
		t.Fatalf("Do: %v", err)
	}
	if len(retries) != 2 || retries[0].Class != retry.ClassRateLimited || retries[1].Class != retry.ClassServerError {
		t.Fatalf("retries %+v, want rate_limited then server_error", retries)
	}
	var limited, overloaded *llm.APIError
	if !errors.As(retries[0].Err, &limited) || limited.StatusCode != http.StatusTooManyRequests || limited.Code != a.RateLimitCode || limited.RequestID == "" {
		t.Fatalf("the 429 mapped to %#v", retries[0].Err)
	}
	if !errors.As(retries[1].Err, &overloaded) || overloaded.StatusCode != a.OverloadedStatus || overloaded.Type != a.OverloadedType || overloaded.RequestID == "" {
		t.Fatalf("the %d mapped to %#v", a.OverloadedStatus, retries[1].Err)
	}
	sleeps := clock.Sleeps()
	if len(sleeps) != 2 || sleeps[0] != 2*time.Second || (a.OverloadedRetryAfter && sleeps[1] != 2*time.Second) {
		t.Fatalf("sleeps %v, want the retry-after of 2s (twice when the overload sends one)", sleeps)
	}
	if st := stats(t, base); st.Requests != 3 || st.ByStatus["429"] != 1 || st.ByStatus[strconv.Itoa(a.OverloadedStatus)] != 1 || st.ByStatus["200"] != 1 || st.ByIdempotencyKey["job-1"] != 3 {
		t.Fatalf("stats %+v, want 429, %d and 200, all with the same key", st, a.OverloadedStatus)
	}
}

func retryAfterHonoured(t *testing.T, a Adapter) {
	for _, tc := range []struct {
		name   string
		header http.Header
		cap    time.Duration
		check  func(d time.Duration) bool
		want   string
	}{
		{"delta-seconds", http.Header{"Retry-After": {"3"}}, 0, func(d time.Duration) bool { return d == 3*time.Second }, "3s"},
		{"retry-after-ms wins", http.Header{"Retry-After": {"3"}, "Retry-After-Ms": {"1500"}}, 0, func(d time.Duration) bool { return d == 1500*time.Millisecond }, "1.5s"},
		// The date is written when the subtest runs (below), not here: a parallel subtest
		// can start seconds later on a loaded machine.
		{"HTTP-date", http.Header{"Retry-After": {"in 6s"}}, 0,
			func(d time.Duration) bool { return d > 4*time.Second && d <= 6*time.Second }, "about 5s (second resolution)"},
		{"capped", http.Header{"Retry-After": {"120"}}, 10 * time.Second, func(d time.Duration) bool { return d == 10*time.Second }, "the 10s cap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, base, c := server(t, a, fakeserver.Config{})
			header := tc.header
			if header.Get("Retry-After") == "in 6s" {
				header = http.Header{"Retry-After": {time.Now().Add(6 * time.Second).UTC().Format(http.TimeFormat)}}
			}
			s.Script(fakeserver.Fault{Kind: fakeserver.Fault429, Header: header})
			clock := retrytest.NewClock(t0)
			_, retries, err := retried(retry.Policy{RetryAfterCap: tc.cap, Clock: clock}, 10*time.Minute, completeCall(c, summarise("")))
			if err != nil {
				t.Fatal(err)
			}
			sleeps := clock.Sleeps()
			if len(sleeps) != 1 || !tc.check(sleeps[0]) || !retries[0].FromRetryAfter || retries[0].Delay != sleeps[0] {
				t.Fatalf("slept %v (retries %+v), want %s from Retry-After", sleeps, retries, tc.want)
			}
			if st := stats(t, base); st.Requests != 2 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// A quota 429, a prompt over the context and a malformed answer are not retried: one
// request, no retry, no sleep. The last two are permanent for the queue too (dead
// letters); a quota is the account's state, which the breaker handles.
func permanentErrors(t *testing.T, a Adapter) {
	for _, tc := range []struct {
		name   string
		cfg    fakeserver.Config
		script []fakeserver.Fault
		class  retry.Class
		status int
		code   string
		final  bool // not transient: the queue dead-letters it
	}{
		{"quota 429", fakeserver.Config{}, []fakeserver.Fault{{Kind: fakeserver.FaultQuota}}, retry.ClassQuota, http.StatusTooManyRequests, a.QuotaCode, false},
		{"prompt too long", fakeserver.Config{MaxInputChars: 40}, nil, retry.ClassClientError, http.StatusBadRequest, a.ContextTooLongCode, true},
		{"malformed answer", fakeserver.Config{}, []fakeserver.Fault{{Kind: fakeserver.FaultMalformed}}, retry.ClassPermanent, 0, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, base, c := server(t, a, tc.cfg)
			s.Script(tc.script...)
			clock := retrytest.NewClock(t0)
			_, retries, err := retried(retry.Policy{Clock: clock}, time.Minute, completeCall(c, summarise("")))
			if v := retry.Classify(err); v.Retryable || v.Class != tc.class || (tc.final && retry.Transient(err)) {
				t.Fatalf("err %v: verdict %+v (transient %t), want %s, not retried", err, v, retry.Transient(err), tc.class)
			}
			var apiErr *llm.APIError
			if tc.status != 0 && (!errors.As(err, &apiErr) || apiErr.StatusCode != tc.status || apiErr.Code != tc.code) {
				t.Fatalf("err %#v, want an APIError %d with code %q", err, tc.status, tc.code)
			}
			if tc.status == 0 && !errors.Is(err, llm.ErrMalformedResponse) {
				t.Fatalf("err %v, want ErrMalformedResponse", err)
			}
			if st := stats(t, base); st.Requests != 1 || len(retries) != 0 || len(clock.Sleeps()) != 0 {
				t.Fatalf("stats %+v, %d retries: want exactly one request", st, len(retries))
			}
		})
	}
}

// An error the classifier has never seen, raised by the caller's own code after a good
// answer, is not retried.
func unknownErrorNotRetried(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{})
	calls := 0
	_, _, err := retried(retry.Policy{}, time.Minute, func(ctx context.Context) (*llm.Response, error) {
		calls++
		resp, err := c.Complete(ctx, summarise(""))
		if err != nil {
			return nil, err
		}
		if len(resp.Content) > 0 {
			return nil, errors.New("our own parser choked on the summary")
		}
		return resp, nil
	})
	if calls != 1 || retry.Classify(err).Class != retry.ClassUnknown {
		t.Fatalf("%d calls, err %v: an unknown error must not be retried", calls, err)
	}
	if st := stats(t, base); st.Requests != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// An overloaded provider that never recovers: exactly MaxAttempts requests, full-jitter
// backoff between them, and a transient ExhaustedError (the queue redelivers).
func overloadStorm(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{Fail503: 1})
	clock := retrytest.NewClock(t0)
	_, retries, err := retried(retry.Policy{MaxAttempts: 4, Clock: clock}, 10*time.Minute, completeCall(c, summarise("")))
	var ex *retry.ExhaustedError
	if !errors.As(err, &ex) || ex.Attempts != 4 || !retry.Transient(err) {
		t.Fatalf("err %v, want ExhaustedError after 4 attempts (transient, so the queue redelivers)", err)
	}
	if st := stats(t, base); st.Requests != 4 || st.ByStatus[strconv.Itoa(a.OverloadedStatus)] != 4 {
		t.Fatalf("stats %+v, want exactly 4 requests", st)
	}
	if len(retries) != 3 || len(clock.Sleeps()) != 3 {
		t.Fatalf("%d retries, sleeps %v", len(retries), clock.Sleeps())
	}
	if a.OverloadedRetryAfter {
		return // the server's Retry-After, not the backoff, sets the sleeps
	}
	for i, d := range clock.Sleeps() {
		if upper := 500 * time.Millisecond << i; d < 0 || d > upper {
			t.Fatalf("sleep %d = %v outside full jitter [0, %v]", i, d, upper)
		}
	}
}

// x-should-retry: false stops the retry of an answer that would be retried.
func shouldRetryHeaderWins(t *testing.T, a Adapter) {
	s, base, c := server(t, a, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault503, Header: http.Header{"X-Should-Retry": {"false"}}})
	_, _, err := retried(retry.Policy{}, time.Minute, completeCall(c, summarise("")))
	if err == nil || retry.Retryable(err) {
		t.Fatalf("err %v: x-should-retry: false must stop a %d", err, a.OverloadedStatus)
	}
	if st := stats(t, base); st.Requests != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// A model that always hangs, per-call timeout 0.2s and deadline 0.5s (the minimum
// useful attempt lowered to 0.1s) gives up within the deadline plus one per-call
// timeout after at most three calls. The per-call timeout is a real context deadline;
// the clock skips the backoff sleeps but counts them, so the elapsed time it reports
// is real work plus simulated waiting, compared as a ratio.
func alwaysHanging(t *testing.T, a Adapter) {
	_, base, c := server(t, a, fakeserver.Config{Hang: 1})
	const perCall, budget = 200 * time.Millisecond, 500 * time.Millisecond
	clock := retrytest.NewSkipClock()
	p := retry.Policy{PerCallTimeout: perCall, MinAttempt: 100 * time.Millisecond, Base: 50 * time.Millisecond, Clock: clock}
	_, _, err := retried(p, budget, completeCall(c, summarise("")))
	elapsed := clock.Elapsed()
	if !errors.Is(err, retry.ErrDeadlineExceeded) {
		t.Fatalf("err %v, want the delivery deadline", err)
	}
	var at *retry.AttemptTimeoutError
	if !errors.As(err, &at) {
		t.Fatalf("err %v does not carry the last attempt's timeout", err)
	}
	st := stats(t, base)
	if st.Requests < 1 || st.Requests > 3 || st.ByFault["hang"] != st.Requests {
		t.Fatalf("stats %+v, want 1 to 3 hung calls", st)
	}
	if ratio := float64(elapsed) / float64(budget+perCall); ratio > 1 {
		t.Fatalf("gave up after %v: %.2f of deadline+per-call (%v), want at most 1", elapsed, ratio, budget+perCall)
	}
}

// A server that sends one byte every 50ms keeps the connection busy (a per-read
// timeout would never fire), yet the per-call context deadline cuts the call, for a
// plain answer (the SDK reads the body under the context) and for a stream.
func dripIsCut(t *testing.T, a Adapter) {
	const interval, perCall = 50 * time.Millisecond, 500 * time.Millisecond
	for _, streamed := range []bool{false, true} {
		name := map[bool]string{false: "Complete", true: "Stream"}[streamed]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s, base, c := server(t, a, fakeserver.Config{DripInterval: interval})
			undripped, err := c.Complete(context.Background(), summarise(""))
			if err != nil {
				t.Fatal(err)
			}
			fullDrip := time.Duration(len(undripped.Raw)) * interval // about 20s
			s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrip})
			call := completeCall(c, summarise(""))
			if streamed {
				call = streamCall(c, summarise(""))
			}
			start := time.Now()
			_, err = retry.Do(context.Background(), retry.Policy{PerCallTimeout: perCall, MaxAttempts: 1}, retry.After(time.Minute), call)
			took := time.Since(start)
			var at *retry.AttemptTimeoutError
			if !errors.As(err, &at) || retry.Classify(err).Class != retry.ClassTimeout {
				t.Fatalf("err %v, want the per-call timeout", err)
			}
			if st := stats(t, base); st.ByFault["drip"] != 1 || st.DrippedBytes < 3 {
				t.Fatalf("stats %+v: bytes were not arriving", st)
			}
			if took > fullDrip/4 {
				t.Fatalf("the call lasted %v, a quarter of the %v the drip would take: not cut by the per-call timeout", took, fullDrip)
			}
		})
	}
}

// A stream whose connection drops midway is retried as a connection failure, and the
// retry gets the whole answer.
func droppedStream(t *testing.T, a Adapter) {
	s, base, c := server(t, a, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop})
	resp, retries, err := retried(retry.Policy{}, time.Minute, streamCall(c, summarise("job-drop")))
	if err != nil || resp.Content != fake.Summary(userPrompt) || resp.FinishReason != llm.FinishStop {
		t.Fatalf("Do: %+v %v", resp, err)
	}
	if len(retries) != 1 || retries[0].Class != retry.ClassConnection {
		t.Fatalf("retries %+v, want one connection retry for the dropped stream", retries)
	}
	if st := stats(t, base); st.Requests != 2 || st.ByFault["drop_stream"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// An error event in a started stream (the provider overloaded mid-answer) is an
// APIError of the wire format's type and of the stream's status (200), retried as a
// server error.
func errorEventMidStream(t *testing.T, a Adapter) {
	s, base, c := server(t, a, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultStreamError})
	resp, retries, err := retried(retry.Policy{}, time.Minute, streamCall(c, summarise("")))
	if err != nil || resp.Content != fake.Summary(userPrompt) || resp.FinishReason != llm.FinishStop {
		t.Fatalf("Do: %+v %v", resp, err)
	}
	var apiErr *llm.APIError
	if len(retries) != 1 || !errors.As(retries[0].Err, &apiErr) || apiErr.Type != a.StreamErrorType || apiErr.StatusCode != http.StatusOK || retries[0].Class != retry.ClassServerError {
		t.Fatalf("retries %+v, want one server_error retry of an APIError %s", retries, a.StreamErrorType)
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// h2Client is the adapter pointed at srv, over HTTP/2, with health-check pings short
// enough for a silent server to be noticed within a test.
func h2Client(a Adapter, srv *h2fault.Server) llm.Client {
	hc := srv.Client()
	hc.Transport.(*http.Transport).HTTP2 = &http.HTTP2Config{SendPingTimeout: 100 * time.Millisecond, PingTimeout: 100 * time.Millisecond}
	return a.New(srv.URL, hc)
}

// assertTransportFailure checks what the job handler and the ledger decide from err:
// a retryable connection error, ambiguous (the server may have processed the request)
// or not.
func assertTransportFailure(t *testing.T, err error, ambiguous bool) {
	t.Helper()
	if v := retry.Classify(err); !v.Retryable || v.Class != retry.ClassConnection {
		t.Fatalf("Classify(%v) = %+v, want a retryable connection error", err, v)
	}
	if got := ledger.IsAmbiguous(err); got != ambiguous {
		t.Fatalf("ledger.IsAmbiguous(%v) = %t, want %t", err, got, ambiguous)
	}
	if got := retry.NotProcessed(err); got == ambiguous {
		t.Fatalf("retry.NotProcessed(%v) = %t, want %t", err, got, !ambiguous)
	}
}

// A stream reset (RST_STREAM INTERNAL_ERROR) before the headers or halfway through the
// body, of an answer or a stream, through the real SDK over TLS: an ambiguous
// connection failure (the request arrived), and the retry succeeds.
func http2StreamReset(t *testing.T, a Adapter) {
	for _, tc := range []struct {
		name     string
		fault    h2fault.Fault
		streamed bool
	}{
		{"reset before headers", h2fault.ResetBeforeHeaders, false},
		{"reset mid-body", h2fault.ResetMidBody, false},
		{"stream reset before headers", h2fault.ResetBeforeHeaders, true},
		{"stream reset mid-body", h2fault.ResetMidBody, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			srv := h2fault.Start(t, fs, tc.fault, tc.fault) // two requests fail, later ones reach fake-llm
			c := h2Client(a, srv)
			call := completeCall(c, summarise("job-h2"))
			if tc.streamed {
				call = streamCall(c, summarise("job-h2"))
			}
			_, err = call(context.Background())
			assertTransportFailure(t, err, true) // the request arrived: it may have been processed

			resp, retries, err := retried(retry.Policy{}, time.Minute, call)
			if err != nil || resp.Content == "" {
				t.Fatalf("Do: %+v, %v: the retry after the reset should have succeeded", resp, err)
			}
			if len(retries) != 1 || retries[0].Class != retry.ClassConnection {
				t.Fatalf("retries %+v, want one connection retry", retries)
			}
			if srv.Requests() != 3 {
				t.Fatalf("the server saw %d requests, want 3 (the lone call, the reset attempt and its retry)", srv.Requests())
			}
		})
	}
}

// A GOAWAY below the request's stream (not processed), a GOAWAY covering it, and a
// connection whose pings go unanswered: each retryable, ambiguous only when the server
// may have processed the request; MaxAttempts then a transient ExhaustedError.
func http2GoAway(t *testing.T, a Adapter) {
	for _, tc := range []struct {
		name      string
		g         h2fault.GoAway
		ambiguous bool
	}{
		{"GOAWAY below the request's stream: not processed", h2fault.GoAwayUnprocessed, false},
		{"GOAWAY covering the request, then close", h2fault.GoAwayProcessed, true},
		{"pings unanswered: connection lost", h2fault.Silent, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := h2fault.StartGoAway(t, tc.g)
			_, retries, err := retried(retry.Policy{MaxAttempts: 2}, time.Minute, completeCall(h2Client(a, srv), summarise("job-h2")))
			var ex *retry.ExhaustedError
			if !errors.As(err, &ex) || ex.Attempts != 2 || !retry.Transient(err) {
				t.Fatalf("err %v, want ExhaustedError after 2 attempts (transient: the queue redelivers)", err)
			}
			assertTransportFailure(t, err, tc.ambiguous)
			if len(retries) != 1 || srv.Requests() != 2 {
				t.Fatalf("%d retries, %d requests: want 1 retry and 2 requests", len(retries), srv.Requests())
			}
		})
	}
}
