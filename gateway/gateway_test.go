package gateway_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/retry"
)

func TestReplayIsByteForByte(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{}, gateway.Config{})
	key := "replay-key-0000000001"
	r1, b1 := post(t, e.url+"/chat/completions", key, "Bearer sk-alice", chatBody)
	if r1.StatusCode != 200 || r1.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first: %d %s", r1.StatusCode, b1)
	}
	// Same key, same body spelled differently: the same request.
	respelled := `{ "messages":[{"content":"Say one random word.","role":"user"}], "temperature": 1, "model":"gpt-4.1-mini" }`
	r2, b2 := post(t, e.url+"/chat/completions", key, "Bearer sk-alice", respelled)
	if r2.StatusCode != 200 || r2.Header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(b1, b2) {
		t.Fatalf("replay: %d %q\n%s\n%s", r2.StatusCode, r2.Header.Get("Idempotent-Replayed"), b1, b2)
	}
	for _, h := range []string{"Content-Type", "X-Request-Id", "Openai-Version"} {
		if r1.Header.Get(h) == "" || r1.Header.Get(h) != r2.Header.Get(h) {
			t.Errorf("header %s: %q then %q", h, r1.Header.Get(h), r2.Header.Get(h))
		}
	}
	if st := e.up.Stats(); st.Requests != 1 || st.ByIdempotencyKey[keyFor("Bearer sk-alice", key)] != 1 {
		t.Fatalf("upstream saw %d requests", st.Requests)
	}
	row, err := e.ledger.Get(context.Background(), keyFor("Bearer sk-alice", key))
	if err != nil || row.State != ledger.StateSucceeded || !bytes.Equal(row.Raw, b1) || row.Provider != "gateway" || row.Model != "gpt-4.1-mini" {
		t.Fatalf("row %+v %v", row, err)
	}
	if strings.Contains(row.Key+row.Work, "sk-alice") || strings.Contains(row.Key, key) {
		t.Fatal("the row stores the credential or the raw key")
	}
}

// Two callers with one key: two answers, even when the upstream honours keys without
// scoping them (fake-llm --honour-idempotency): the gateway forwards its scoped key.
func TestCallersDoNotShareReplaysAndAuthorizationIsForwarded(t *testing.T) {
	t.Parallel()
	for _, honour := range []bool{false, true} {
		e := setup(t, fakeserver.Config{HonourIdempotency: honour}, gateway.Config{})
		key := "shared-key-0000000001"
		_, a := post(t, e.url+"/chat/completions", key, "Bearer sk-alice", chatBody)
		_, b := post(t, e.url+"/chat/completions", key, "Bearer sk-bob", chatBody)
		if bytes.Equal(a, b) {
			t.Fatalf("upstream honouring keys %v: bob got alice's answer", honour)
		}
		e.up.mu.Lock()
		auths := fmt.Sprint(e.up.auths)
		e.up.mu.Unlock()
		if auths != "[Bearer sk-alice Bearer sk-bob]" {
			t.Fatalf("upstream got Authorization %v", auths)
		}
		st := e.up.Stats()
		if st.ByIdempotencyKey[keyFor("Bearer sk-alice", key)] != 1 || st.ByIdempotencyKey[key] != 0 {
			t.Fatalf("upstream keys %v: want the gateway's scoped key, not the caller's", st.ByIdempotencyKey)
		}
	}
}

