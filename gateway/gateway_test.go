package gateway_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/retry"
)

// upstream is fake-llm (llm/fakeserver, which ignores Idempotency-Key unless told
// otherwise) behind a recorder of the Authorization headers it receives.
type upstream struct {
	*fakeserver.Server
	mu    sync.Mutex
	auths []string
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.auths = append(u.auths, r.Header.Get("Authorization"))
	u.mu.Unlock()
	u.Server.ServeHTTP(w, r)
}

type env struct {
	up     *upstream
	gw     *gateway.Gateway
	url    string // the gateway's /v1
	ledger *ledger.Ledger
	reg    *prometheus.Registry
	db     ledger.DB
}

func setup(t *testing.T, fake fakeserver.Config, cfg gateway.Config) *env {
	t.Helper()
	fake.Logger = testenv.Logger(t)
	fs, err := fakeserver.New(fake)
	if err != nil {
		t.Fatal(err)
	}
	up := &upstream{Server: fs}
	ups := httptest.NewServer(up)
	t.Cleanup(func() { fs.Close(); ups.Close() })
	pool, _ := testenv.Postgres(t)
	reg := prometheus.NewRegistry()
	cfg.Upstream, cfg.DB, cfg.Logger, cfg.Registerer = ups.URL+"/v1", pool, testenv.Logger(t), reg
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	return &env{up: up, gw: g, url: gs.URL + "/v1", ledger: g.Ledger(), reg: reg, db: pool}
}

const chatBody = `{"model":"gpt-4.1-mini","temperature":1,"messages":[{"role":"user","content":"Say one random word."}]}`

func post(t *testing.T, url, key, auth, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

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

// keyFor is the gateway's key of an Idempotency-Key sent with the Authorization header
// auth.
func keyFor(auth, key string) string {
	return gateway.KeyFor(gateway.CredentialScope(http.Header{"Authorization": {auth}}), key)
}

// requestsWith reads onceflow_gateway_requests_total{result}.
func requestsWith(t *testing.T, reg *prometheus.Registry, result string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "onceflow_gateway_requests_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if m.GetLabel()[0].GetValue() == result {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
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