func TestConflictsAndBadInput(t *testing.T) {
	t.Parallel()
	// A short join timeout: a repeat in flight waits for the call that long, then 409.
	e := setup(t, fakeserver.Config{Latency: time.Second}, gateway.Config{MaxBodyBytes: 4096, JoinTimeout: 100 * time.Millisecond})
	url := e.url + "/chat/completions"
	key := "conflict-key-000000001"
	first := make(chan int, 1)
	go func() {
		r, _ := post(t, url, key, "Bearer sk", chatBody)
		first <- r.StatusCode
	}()
	waitUpstreamInFlight(t, e.up.Server)
	r, b := post(t, url, key, "Bearer sk", chatBody)
	if r.StatusCode != http.StatusConflict || r.Header.Get("Retry-After") != "1" || r.Header.Get("retry-after-ms") != "1000" ||
		r.Header.Get("x-should-retry") != "" {
		t.Fatalf("repeat in flight: %d %v %s, want 409 with Retry-After 1 and retry-after-ms 1000 (a retry can succeed)", r.StatusCode, r.Header, b)
	}
	if eb, ok := llm.ParseErrorBody(b); !ok || eb.Code != "idempotency_key_in_use" {
		t.Fatalf("409 body %s", b)
	}
	if code := <-first; code != 200 {
		t.Fatalf("first: %d", code)
	}
	other := strings.Replace(chatBody, "random word", "random number", 1)
	// A retry cannot mend these: the SDKs are told not to retry them.
	if r, b := post(t, url, key, "Bearer sk", other); r.StatusCode != http.StatusUnprocessableEntity || r.Header.Get("x-should-retry") != "false" {
		t.Fatalf("another body: %d %v %s", r.StatusCode, r.Header, b)
	}
	if r, b := post(t, e.url+"/responses", key, "Bearer sk", chatBody); r.StatusCode != http.StatusUnprocessableEntity || r.Header.Get("x-should-retry") != "false" {
		t.Fatalf("another path: %d %v %s", r.StatusCode, r.Header, b)
	}
	for _, bad := range []string{"short", strings.Repeat("k", 129), "\"unterminated"} {
		r, b := post(t, url, bad, "Bearer sk", chatBody)
		if eb, _ := llm.ParseErrorBody(b); r.StatusCode != 400 || eb.Code != "invalid_idempotency_key" || r.Header.Get("x-should-retry") != "false" {
			t.Errorf("key %q: %d %v %s", bad, r.StatusCode, r.Header, b)
		}
	}
	big := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`
	if r, _ := post(t, url, "big-body-key-00000001", "Bearer sk", big); r.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("keyed oversized body: %d", r.StatusCode)
	}
	if r, _ := post(t, url, "", "Bearer sk", big); r.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("pass-through oversized body: %d", r.StatusCode)
	}
	if st := e.up.Stats(); st.Requests != 1 {
		t.Fatalf("upstream saw %d requests, want only the first", st.Requests)
	}
}

func TestRequestsWithoutAKeyPassThrough(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{}, gateway.Config{})
	r1, b1 := post(t, e.url+"/chat/completions", "", "Bearer sk", chatBody)
	r2, b2 := post(t, e.url+"/chat/completions", "", "Bearer sk", chatBody)
	if r1.StatusCode != 200 || r2.StatusCode != 200 || bytes.Equal(b1, b2) || r2.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("%d %d", r1.StatusCode, r2.StatusCode)
	}
	resp, err := http.Get(e.url + "/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || e.up.Stats().Requests != 2 {
		t.Fatalf("GET /v1/models: %d", resp.StatusCode)
	}
	// A key on a path that is not a model call changes nothing: passed through, twice.
	var seen []string
	e.up.mu.Lock()
	before := len(e.up.auths)
	e.up.mu.Unlock()
	for range 2 {
		r, b := post(t, e.url+"/embeddings", "embeddings-key-000000001", "Bearer sk", `{"model":"e","input":"x"}`)
		if r.Header.Get("Idempotent-Replayed") != "" || r.Header.Get("x-should-retry") == "false" && r.StatusCode == 422 {
			t.Fatalf("keyed /v1/embeddings: %d %v %s; want it passed through", r.StatusCode, r.Header, b)
		}
		seen = append(seen, r.Status)
	}
	e.up.mu.Lock()
	after := len(e.up.auths)
	e.up.mu.Unlock()
	if after-before != 2 {
		t.Fatalf("keyed /v1/embeddings reached the upstream %d times (%v), want 2", after-before, seen)
	}
	st, _ := ledger.ReadStats(context.Background(), e.db)
	if len(st) != 0 {
		t.Fatalf("keyless requests wrote ledger rows: %+v", st)
	}
	if r, _ := post(t, strings.TrimSuffix(e.url, "/v1")+"/other", "", "", "{}"); r.StatusCode != 404 {
		t.Fatalf("a path outside /v1: %d", r.StatusCode)
	}
}

// The official openai-go client, pointed at the gateway, retrying with the same key:
// its first call has a timeout shorter than the upstream's latency and gives up (the
// client disconnects); the application calls again with the same key, which joins the
// upstream call still going on, and the answer is the recorded one. One upstream request
// per key.
func TestOpenAISDKRetriesWithOneKeyMakeOneUpstreamRequest(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{Latency: 1500 * time.Millisecond}, gateway.Config{})
	client := oai.NewClient(option.WithBaseURL(e.url), option.WithAPIKey("sk-sdk"), option.WithMaxRetries(6))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	params := oai.ChatCompletionNewParams{Model: "gpt-4.1-mini", Temperature: oai.Float(1),
		Messages: []oai.ChatCompletionMessageParamUnion{oai.UserMessage("Say one random word.")}}
	keys := []string{"sdk-key-0000000000000001", "sdk-key-0000000000000002"}
	ids := map[string]string{}
	for _, key := range keys {
		var c *oai.ChatCompletion
		timeouts := 0
		for c == nil {
			timeout := 400 * time.Millisecond // the first call gives up before the upstream answers
			if timeouts > 0 {
				timeout = 20 * time.Second
			}
			var err error
			c, err = client.Chat.Completions.New(ctx, params, option.WithHeader("Idempotency-Key", key), option.WithRequestTimeout(timeout))
			if errors.Is(err, context.DeadlineExceeded) && timeouts == 0 {
				timeouts++
				continue
			}
			if err != nil {
				t.Fatalf("key %s: %v", key, err)
			}
		}
		if timeouts != 1 {
			t.Fatalf("key %s: the first call did not time out", key)
		}
		ids[key] = c.ID
		// Asked again later, the same key replays.
		again, err := client.Chat.Completions.New(ctx, params, option.WithHeader("Idempotency-Key", key))
		if err != nil || again.ID != c.ID || again.Choices[0].Message.Content != c.Choices[0].Message.Content {
			t.Fatalf("key %s again: %v %v", key, again, err)
		}
	}
	st := e.up.Stats()
	for _, key := range keys {
		if st.ByIdempotencyKey[keyFor("Bearer sk-sdk", key)] != 1 {
			t.Fatalf("upstream requests by key: %v; want one per key", st.ByIdempotencyKey)
		}
	}
	if ids[keys[0]] == ids[keys[1]] {
		t.Fatal("two keys got one answer")
	}
	if n := requestsWith(t, e.reg, "joined"); n < 2 {
		t.Fatalf("%v requests joined a call in flight: the retries did not meet the call in flight", n)
	}
	if n := requestsWith(t, e.reg, "in_flight"); n != 0 {
		t.Fatalf("%v requests answered 409: a retry of a call in flight should join it", n)
	}
	// The same through onceflow's OpenAI adapter (SDK retries off) under retry.Do.
	adapter := openai.New(openai.Config{BaseURL: e.url, APIKey: "sk-sdk"})
	req := &llm.Request{Model: "gpt-4.1-mini", Temperature: llm.Float(1), IdempotencyKey: "adapter-key-00000000001",
		Messages: []llm.Message{{Role: llm.RoleUser, Content: "Say one random word."}}}
	pol := retry.Policy{MaxAttempts: 8, PerCallTimeout: 400 * time.Millisecond, MinAttempt: 100 * time.Millisecond, Base: 100 * time.Millisecond, Cap: 500 * time.Millisecond}
	resp, err := retry.Do(ctx, pol, retry.After(30*time.Second), func(ctx context.Context) (*llm.Response, error) {
		return adapter.Complete(ctx, req)
	})
	if err != nil || resp.ID == "" {
		t.Fatal(err)
	}
	if n := e.up.Stats().ByIdempotencyKey[keyFor("Bearer sk-sdk", req.IdempotencyKey)]; n != 1 {
		t.Fatalf("adapter: %d upstream requests for one key", n)
	}
}

func TestUpstreamHangIsBoundedAndLeavesTheRowForTheRetry(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{}, gateway.Config{Timeout: 300 * time.Millisecond})
	e.up.Script(fakeserver.Fault{Kind: fakeserver.FaultHang})
	key := "hang-key-00000000000001"
	r, b := post(t, e.url+"/chat/completions", key, "Bearer sk", chatBody)
	if r.StatusCode != http.StatusGatewayTimeout {
		t.Fatalf("hung upstream: %d %s", r.StatusCode, b)
	}
	row, _ := e.ledger.Get(context.Background(), keyFor("Bearer sk", key))
	if row.State != ledger.StateInFlight || row.Owner != "" || row.Ambiguous != 1 {
		t.Fatalf("row after a hang: %+v", row)
	}
	r, b = post(t, e.url+"/chat/completions", key, "Bearer sk", chatBody)
	if r.StatusCode != 200 {
		t.Fatalf("retry: %d %s", r.StatusCode, b)
	}
	row, _ = e.ledger.Get(context.Background(), keyFor("Bearer sk", key))
	if row.State != ledger.StateSucceeded || row.Attempt != 2 || row.Ambiguous != 1 {
		t.Fatalf("row %+v", row)
	}
}

func TestMalformedAndFailingUpstreams(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{RetryAfter: time.Second}, gateway.Config{})
	e.up.Script(fakeserver.Fault{Kind: fakeserver.FaultMalformed}, fakeserver.Fault{Kind: fakeserver.Fault429})
	key := "malformed-key-000000001"
	r, b := post(t, e.url+"/chat/completions", key, "Bearer sk", chatBody)
	if eb, _ := llm.ParseErrorBody(b); r.StatusCode != http.StatusBadGateway || eb.Code != "upstream_malformed" {
		t.Fatalf("malformed: %d %s", r.StatusCode, b)
	}
	row, _ := e.ledger.Get(context.Background(), keyFor("Bearer sk", key))
	if row.State != ledger.StateFailed || row.Ambiguous != 0 {
		t.Fatalf("row %+v", row)
	}
	// The upstream's own error answers pass through, unrecorded.
	r, _ = post(t, e.url+"/chat/completions", key, "Bearer sk", chatBody)
	if r.StatusCode != 429 || r.Header.Get("Retry-After") != "1" || r.Header.Get("x-should-retry") == "false" {
		t.Fatalf("429 passed on as %d %v", r.StatusCode, r.Header)
	}
	r, _ = post(t, e.url+"/chat/completions", key, "Bearer sk", chatBody)
	if r.StatusCode != 200 || r.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("third: %d", r.StatusCode)
	}
	if e.up.Stats().Requests != 3 {
		t.Fatalf("%d upstream requests", e.up.Stats().Requests)
	}
}

func readSSE(t *testing.T, resp *http.Response) (string, error) {
	t.Helper()
	var b strings.Builder
	sc := bufio.NewReader(resp.Body)
	for {
		line, err := sc.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			if errors.Is(err, io.EOF) {
				return b.String(), nil
			}
			return b.String(), err
		}
	}
}

func TestStreamsAreRecordedAndReplayedWhole(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{}, gateway.Config{})
	e.up.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop}) // the first stream closes halfway
	body := `{"model":"gpt-4.1-mini","stream":true,"messages":[{"role":"user","content":"Summarise: ` + strings.Repeat("many words here ", 30) + `"}]}`
	key := "stream-key-000000000001"
	send := func() (*http.Response, string, error) {
		req, _ := http.NewRequest(http.MethodPost, e.url+"/chat/completions", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Authorization", "Bearer sk")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		s, err := readSSE(t, resp)
		return resp, s, err
	}
	_, cut, err := send()
	if err == nil || strings.Contains(cut, "[DONE]") {
		t.Fatalf("the dropped stream reached the client as complete: %v %q", err, cut)
	}
	row, _ := e.ledger.Get(context.Background(), keyFor("Bearer sk", key))
	if row.State != ledger.StateInFlight || row.Ambiguous != 1 || row.Partial == "" || !strings.HasPrefix(cut, row.Partial) {
		t.Fatalf("row after a dropped stream: state %s ambiguous %d partial %q", row.State, row.Ambiguous, row.Partial)
	}
	resp, whole, err := send()
	if err != nil || resp.StatusCode != 200 || !strings.HasSuffix(whole, "data: [DONE]\n\n") {
		t.Fatalf("retry: %v %q", err, whole)
	}
	resp2, again, err := send()
	if err != nil || again != whole || resp2.Header.Get("Idempotent-Replayed") != "true" || !strings.HasPrefix(resp2.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("replay differs: %v\n%q\n%q", err, whole, again)
	}
	if e.up.Stats().Requests != 2 {
		t.Fatalf("%d upstream requests", e.up.Stats().Requests)
	}
	// The SDK reads the replayed stream like a live one.
	client := oai.NewClient(option.WithBaseURL(e.url), option.WithAPIKey("sk"))
	var params oai.ChatCompletionNewParams
	_ = json.Unmarshal([]byte(body), &params)
	stream := client.Chat.Completions.NewStreaming(context.Background(), params, option.WithHeader("Idempotency-Key", key))
	var text strings.Builder
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			text.WriteString(ch.Delta.Content)
		}
	}
	if err := stream.Err(); err != nil || text.Len() == 0 {
		t.Fatalf("SDK on the replay: %v %q", err, text.String())
	}
}

// With PostgreSQL down the gateway cannot record a keyed call: 503 with Retry-After and
// retry-after-ms (a retry can succeed once it is back), no x-should-retry: false, and
// the upstream is not called (an unrecorded call could not be replayed).
func TestLedgerDownAnswers503WithRetryAfterMs(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	up := &upstream{Server: fs}
	ups := httptest.NewServer(up)
	t.Cleanup(func() { fs.Close(); ups.Close() })
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "")
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: pool, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	pg.Stop()
	r, b := post(t, gs.URL+"/v1/chat/completions", "ledger-down-key-0001", "Bearer sk", chatBody)
	if eb, _ := llm.ParseErrorBody(b); r.StatusCode != http.StatusServiceUnavailable || eb.Code != "ledger_unavailable" ||
		r.Header.Get("Retry-After") != "1" || r.Header.Get("retry-after-ms") != "1000" || r.Header.Get("x-should-retry") == "false" {
		t.Fatalf("ledger down: %d %v %s, want 503 ledger_unavailable with Retry-After 1 and retry-after-ms 1000", r.StatusCode, r.Header, b)
	}
	if n := fs.Stats().Requests; n != 0 {
		t.Fatalf("%d upstream requests while the ledger was down, want 0", n)
	}
}

// An upstream's answer that no retry can mend (a bad request, a bad credential) reaches
// the SDK with x-should-retry: false unless the upstream said otherwise; one a retry can
// mend does not.
func TestUpstreamErrorsARetryCannotMendSayNotToRetry(t *testing.T) {
	t.Parallel()
	statuses := []int{401, 400, 403, 404, 422, 500, 503, 409}
	var mu sync.Mutex
	n := 0
	up := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		status := statuses[n%len(statuses)]
		n++
		mu.Unlock()
		if status == 403 {
			w.Header().Set("X-Should-Retry", "true") // the upstream's own word wins
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, `{"error":{"message":"no","type":"invalid_request_error"}}`)
	})
	fl := gatewaysOn(t, up, 1, gateway.Config{})
	for i, status := range statuses {
		r, _ := post(t, fl.urls[0]+"/chat/completions", "upstream-error-key-"+strconv.Itoa(i)+"-000", "Bearer sk", chatBody)
		want := ""
		switch status {
		case 400, 401, 404, 422:
			want = "false"
		case 403:
			want = "true"
		}
		if r.StatusCode != status || r.Header.Get("x-should-retry") != want {
			t.Errorf("upstream %d: passed on as %d with x-should-retry %q, want %q", status, r.StatusCode, r.Header.Get("x-should-retry"), want)
		}
	}
}

// A request that reuses a key in flight with another body (or on another path) gets 422
// with x-should-retry: false on the owner's process and on another, never joins the
// call and makes none; the call's own answer is unaffected.
func TestKeyReuseWhileInFlightIs422(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	fl := gatewaysOn(t, up, 2, gateway.Config{})
	key := "reuse-in-flight-key-01"
	owner := openStream(t, fl.urls[0], key)
	<-up.sent
	other := strings.Replace(streamBody, "random", "other", 1)
	for i, url := range fl.urls {
		for _, c := range []struct{ path, body string }{{"/chat/completions", other}, {"/completions", streamBody}, {"/responses", streamBody}} {
			code, _, b := rawPost(t, url+c.path, c.body, http.Header{"Idempotency-Key": {key}, "Authorization": {"Bearer sk"}})
			if code != http.StatusUnprocessableEntity {
				t.Fatalf("gateway %d, %s with the key in flight: %d %s, want 422", i, c.path, code, b)
			}
		}
	}
	close(up.release)
	b, err := io.ReadAll(owner.Body)
	if err != nil || string(b) != gatedHead+gatedTail {
		t.Fatalf("owner: %q %v", b, err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// Bodies over ONCEFLOW_GATEWAY_MAX_BODY sent without a Content-Length (chunked) on the
// join path (the key in flight) and on the derive path get 413 with x-should-retry:
// false; they neither disturb the call in flight nor note a derived key nor call the
// upstream.
func TestOversizedChunkedBodiesAre413OnTheJoinAndDerivePaths(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	fl := gatewaysOn(t, up, 2, gateway.Config{MaxBodyBytes: 4096, DeriveKeys: gateway.DeriveRetryCount})
	key := "oversized-join-key-0001"
	owner := openStream(t, fl.urls[0], key)
	<-up.sent
	huge := `{"model":"gpt-4.1-mini","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("a", 1<<20) + `"}]}`
	for i, h := range []http.Header{{"Idempotency-Key": {key}}, {"X-Stainless-Retry-Count": {"0"}}, {"X-Stainless-Retry-Count": {"1"}}} {
		for _, url := range fl.urls {
			h.Set("Authorization", "Bearer sk")
			req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", io.MultiReader(strings.NewReader(huge)))
			req.Header = h.Clone()
			req.ContentLength = -1 // chunked
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatalf("case %d: %v", i, err) // the gateway answers before it reads the rest
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusRequestEntityTooLarge || resp.Header.Get("x-should-retry") != "false" {
				t.Fatalf("case %d: %d %v, want 413 with x-should-retry: false", i, resp.StatusCode, resp.Header)
			}
		}
	}
	close(up.release)
	b, err := io.ReadAll(owner.Body)
	if err != nil || string(b) != gatedHead+gatedTail {
		t.Fatalf("the call in flight: %q %v", b, err)
	}
	var notes int
	if err := fl.pool.QueryRow(context.Background(), `SELECT count(*) FROM gateway_derived_keys`).Scan(&notes); err != nil {
		t.Fatal(err)
	}
	if n := up.Calls(); n != 1 || notes != 0 {
		t.Fatalf("%d upstream calls and %d derived-key notes, want 1 and 0", n, notes)
	}
}

// No credential reaches the logs (at debug level), llm_calls or gateway_derived_keys,
// whatever happens to the calls: replayed, joined, derived, limited by a tenant cap,
// failed upstream with a 500 or a dropped connection, or refused with the ledger down.
func TestNoCredentialInLogsOrTables(t *testing.T) {
	t.Parallel()
	const secret = "sk-live-logged-0123456789abcdef"
	var calls atomic.Int64
	up := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		switch n := calls.Add(1); {
		case n == 3:
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, `{"error":{"message":"boom"}}`)
		case n == 4:
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				_ = c.Close()
			}
		default:
			time.Sleep(300 * time.Millisecond)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"ok","usage":{"prompt_tokens":1,"completion_tokens":1}}`)
		}
	})
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	rdb, prefix := testenv.Redis(t)
	logs := &testenv.SyncBuffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, Provider: "openai", TenantConcurrency: 1, MaxWait: time.Millisecond, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1?api_key=" + secret, DB: pool, Limiter: lim,
		DeriveKeys: gateway.DeriveRetryCount, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	url := gs.URL + "/v1/chat/completions"
	h := func(kv ...string) http.Header {
		out := http.Header{"Authorization": {"Bearer " + secret}, "X-Api-Key": {secret}}
		for i := 0; i < len(kv); i += 2 {
			out.Set(kv[i], kv[i+1])
		}
		return out
	}
	var wg sync.WaitGroup
	wg.Go(func() { rawPost(t, url, chatBody, h("Idempotency-Key", "secret-flow-key-000001")) })
	testenv.WaitFor(t, 10*time.Second, "the first call upstream", func() bool { return calls.Load() >= 1 })
	wg.Go(func() { rawPost(t, url, chatBody, h("Idempotency-Key", "secret-flow-key-000001")) }) // joins
	wg.Go(func() { rawPost(t, url, chatBody, h("X-Stainless-Retry-Count", "0")) })              // limited
	wg.Wait()
	rawPost(t, url, chatBody, h("Idempotency-Key", "secret-flow-key-000001")) // replayed
	rawPost(t, url, chatBody, h("Idempotency-Key", "secret-flow-key-000002")) // upstream 500
	rawPost(t, url, chatBody, h("Idempotency-Key", "secret-flow-key-000003")) // dropped
	rawPost(t, url, chatBody, h("X-Stainless-Retry-Count", "1"))
	if calls.Load() < 4 {
		t.Fatalf("only %d upstream calls: the flows did not run", calls.Load())
	}
	var dump string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(c::text, ' '), '') FROM llm_calls c`).Scan(&dump); err != nil {
		t.Fatal(err)
	}
	var notes string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(d::text, ' '), '') FROM gateway_derived_keys d`).Scan(&notes); err != nil {
		t.Fatal(err)
	}
	for name, s := range map[string]string{"logs": logs.String(), "llm_calls": dump, "gateway_derived_keys": notes} {
		if strings.Contains(s, secret) {
			t.Errorf("the credential is in %s", name)
		}
	}
}

// streamGoroutines counts the goroutines of a stream's recording still running in the
// process (the persister, the recording, the upstream reader, the lease renewal).
func streamGoroutines() (int, string) {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	var found []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		for _, fn := range []string{"gateway.(*persister).run", "gateway.(*Gateway).recordStream", "gateway.readStream", "ledger.(*Attempt).renew"} {
			if strings.Contains(g, fn) {
				n++
				found = append(found, fn)
				break
			}
		}
	}
	return n, strings.Join(found, ", ")
}

// Gateway.Close right after streams ended every way (complete and recorded in the
// background, cut by the upstream, left by the client mid-stream and given up by Close)
// leaves no goroutine of theirs behind, and the one Close gave up is recorded as an
// ambiguous failure. Not parallel: it counts the process's goroutines.
func TestCloseLeavesNoStreamGoroutines(t *testing.T) {
	complete := newPhased(gatedHead, gatedTail)
	ups := httptest.NewServer(complete)
	t.Cleanup(ups.Close)
	cut := &sseUpstream{script: func(int) ([]string, bool) { return []string{"data: {}\n\n"}, true }}
	cuts := httptest.NewServer(cut)
	t.Cleanup(cuts.Close)
	pool, _ := testenv.Postgres(t)
	mk := func(up string) (*gateway.Gateway, string) {
		g, err := gateway.New(gateway.Config{Upstream: up + "/v1", DB: pool, Logger: testenv.Logger(t), Registerer: prometheus.NewRegistry()})
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		return g, gs.URL + "/v1"
	}
	g, url := mk(ups.URL)
	gc, curl := mk(cuts.URL)
	// Left mid-stream by its client: the upstream holds the rest back.
	left := openStream(t, url, "close-goroutines-left")
	if got := readEvents(t, bufio.NewReader(left.Body), 2); got != gatedHead {
		t.Fatalf("head: %q", got)
	}
	<-complete.sent
	left.Body.Close()
	// Complete, recorded after the handler returned.
	if _, body, err := streamPost(t, url, "close-goroutines-done"); err != nil || body != gatedHead+gatedTail {
		t.Fatalf("a complete stream: %q %v", body, err)
	}
	if _, _, err := streamPost(t, curl, "close-goroutines-cut"); err == nil {
		t.Fatal("a cut stream ended cleanly")
	}
	if n, _ := streamGoroutines(); n == 0 {
		t.Fatal("no goroutine of the stream left by its client found: the count below proves nothing")
	}
	for _, gw := range []*gateway.Gateway{g, gc} {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		err := gw.Close(ctx)
		cancel()
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n, which := streamGoroutines()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines of streams still running after Close: %s", n, which)
		}
	}
	r, err := g.Ledger().Get(context.Background(), keyFor("Bearer sk", "close-goroutines-left"))
	if err != nil || r.State != ledger.StateInFlight || r.Owner != "" || r.Ambiguous != 1 {
		t.Fatalf("the stream Close gave up: %+v %v; want in_flight, released, ambiguous 1", r, err)
	}
}

// An outage longer than the gateway's patience for a record (succeedPatience, 15 s):
// a keyed unary call is in flight on gateway 0 when PostgreSQL stops; the upstream
// answers during the outage; the client has given up meanwhile (its SDK's timeout).
// While PostgreSQL is down, the same key on gateway 1 gets a clear 503 (Retry-After,
// retry-after-ms) and makes no upstream call. Once PostgreSQL is back, the answer that
// was generated (and billed) must be recorded, so that the client's retry, on either
// process, is a replay: one upstream call in all.
func TestAnswerArrivingDuringALongOutageIsRecordedOnceItIsBack(t *testing.T) {
	testenv.Long(t) // a PostgreSQL outage of 19 s
	t.Parallel()
	up := newHeldUnary()
	pg, urls := privateFleet(t, up, gateway.Config{Ledger: ledger.Config{Lease: 3 * time.Second}})
	const key = "long-outage-unary-0001"
	first := make(chan reply, 1)
	go func() { first <- sendWithin(urls[0], key, chatBody, 5*time.Second) }() // an SDK's short timeout
	select {
	case <-up.received:
	case <-time.After(15 * time.Second):
		t.Fatal("the call never reached the upstream")
	}
	down := time.Now()
	pg.Stop()
	close(up.release) // the upstream answers while PostgreSQL is down
	if r := sendWithin(urls[1], key, chatBody, 10*time.Second); !isClear503(r) {
		t.Errorf("the same key on the other gateway during the outage: %d %v %q %v; want a clear 503", r.code, r.header, r.body, r.err)
	}
	if r := sendWithin(urls[1], "long-outage-unary-new-0002", chatBody, 10*time.Second); !isClear503(r) {
		t.Errorf("a new key during the outage: %d %v %q %v; want a clear 503", r.code, r.header, r.body, r.err)
	}
	r1 := <-first
	t.Logf("the first client: %d %v", r1.code, r1.err)
	time.Sleep(time.Until(down.Add(19 * time.Second))) // past succeedPatience
	pg.Start()
	t.Logf("PostgreSQL was down for %v", time.Since(down).Round(time.Millisecond))
	time.Sleep(3 * time.Second) // time for a record that waited for PostgreSQL to land
	for i, u := range urls {
		r := sendWithin(u, key, chatBody, 20*time.Second)
		if r.err != nil || r.code != http.StatusOK || r.header.Get("Idempotent-Replayed") != "true" || r.body != up.answer(1) {
			t.Errorf("retry on gateway %d after the outage: %d replayed=%q %q %v; want the first generation replayed",
				i, r.code, r.header.Get("Idempotent-Replayed"), r.body, r.err)
		}
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("%d upstream calls, want 1: the answer generated during the outage was never recorded, and the retry generated (and paid for) another", n)
	}
}

// A PostgreSQL that hangs rather than refuses (a network partition, a paused VM, a
// failover whose old primary's address goes dark): a keyed request must still get the
// documented 503 with retry-after-ms promptly (here: within 12 s; the ledger's writes
// are bounded by WriteTimeout, 5 s, and connecting by connect_timeout, 3 s), so that
// the SDK retries and the caller is not held for ONCEFLOW_GATEWAY_TIMEOUT (5 min by
// default). Nothing reaches the upstream meanwhile.
func TestHungPostgresAnswers503Promptly(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	fr := newFreezer(t, u.Host)
	u.Host = fr.ln.Addr().String()
	up := newHeldUnary()
	close(up.release)
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := connect.Postgres(ctx, u.String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: pool, Timeout: 45 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	if r := sendWithin(gs.URL+"/v1", "hung-pg-warm-up-0001", chatBody, 10*time.Second); r.err != nil || r.code != http.StatusOK {
		t.Fatalf("warm-up: %d %q %v", r.code, r.body, r.err)
	}
	fr.freeze()
	start := time.Now()
	r := sendWithin(gs.URL+"/v1", "hung-pg-keyed-0002", chatBody, 12*time.Second)
	took := time.Since(start).Round(time.Millisecond)
	calls := up.calls.Load()
	fr.thaw() // let the held request finish before cleanup
	if !isClear503(r) {
		t.Errorf("keyed request while PostgreSQL hangs: %d %v %q %v after %v; want a clear 503 within 12 s", r.code, r.header, r.body, r.err, took)
	}
	if calls != 1 {
		t.Errorf("%d upstream calls while PostgreSQL hung, want only the warm-up's", calls)
	}
}

// The operator's outage drill, shorter than the gateway's patience for a record: two
// gateways, a stream in flight on gateway 0 and a unary call in flight on gateway 1
// when PostgreSQL stops for about 5 s. Meanwhile new requests arrive on both processes,
// for the keys in flight and for new keys: each gets a clear 503 (Retry-After: 1,
// retry-after-ms: 1000, never x-should-retry: false) and none reaches the upstream. The
// calls in flight end during the outage; once PostgreSQL is back both are recorded,
// every retry on either process replays them, nothing is left in_flight, and a key
// refused during the outage works at once with one call. Upstream calls: exactly one
// per key.
func TestOutageDrillTwoGatewaysNoDoubledCallNoStuckKey(t *testing.T) {
	t.Parallel()
	stream := newGatedStream()
	unary := newHeldUnary()
	mux := http.NewServeMux()
	calls := map[string]*atomic.Int64{}
	count := func(name string, h http.Handler) http.Handler {
		calls[name] = &atomic.Int64{}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { calls[name].Add(1); h.ServeHTTP(w, r) })
	}
	var sawStream, sawUnary http.Handler = count("stream", stream), count("unary", unary)
	fresh := newHeldUnary()
	close(fresh.release)
	sawFresh := count("fresh", fresh)
	mux.Handle("/v1/chat/completions", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Header.Get("Idempotency-Key") {
		case keyFor("Bearer sk", "drill-stream-0001"):
			sawStream.ServeHTTP(w, r)
		case keyFor("Bearer sk", "drill-unary-0001"):
			sawUnary.ServeHTTP(w, r)
		default:
			sawFresh.ServeHTTP(w, r)
		}
	}))
	pg, urls := privateFleet(t, mux, gateway.Config{Timeout: 45 * time.Second})
	sresp := openStream(t, urls[0], "drill-stream-0001")
	sr := bufio.NewReader(sresp.Body)
	if got, err := readExactly(sr, len(gatedHead), 10*time.Second); err != nil || got != gatedHead {
		t.Fatalf("stream head: %q %v", got, err)
	}
	<-stream.sent
	unaryDone := make(chan reply, 1)
	go func() { unaryDone <- sendWithin(urls[1], "drill-unary-0001", chatBody, 40*time.Second) }()
	<-unary.received
	down := time.Now()
	pg.Stop()
	for _, u := range urls {
		for _, key := range []string{"drill-unary-0001", "drill-fresh-0001"} {
			if r := sendWithin(u, key, chatBody, 10*time.Second); !isClear503(r) {
				t.Errorf("%s on %s during the outage: %d %v %q %v; want a clear 503", key, u, r.code, r.header, r.body, r.err)
			}
		}
		req, _ := http.NewRequest(http.MethodPost, u+"/chat/completions", strings.NewReader(streamBody))
		req.Header.Set("Idempotency-Key", "drill-stream-0001")
		req.Header.Set("Authorization", "Bearer sk")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			// On the owner's process the stream may be followed in memory; elsewhere, 503.
			if resp.StatusCode != http.StatusOK && !isClear503(reply{code: resp.StatusCode, header: resp.Header}) {
				t.Errorf("the stream's key on %s during the outage: %d %v %q", u, resp.StatusCode, resp.Header, b)
			}
		}
	}
	close(stream.release)
	close(unary.release)
	if rest, err := readAllWithin(sr, 15*time.Second); err != nil || rest != gatedTail {
		t.Fatalf("stream tail during the outage: %q %v", rest, err)
	}
	time.Sleep(time.Until(down.Add(5 * time.Second)))
	pg.Start()
	if r := <-unaryDone; r.err != nil || r.code != http.StatusOK || r.body != unary.answer(1) {
		t.Fatalf("the unary call in flight through the outage: %d %q %v", r.code, r.body, r.err)
	}
	for _, u := range urls {
		r := sendWithin(u, "drill-unary-0001", chatBody, 20*time.Second)
		if r.code != http.StatusOK || r.header.Get("Idempotent-Replayed") != "true" || r.body != unary.answer(1) {
			t.Errorf("unary retry on %s: %d %v %q %v", u, r.code, r.header, r.body, r.err)
		}
		_, body, err := streamPost(t, u, "drill-stream-0001")
		if err != nil || body != gatedHead+gatedTail {
			t.Errorf("stream retry on %s: %q %v", u, body, err)
		}
		if r := sendWithin(u, "drill-fresh-0001", chatBody, 20*time.Second); r.code != http.StatusOK {
			t.Errorf("a key refused during the outage, on %s afterwards: %d %q %v", u, r.code, r.body, r.err)
		}
	}
	for name, want := range map[string]int64{"stream": 1, "unary": 1, "fresh": 1} {
		if n := calls[name].Load(); n != want {
			t.Errorf("%s: %d upstream calls, want %d", name, n, want)
		}
	}
}

// Some upstreams take their key in the query string (Gemini's ?key=, many self-hosted
// servers' ?api_key=): no credential is stored, not even in the transport error of a
// keyed request whose upstream connection drops (which net/http renders with the full
// URL, query included) in llm_calls.error.
func TestQueryStringCredentialIsNotStoredInTheLedger(t *testing.T) {
	t.Parallel()
	const secret = "AIzaSy-query-credential-0123456789"
	drop := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close() // the connection drops before any answer
		}
	})
	url, pool, logs := loggedGateway(t, drop)
	code, _, body := rawPost(t, url+"/chat/completions?key="+secret, chatBody, http.Header{"Idempotency-Key": {"query-cred-key-000001"}})
	if code != http.StatusBadGateway {
		t.Fatalf("dropped upstream: %d %s, want 502", code, body)
	}
	var stored string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(coalesce(error, ''), ' '), '') FROM llm_calls`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(stored, secret) {
		t.Errorf("llm_calls.error stores the query-string credential: %q", stored)
	}
	if strings.Contains(logs.String(), secret) || strings.Contains(string(body), secret) {
		t.Errorf("the query-string credential reached the logs or the answer")
	}
}

// A model's answer may contain U+0000 (JSON "\u0000" is valid, and a prompt can ask
// for it), which PostgreSQL's jsonb refuses: the gateway still records the answer, and
// the caller's retry with the same key is a replay, not a 409 and then a second
// generation.
func TestAnswerWithNULIsRecordedAndReplayed(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"chatcmpl-nul","object":"chat.completion","created":1,"model":"gpt-4.1-mini",`+
			`"choices":[{"index":0,"message":{"role":"assistant","content":"a\u0000b"},"finish_reason":"stop"}],`+
			`"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	url, _, _ := loggedGateway(t, upstream)
	h := http.Header{"Idempotency-Key": {"nul-answer-key-000001"}, "Authorization": {"Bearer sk-alice"}}
	code1, _, b1 := rawPost(t, url+"/chat/completions", chatBody, h)
	if code1 != http.StatusOK {
		t.Fatalf("first: %d %s", code1, b1)
	}
	code2, replayed, b2 := rawPost(t, url+"/chat/completions", chatBody, h)
	if code2 != http.StatusOK || replayed != "true" || !bytes.Equal(b1, b2) {
		t.Fatalf("retry of an answer holding \\u0000: %d replayed=%q %s; want the recorded answer replayed", code2, replayed, b2)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("upstream called %d times", n)
	}
}

// The gateway forwards /v1/REST to Upstream + REST: the caller chooses only the path
// below the upstream's, and its query.
func TestUpstreamURL(t *testing.T) {
	t.Parallel()
	// The upstream's own query (Azure OpenAI's api-version in ONCEFLOW_LLM_BASE_URL) is kept,
	// and the caller's is appended; Proxy-Authorization, a hop-by-hop header, is not
	// forwarded on the keyed path either.
	t.Run("query kept and Proxy-Authorization dropped", func(t *testing.T) {
		t.Parallel()
		var mu sync.Mutex
		var queries []string
		var proxyAuth []string
		ups := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			queries = append(queries, r.URL.RawQuery)
			proxyAuth = append(proxyAuth, r.Header.Get("Proxy-Authorization"))
			mu.Unlock()
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"x"}`)
		}))
		t.Cleanup(ups.Close)
		pool, _ := testenv.Postgres(t)
		g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/openai/deployments/d1?api-version=2024-10-21", DB: pool, Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		h := http.Header{"Api-Key": {"azure-key"}, "Proxy-Authorization": {"Basic cHJveHk6c2VjcmV0"}}
		rawPost(t, gs.URL+"/v1/chat/completions?trace=1", chatBody, h)
		h.Set("Idempotency-Key", "azure-query-key-00001")
		rawPost(t, gs.URL+"/v1/chat/completions", chatBody, h)
		mu.Lock()
		defer mu.Unlock()
		if len(queries) != 2 || queries[0] != "api-version=2024-10-21&trace=1" || queries[1] != "api-version=2024-10-21" {
			t.Fatalf("upstream queries %q", queries)
		}
		for i, p := range proxyAuth {
			if p != "" {
				t.Errorf("request %d forwarded Proxy-Authorization %q", i, p)
			}
		}
	})
	// net/http's ServeMux (as `onceflow gateway` mounts it) cleans "/v1/../x" but not its
	// escaped spellings: /v1/%2e%2e/x reaches the handler as Path "/v1/../x", and the
	// gateway must not send the dot segments on (a caller escaping ONCEFLOW_LLM_BASE_URL's
	// path: another tenant's or deployment's prefix on a shared host, an admin route).
	t.Run("dot segments do not escape its path", func(t *testing.T) {
		t.Parallel()
		var mu sync.Mutex
		var paths []string
		ups := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			paths = append(paths, r.URL.Path)
			mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{}`)
		}))
		t.Cleanup(ups.Close)
		pool, _ := testenv.Postgres(t)
		g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/tenant-a/v1", DB: pool, Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		mux := http.NewServeMux() // as cmd/onceflow mounts it (internal/httpapi's mux)
		mux.Handle("/v1/", g)
		gs := httptest.NewServer(mux)
		t.Cleanup(gs.Close)
		for i, p := range []string{"/v1/%2e%2e/%2e%2e/tenant-b/v1/chat/completions", "/v1/..%2f..%2fadmin"} {
			for _, keyed := range []bool{false, true} {
				h := http.Header{"Authorization": {"Bearer sk-alice"}}
				if keyed {
					h.Set("Idempotency-Key", "dot-segment-key-00000"+string(rune('0'+i)))
				}
				rawPost(t, gs.URL+p, chatBody, h)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		for _, p := range paths {
			if !strings.HasPrefix(p, "/tenant-a/v1/") || strings.Contains(p, "..") {
				t.Errorf("the upstream was asked for %q, outside /tenant-a/v1/", p)
			}
		}
	})
}

// Ready fails on a database nobody migrated, naming the migration, and holds on a
// migrated one (`onceflow gateway` serves it as /readyz's "ledger" check).
func TestReadyNamesAMissingMigration(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	empty, err := connect.Postgres(ctx, testenv.EmptySchema(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(empty.Close)
	migrated, _ := testenv.Postgres(t)
	for _, tc := range []struct {
		name string
		cfg  gateway.Config
		want error
	}{
		{"unmigrated", gateway.Config{DB: empty}, gateway.ErrNotMigrated},
		{"unmigrated, derived keys", gateway.Config{DB: empty, DeriveKeys: "retry-count"}, gateway.ErrNotMigrated},
		{"migrated", gateway.Config{DB: migrated}, nil},
		{"migrated, derived keys", gateway.Config{DB: migrated, DeriveKeys: "retry-count"}, nil},
	} {
		tc.cfg.Upstream, tc.cfg.Logger = "http://127.0.0.1:1/v1", testenv.Logger(t)
		g, err := gateway.New(tc.cfg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if err := g.Ready(ctx); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("%s: Ready = %v, want %v", tc.name, err, tc.want)
		}
	}
}

// Two callers whose credentials travel in another header than Authorization (Anthropic's
// x-api-key, Azure OpenAI's api-key, a header the operator configured) send one key and
// one body: each gets its own upstream call, neither gets the other's answer, and each
// still gets its own answer replayed.
func TestCallersWithOtherCredentialHeadersDoNotShareReplays(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, path, body, header string
		cfg                      gateway.Config
	}{
		{name: "anthropic x-api-key", path: "/messages", body: messagesBody, header: "x-api-key"},
		{name: "azure api-key", path: "/chat/completions", body: chatBody, header: "api-key"},
		{name: "configured X-Custom-Key", path: "/chat/completions", body: chatBody, header: "X-Custom-Key",
			cfg: gateway.Config{CredentialHeaders: []string{"x-custom-key"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, fakeserver.Config{}, c.cfg)
			url, key := e.url+c.path, "credential-key-0000001"
			alice, bob := header(c.header, "sk-alice"), header(c.header, "sk-bob")
			ra, a := send(t, url, key, c.body, alice)
			rb, b := send(t, url, key, c.body, bob)
			if n := e.up.Stats().Requests; n != 2 || bytes.Equal(a, b) || rb.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("bob (another %s) got alice's answer: %d upstream requests, replayed %q", c.header, n, rb.Header.Get("Idempotent-Replayed"))
			}
			if ra.Header.Get("Idempotent-Replayed") != "" {
				t.Fatal("alice's first request was a replay")
			}
			// Each caller's own retry is still a replay of its own answer.
			for _, who := range []struct {
				h    http.Header
				want []byte
			}{{alice, a}, {bob, b}} {
				r, got := send(t, url, key, c.body, who.h)
				if r.Header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(got, who.want) {
					t.Fatalf("retry with %s %v: replayed %q, same answer %v", c.header, who.h, r.Header.Get("Idempotent-Replayed"), bytes.Equal(got, who.want))
				}
			}
			if n := e.up.Stats().Requests; n != 2 {
				t.Fatalf("%d upstream requests after the retries, want 2", n)
			}
		})
	}
}

// A request without any credential header never gets an answer recorded for one that
// had a credential (in any of the three headers), nor the other way round.
func TestRequestWithoutCredentialsGetsNoCredentialedReplay(t *testing.T) {
	t.Parallel()
	for _, h := range []string{"Authorization", "x-api-key", "api-key"} {
		t.Run(h, func(t *testing.T) {
			t.Parallel()
			e := setup(t, fakeserver.Config{}, gateway.Config{})
			url := e.url + "/chat/completions"
			_, owned := send(t, url, "anonymous-key-0000001", chatBody, header(h, "sk-alice"))
			r, anon := send(t, url, "anonymous-key-0000001", chatBody, nil)
			if n := e.up.Stats().Requests; n != 2 || bytes.Equal(owned, anon) || r.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("a request without credentials got the answer recorded under %s: %d upstream requests", h, n)
			}
			// The other way round: the credentialed caller does not get the anonymous answer.
			_, anonFirst := send(t, url, "anonymous-key-0000002", chatBody, nil)
			r, owned = send(t, url, "anonymous-key-0000002", chatBody, header(h, "sk-alice"))
			if n := e.up.Stats().Requests; n != 4 || bytes.Equal(owned, anonFirst) || r.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("a request with %s got the anonymous answer: %d upstream requests", h, n)
			}
			// Two requests without credentials do share their key (they are one caller).
			r, again := send(t, url, "anonymous-key-0000002", chatBody, nil)
			if r.Header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(again, anonFirst) || e.up.Stats().Requests != 4 {
				t.Fatalf("the anonymous retry was not a replay")
			}
		})
	}
}

// Changing DefaultCredentialHeaders cannot make two callers' credentials share keys:
// the gateway scopes by a list of its own. (Not parallel: it changes the variable
// while no parallel test runs.)
func TestDefaultCredentialHeadersCannotUnscopeKeys(t *testing.T) {
	saved := gateway.DefaultCredentialHeaders
	t.Cleanup(func() { gateway.DefaultCredentialHeaders = saved })
	gateway.DefaultCredentialHeaders = nil
	for _, name := range []string{"Authorization", "X-Api-Key", "Api-Key"} {
		a := gateway.CredentialScope(http.Header{name: {"sk-tenant-a"}})
		b := gateway.CredentialScope(http.Header{name: {"sk-tenant-b"}})
		if a == b || a == (gateway.Scope{}) {
			t.Errorf("with DefaultCredentialHeaders emptied, two %s values share a scope (or have none)", name)
		}
	}
}

// The scope is unambiguous: names are canonical, values are kept in order and never
// run into each other or into another header's, other headers do not count, and a
// request without any credential header has the zero Scope, which no credential header
// (not even an empty one) gives.
func TestCredentialScopeIsUnambiguous(t *testing.T) {
	t.Parallel()
	scope := gateway.CredentialScope
	distinct := []http.Header{
		{},
		{"Authorization": {""}},
		{"Authorization": {"a"}},
		{"X-Api-Key": {"a"}},
		{"Api-Key": {"a"}},
		{"X-Api-Key": {"a"}, "Api-Key": {"b"}},
		{"X-Api-Key": {"b"}, "Api-Key": {"a"}},
		{"Authorization": {"a", "b"}},
		{"Authorization": {"b", "a"}},
		{"Authorization": {"ab"}},
		{"Authorization": {"a\nb"}},
		{"Authorization": {"a", ""}},
		{"Authorization": {"a"}, "X-Api-Key": {""}},
	}
	seen := map[gateway.Scope]int{}
	keys := map[string]int{}
	for i, h := range distinct {
		s := scope(h)
		if j, dup := seen[s]; dup {
			t.Errorf("%v and %v share a scope", distinct[j], h)
		}
		seen[s] = i
		k := gateway.KeyFor(s, "same-idempotency-key-01")
		if j, dup := keys[k]; dup {
			t.Errorf("%v and %v share a key", distinct[j], h)
		}
		keys[k] = i
	}
	if scope(http.Header{}) != (gateway.Scope{}) || scope(http.Header{"Content-Type": {"application/json"}}) != (gateway.Scope{}) {
		t.Error("a request without credentials does not have the zero Scope")
	}
	lower := http.Header{}
	lower.Add("x-api-key", "a")
	if scope(lower) != scope(http.Header{"X-Api-Key": {"a"}}) || scope(http.Header{"X-Api-Key": {"a"}, "Content-Type": {"x"}}) != scope(lower) {
		t.Error("the scope depends on the case of names or on other headers")
	}
	custom := http.Header{"X-Custom-Key": {"a"}}
	if scope(custom) != (gateway.Scope{}) || scope(custom, "x-custom-key") == (gateway.Scope{}) ||
		scope(custom, "x-custom-key") != scope(custom, "X-CUSTOM-KEY", "x-custom-key") {
		t.Error("an extra credential header does not scope, or depends on its spelling")
	}
	if gateway.KeyFor(gateway.Scope{}, "k-0000000000000001") == gateway.KeyFor(gateway.Scope{}, "k-0000000000000002") {
		t.Error("two keys without credentials share a key")
	}
}

func TestInvalidCredentialHeaderIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	for _, name := range []string{"", "bad header", "X-Key:", "X-Ké"} {
		_, err := gateway.New(gateway.Config{Upstream: "http://127.0.0.1:1/v1", DB: pool, CredentialHeaders: []string{"X-Ok", name}})
		if err == nil || !strings.Contains(err.Error(), "CredentialHeaders") {
			t.Errorf("CredentialHeaders %q: %v", name, err)
		}
	}
}

// Every recorded protocol (OpenAI Chat Completions and Responses, Anthropic Messages),
// unary and streaming: requests that arrive while the call runs, on its process and on
// another, join it; later ones replay it; all get the first answer byte for byte, from
// one upstream call. The same key under another credential is another call. The
// upstream takes 3s, so that the joiners reach the gateway while it runs even on a
// loaded machine under -race (700ms was not always enough).
func TestEveryProtocolJoinsAndReplays(t *testing.T) {
	t.Parallel()
	for _, p := range protocols {
		for _, stream := range []bool{false, true} {
			name := p.name + "/unary"
			if stream {
				name = p.name + "/stream"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				fs, err := fakeserver.New(fakeserver.Config{Latency: 3 * time.Second, Logger: testenv.Logger(t)})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(fs.Close)
				fl := gatewaysOn(t, fs, 2, gateway.Config{})
				key := "protocol-key-" + strings.NewReplacer(" ", "-", "/", "-").Replace(name)
				firstc := make(chan protoAnswer, 1)
				go func() { firstc <- protoPost(fl.urls[0], p, stream, key, "secret-a") }()
				waitUpstreamInFlight(t, fs)
				joined := make([]protoAnswer, 4)
				var wg sync.WaitGroup
				for i := range joined {
					wg.Go(func() { joined[i] = protoPost(fl.urls[i%2], p, stream, key, "secret-a") })
				}
				wg.Wait()
				first := <-firstc
				if first.err != nil || first.status != 200 || len(first.body) == 0 {
					t.Fatalf("first: %+v", first)
				}
				if stream != strings.HasPrefix(first.contentType, "text/event-stream") {
					t.Fatalf("first: Content-Type %q", first.contentType)
				}
				for i, j := range joined {
					if j.err != nil || j.status != 200 || j.joined != "true" || j.replay != "true" || !bytes.Equal(j.body, first.body) || j.contentType != first.contentType {
						t.Fatalf("joiner %d (gateway %d): %d joined=%q err=%v %q; want the first answer %q", i, i%2, j.status, j.joined, j.err, j.body, first.body)
					}
				}
				for i := range 2 {
					r := protoPost(fl.urls[i], p, stream, key, "secret-a")
					if r.err != nil || r.status != 200 || r.replay != "true" || r.joined != "" || !bytes.Equal(r.body, first.body) {
						t.Fatalf("replay on gateway %d: %+v", i, r)
					}
				}
				if n := fs.Stats().Requests; n != 1 {
					t.Fatalf("%d upstream requests for one key, want 1", n)
				}
				other := protoPost(fl.urls[1], p, stream, key, "secret-b")
				if other.err != nil || other.status != 200 || other.replay != "" || bytes.Equal(other.body, first.body) {
					t.Fatalf("the same key under another credential: %d replayed=%q %q; want a call of its own", other.status, other.replay, other.body)
				}
				if n := fs.Stats().Requests; n != 2 {
					t.Fatalf("%d upstream requests, want 2", n)
				}
			})
		}
	}
}
