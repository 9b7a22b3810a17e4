package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

const path = "/v1/things"

var apiKeys = map[string]string{"key-acme": "acme", "key-globex": "globex"}

// tenantFromBearer is the tests' authentication: the tenant of a known bearer key.
func tenantFromBearer(r *http.Request) (string, error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if tenant, known := apiKeys[tok]; ok && known {
		return tenant, nil
	}
	return "", fmt.Errorf("unknown API key: %w", idempotency.ErrUnauthenticated)
}

// harness is a real HTTP server running the middleware on a real Redis.
type harness struct {
	t      *testing.T
	srv    *httptest.Server
	rdb    *redis.Client
	store  *redisstore.Store
	reg    *prometheus.Registry
	rt     *roundtrip.Counter
	logs   *testenv.SyncBuffer
	runs   atomic.Int64 // handler runs
	client *http.Client
}

// handlerFunc gets the run number (1 for the first run).
type handlerFunc func(w http.ResponseWriter, r *http.Request, run int64) error

// created answers 201 with the run number, a Location and a cookie.
func created(w http.ResponseWriter, r *http.Request, run int64) error {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/v1/things/%d", run))
	w.Header().Set("Set-Cookie", "session=per-request")
	w.WriteHeader(http.StatusCreated)
	return json.NewEncoder(w).Encode(map[string]any{"run": run, "echo": string(body)})
}

func newHarness(t *testing.T, cfg idempotency.Config, h handlerFunc) *harness {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	return newHarnessOn(t, rdb, prefix, cfg, h)
}

func newHarnessOn(t *testing.T, rdb *redis.Client, prefix string, cfg idempotency.Config, h handlerFunc) *harness {
	t.Helper()
	hs := &harness{t: t, rdb: rdb, reg: prometheus.NewRegistry(), rt: &roundtrip.Counter{}, logs: &testenv.SyncBuffer{}}
	rdb.AddHook(hs.rt)
	store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	hs.store = store
	cfg.Store = store
	cfg.Tenant = tenantFromBearer
	cfg.Registerer = hs.reg
	cfg.Logger = slog.New(slog.NewJSONHandler(hs.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	if cfg.StoreTimeout == 0 {
		cfg.StoreTimeout = 5 * time.Second // generous: the machine is shared and busy
	}
	mw, err := idempotency.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	handler := mw.WrapFunc(func(w http.ResponseWriter, r *http.Request) error {
		return h(w, r, hs.runs.Add(1))
	})
	mux := http.NewServeMux()
	mux.Handle("POST "+path, recoverer(handler))
	hs.srv = httptest.NewServer(mux)
	t.Cleanup(hs.srv.Close)
	hs.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}, Timeout: 30 * time.Second}
	t.Cleanup(hs.client.CloseIdleConnections)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("middleware log:\n%s", hs.logs.String())
		}
	})
	return hs
}

// panics counts panics that reached the recoverer.
var panics atomic.Int64

// recoverer is what a server puts outside the middleware: it turns a panic into a 500.
func recoverer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if p := recover(); p != nil {
				panics.Add(1)
				http.Error(w, `{"detail":"internal error"}`, http.StatusInternalServerError)
			}
		}()
		h.ServeHTTP(w, r)
	})
}

type reply struct {
	status int
	header http.Header
	body   string
}

func (r reply) detail() string {
	var d struct{ Detail string }
	_ = json.Unmarshal([]byte(r.body), &d)
	return d.Detail
}

func (r reply) replayed() bool { return r.header.Get(idempotency.HeaderReplayed) == "true" }

// post sends POST path with the given API key, Idempotency-Key (omitted when empty) and
// JSON body.
func (h *harness) post(apiKey, key, body string) reply {
	h.t.Helper()
	return h.postCtx(context.Background(), apiKey, key, body)
}

func (h *harness) postCtx(ctx context.Context, apiKey, key, body string) reply {
	h.t.Helper()
	req, err := http.NewRequestWithContext(ctx, "POST", h.srv.URL+path, strings.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return reply{status: -1, body: err.Error()}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// outcomes returns onceflow_idempotency_requests_total by outcome.
func (h *harness) outcomes() map[string]float64 {
	h.t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "onceflow_idempotency_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			out[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	return out
}

func (h *harness) wantOutcomes(want map[string]float64) {
	h.t.Helper()
	got := h.outcomes()
	for name, v := range got {
		if v != want[name] {
			h.t.Errorf("outcome %s = %v, want %v (all: %v)", name, v, want[name], got)
		}
	}
	if len(got) != 13 {
		h.t.Errorf("%d outcome series, want all 13 initialised: %v", len(got), got)
	}
}

func (h *harness) scope(tenant, key string) idempotency.Scope {
	return idempotency.Scope{Tenant: tenant, Method: "POST", Path: path, Key: key}
}

const (
	key1  = "key-0001-abcdefghijkl"
	body1 = `{"text":"hello","notify":"a@example.com"}`
)

// TestStatusTable walks the documented status table on one server, asserting the
// handler's run count (the effect) after every step.
func TestStatusTable(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h := newHarness(t, idempotency.Config{MaxBodyBytes: 1024}, func(w http.ResponseWriter, r *http.Request, run int64) error {
		if strings.Contains(r.Header.Get(idempotency.HeaderKey), "slow") {
			started <- struct{}{}
			<-release
		}
		return created(w, r, run)
	})
	runs := func(want int64) {
		t.Helper()
		if got := h.runs.Load(); got != want {
			t.Fatalf("handler ran %d times, want %d", got, want)
		}
	}

	first := h.post("key-acme", key1, body1)
	if first.status != http.StatusCreated || first.replayed() || first.header.Get("Location") != "/v1/things/1" {
		t.Fatalf("new request: %d %v %s", first.status, first.header, first.body)
	}
	runs(1)

	// Replay: the same key in its quoted form, the same body re-indented.
	again := h.post("key-acme", idempotency.QuoteKey(key1), "{\n  \"notify\": \"a@example.com\",\n  \"text\": \"hello\"\n}")
	if again.status != http.StatusCreated || !again.replayed() || again.body != first.body ||
		again.header.Get("Location") != "/v1/things/1" || again.header.Get("Content-Type") != "application/json" {
		t.Fatalf("replay: %d %v %q, want 201 replayed with body %q", again.status, again.header, again.body, first.body)
	}
	if again.header.Get("Set-Cookie") != "" {
		t.Errorf("replay carried Set-Cookie, which is not in the stored allow-list")
	}
	runs(1)

	reused := h.post("key-acme", key1, `{"text":"other","notify":"a@example.com"}`)
	if reused.status != http.StatusUnprocessableEntity || !strings.Contains(reused.detail(), "different request") {
		t.Fatalf("different body: %d %s", reused.status, reused.body)
	}
	runs(1)

	// In progress: a slow first request holds the key.
	slowKey := "slow-key-0123456789"
	done := make(chan reply)
	go func() { done <- h.post("key-acme", slowKey, body1) }()
	<-started
	conflict := h.post("key-acme", slowKey, body1)
	if conflict.status != http.StatusConflict || conflict.header.Get("Retry-After") != "1" {
		t.Fatalf("in progress: %d Retry-After %q %s", conflict.status, conflict.header.Get("Retry-After"), conflict.body)
	}
	close(release)
	if slow := <-done; slow.status != http.StatusCreated || slow.replayed() {
		t.Fatalf("slow request: %d %s", slow.status, slow.body)
	}
	runs(2)

	missing := h.post("key-acme", "", body1)
	if missing.status != http.StatusBadRequest || missing.detail() != "Idempotency-Key header is required" {
		t.Fatalf("missing key: %d %s", missing.status, missing.body)
	}
	short := h.post("key-acme", "short", body1)
	if short.status != http.StatusBadRequest || !strings.Contains(short.detail(), "16 to 128 characters") {
		t.Fatalf("malformed key: %d %s", short.status, short.body)
	}
	badQuote := h.post("key-acme", `"unterminated-0123456789`, body1)
	if badQuote.status != http.StatusBadRequest || !strings.Contains(badQuote.detail(), "closing quote") {
		t.Fatalf("malformed quoted key: %d %s", badQuote.status, badQuote.body)
	}
	badJSON := h.post("key-acme", "key-0002-abcdefghijkl", `{"text":`)
	if badJSON.status != http.StatusBadRequest || !strings.Contains(badJSON.detail(), "not valid JSON") {
		t.Fatalf("bad JSON: %d %s", badJSON.status, badJSON.body)
	}
	tooLarge := h.post("key-acme", "key-0003-abcdefghijkl", `{"text":"`+strings.Repeat("x", 2000)+`"}`)
	if tooLarge.status != http.StatusRequestEntityTooLarge || !strings.Contains(tooLarge.detail(), "1024 bytes") {
		t.Fatalf("large body: %d %s", tooLarge.status, tooLarge.body)
	}
	unauth := h.post("key-unknown", "key-0004-abcdefghijkl", body1)
	if unauth.status != http.StatusUnauthorized {
		t.Fatalf("unknown API key: %d %s", unauth.status, unauth.body)
	}
	runs(2)
	// None of the rejected requests stored anything: the same keys are still free.
	for _, k := range []string{"key-0002-abcdefghijkl", "key-0003-abcdefghijkl", "key-0004-abcdefghijkl"} {
		if n, _ := h.rdb.Exists(context.Background(), h.store.Key(h.scope("acme", k))).Result(); n != 0 {
			t.Errorf("a rejected request stored key %s", k)
		}
	}
	h.wantOutcomes(map[string]float64{
		"new": 2, "replayed": 1, "reused_422": 1, "conflict_409": 1, "invalid_400": 4,
		"too_large_413": 1, "unauthorized_401": 1,
	})
	if strings.Contains(h.logs.String(), key1) || strings.Contains(h.logs.String(), slowKey) {
		t.Error("a raw Idempotency-Key was logged")
	}
}

// TestRedisDown: with Redis stopped the middleware answers 503 with Retry-After and the
// handler does not run; once Redis is back, the same key is accepted (nothing was stored).
func TestRedisDown(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	h := newHarnessOn(t, rdb, "down", idempotency.Config{StoreTimeout: 500 * time.Millisecond, RetryAfter: 2 * time.Second}, created)
	srv.Stop()
	for range 3 {
		r := h.post("key-acme", key1, body1)
		if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") != "2" {
			t.Fatalf("Redis down: %d Retry-After %q %s", r.status, r.header.Get("Retry-After"), r.body)
		}
	}
	if n := h.runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times with Redis down", n)
	}
	srv.Start()
	if r := h.post("key-acme", key1, body1); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("after Redis came back: %d %s", r.status, r.body)
	}
	if n := h.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	h.wantOutcomes(map[string]float64{"unavailable_503": 3, "new": 1})
}

// TestRedisSlow: a Redis that does not answer within StoreTimeout (CLIENT PAUSE) gets
// 503 well before it answers, and the handler does not run.
func TestRedisSlow(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	h := newHarnessOn(t, rdb, "slow", idempotency.Config{StoreTimeout: 200 * time.Millisecond}, created)
	admin, _ := connect.Redis(testenv.RedisURLOf(srv))
	defer admin.Close()
	const pause = 4 * time.Second
	if err := admin.Do(context.Background(), "CLIENT", "PAUSE", pause.Milliseconds(), "ALL").Err(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	r := h.post("key-acme", key1, body1)
	elapsed := time.Since(start)
	if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("slow Redis: %d %s", r.status, r.body)
	}
	if elapsed >= pause {
		t.Fatalf("503 took %v: the store timeout did not bound the wait for a paused Redis", elapsed)
	}
	if n := h.runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times with Redis paused", n)
	}
}

// TestConcurrentSameKey: 200 concurrent requests with one key and body run the handler
// exactly once; every other answer is the replay or a 409.
func TestConcurrentSameKey(t *testing.T) {
	t.Parallel()
	h := newHarness(t, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request, run int64) error {
		time.Sleep(20 * time.Millisecond) // widen the window in which the others arrive
		return created(w, r, run)
	})
	const n = 200
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		byKind  = map[string]int{}
		newBody string
		bodies  []string
	)
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			r := h.post("key-acme", key1, body1)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case r.status == http.StatusCreated && !r.replayed():
				byKind["new"]++
				newBody = r.body
			case r.status == http.StatusCreated:
				byKind["replay"]++
				bodies = append(bodies, r.body)
			case r.status == http.StatusConflict:
				byKind["409"]++
			default:
				t.Errorf("unexpected answer %d %s", r.status, r.body)
			}
		})
	}
	close(start)
	wg.Wait()
	if got := h.runs.Load(); got != 1 {
		t.Fatalf("handler ran %d times for %d concurrent requests, want 1", got, n)
	}
	if byKind["new"] != 1 || byKind["new"]+byKind["replay"]+byKind["409"] != n {
		t.Fatalf("answers %v, want one new and the rest replays or 409s", byKind)
	}
	for _, b := range bodies {
		if b != newBody {
			t.Fatalf("a replay's body %q differs from the original %q", b, newBody)
		}
	}
}

// TestLockLostCannotOverwrite: a request that overran its lock TTL cannot overwrite the
// result of a newer request that took the key after the lock expired; it is logged as
// idempotency_lock_lost, counted and reported to the hook.
func TestLockLostCannotOverwrite(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	started := make(chan struct{})
	var hooked []idempotency.LockLost
	var hookMu sync.Mutex
	// Long enough that the newer request finishes within it on a loaded machine (only
	// the first must overrun its lock), short enough to wait out.
	cfg := idempotency.Config{LockTTL: time.Second, OnLockLost: func(_ context.Context, ev idempotency.LockLost) {
		hookMu.Lock()
		hooked = append(hooked, ev)
		hookMu.Unlock()
	}}
	h := newHarness(t, cfg, func(w http.ResponseWriter, r *http.Request, run int64) error {
		if run == 1 {
			close(started)
			<-release // overrun the lock
		}
		return created(w, r, run)
	})
	slow := make(chan reply)
	go func() { slow <- h.post("key-acme", key1, body1) }()
	<-started
	recordKey := h.store.Key(h.scope("acme", key1))
	testenv.WaitFor(t, 20*time.Second, "lock expiry", func() bool {
		n, _ := h.rdb.Exists(context.Background(), recordKey).Result()
		return n == 0
	})
	newer := h.post("key-acme", key1, body1)
	if newer.status != http.StatusCreated || newer.replayed() || newer.header.Get("Location") != "/v1/things/2" {
		t.Fatalf("newer request: %d %v", newer.status, newer.header)
	}
	close(release)
	if old := <-slow; old.status != http.StatusCreated || old.header.Get("Location") != "/v1/things/1" {
		t.Fatalf("overrunning request: %d %v", old.status, old.header)
	}
	replay := h.post("key-acme", key1, body1)
	if !replay.replayed() || replay.body != newer.body {
		t.Fatalf("replay after the overrun: %q, want the newer result %q", replay.body, newer.body)
	}
	h.wantOutcomes(map[string]float64{"new": 1, "lock_lost": 1, "replayed": 1})
	hookMu.Lock()
	defer hookMu.Unlock()
	want := idempotency.LockLost{Tenant: "acme", Method: "POST", Path: path, KeyHash: h.scope("acme", key1).Hash()}
	if len(hooked) != 1 || hooked[0] != want {
		t.Fatalf("OnLockLost calls %+v, want [%+v]", hooked, want)
	}
	logs := h.logs.String()
	if !strings.Contains(logs, `"msg":"idempotency_lock_lost"`) || !strings.Contains(logs, want.KeyHash) {
		t.Fatalf("no idempotency_lock_lost log line with the key hash:\n%s", logs)
	}
	if strings.Contains(logs, key1) {
		t.Fatal("the raw key was logged")
	}
}

// TestFailuresReleaseTheKey: a 5xx, a returned error and a panic each release the key,
// and a retry then runs the handler and is stored.
func TestFailuresReleaseTheKey(t *testing.T) {
	t.Parallel()
	fail := map[string]func(w http.ResponseWriter) error{
		"5xx": func(w http.ResponseWriter) error {
			http.Error(w, "upstream down", http.StatusBadGateway)
			return nil
		},
		"error": func(w http.ResponseWriter) error {
			w.Header().Set("Location", "/v1/things/never")
			_, _ = w.Write([]byte("half a response"))
			return errors.New("database exploded")
		},
		"panic": func(w http.ResponseWriter) error { panic("boom") },
	}
	for name, f := range fail {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request, run int64) error {
				if run == 1 {
					return f(w)
				}
				return created(w, r, run)
			})
			before := panics.Load()
			first := h.post("key-acme", key1, body1)
			if first.status < 500 {
				t.Fatalf("failing run answered %d %s", first.status, first.body)
			}
			if name == "panic" && panics.Load() == before {
				t.Fatal("the panic did not propagate to the recoverer")
			}
			if name == "error" && (first.status != 500 || strings.Contains(first.body, "half") || strings.Contains(first.body, "exploded") || first.header.Get("Location") != "") {
				t.Fatalf("returned error answered %d %q, want a generic 500", first.status, first.body)
			}
			retry := h.post("key-acme", key1, body1)
			if retry.status != http.StatusCreated || retry.replayed() {
				t.Fatalf("retry after %s: %d %s, want a new run", name, retry.status, retry.body)
			}
			if got := h.runs.Load(); got != 2 {
				t.Fatalf("handler ran %d times, want 2", got)
			}
			if r := h.post("key-acme", key1, body1); !r.replayed() || r.body != retry.body {
				t.Fatalf("third request: %d %s, want the replay of the retry", r.status, r.body)
			}
			h.wantOutcomes(map[string]float64{"released_5xx": 1, "new": 1, "replayed": 1})
		})
	}
}

// TestClientDisconnectStillStores: the client goes away while the handler runs; the
// handler's result is still stored and a retry gets it without running it again.
func TestClientDisconnectStillStores(t *testing.T) {
	t.Parallel()
	started := make(chan struct{})
	finished := make(chan struct{})
	h := newHarness(t, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request, run int64) error {
		close(started)
		<-r.Context().Done() // the client has gone; the work completes anyway
		defer close(finished)
		return created(w, r, run)
	})
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan reply)
	go func() { gone <- h.postCtx(ctx, "key-acme", key1, body1) }()
	<-started
	cancel()
	if r := <-gone; r.status != -1 {
		t.Fatalf("cancelled client got %d", r.status)
	}
	<-finished
	var retry reply
	testenv.WaitFor(t, 20*time.Second, "the result being stored", func() bool {
		retry = h.post("key-acme", key1, body1)
		return retry.status != http.StatusConflict
	})
	if retry.status != http.StatusCreated || !retry.replayed() || !strings.Contains(retry.body, `"run":1`) {
		t.Fatalf("retry after disconnect: %d %s, want the replay of run 1", retry.status, retry.body)
	}
	if n := h.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// TestTenantsAreIsolated: two tenants using the same key get two runs and two results,
// and neither ever sees the other's.
func TestTenantsAreIsolated(t *testing.T) {
	t.Parallel()
	h := newHarness(t, idempotency.Config{}, func(w http.ResponseWriter, r *http.Request, run int64) error {
		tenant, _ := tenantFromBearer(r)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		return json.NewEncoder(w).Encode(map[string]any{"tenant": tenant, "run": run})
	})
	a := h.post("key-acme", key1, body1)
	// A different body as well: no 422 across tenants.
	g := h.post("key-globex", key1, `{"text":"globex's own"}`)
	if a.status != 201 || g.status != 201 || a.replayed() || g.replayed() {
		t.Fatalf("first requests: %d %d", a.status, g.status)
	}
	if !strings.Contains(a.body, `"tenant":"acme"`) || !strings.Contains(g.body, `"tenant":"globex"`) {
		t.Fatalf("bodies %s / %s", a.body, g.body)
	}
	a2 := h.post("key-acme", key1, body1)
	g2 := h.post("key-globex", key1, `{"text":"globex's own"}`)
	if !a2.replayed() || a2.body != a.body || !g2.replayed() || g2.body != g.body {
		t.Fatalf("replays crossed tenants: %s / %s", a2.body, g2.body)
	}
	if n := h.runs.Load(); n != 2 {
		t.Fatalf("handler ran %d times, want 2", n)
	}
}

// TestResultTTLExpiry: after the result TTL the key is accepted again.
func TestResultTTLExpiry(t *testing.T) {
	t.Parallel()
	// Long enough that a loaded machine reads the TTL before it ends, short enough to wait
	// out.
	const ttl = 2 * time.Second
	h := newHarness(t, idempotency.Config{ResultTTL: ttl}, created)
	if r := h.post("key-acme", key1, body1); r.status != 201 || r.replayed() {
		t.Fatalf("first: %d", r.status)
	}
	recordKey := h.store.Key(h.scope("acme", key1))
	if got, _ := h.rdb.PTTL(context.Background(), recordKey).Result(); got <= 0 || got > ttl {
		t.Fatalf("stored result has TTL %v, want (0, %v]", got, ttl)
	}
	testenv.WaitFor(t, 20*time.Second, "result expiry", func() bool {
		n, _ := h.rdb.Exists(context.Background(), recordKey).Result()
		return n == 0
	})
	if r := h.post("key-acme", key1, body1); r.status != 201 || r.replayed() || !strings.Contains(r.body, `"run":2`) {
		t.Fatalf("after expiry: %d %s, want a new run", r.status, r.body)
	}
}

// TestRoundTripsThroughMiddleware counts Redis round trips per HTTP request: an accepted
// request costs 2, a replay 1, a 409 or 422 1, a 5xx 2.
func TestRoundTripsThroughMiddleware(t *testing.T) {
	t.Parallel()
	h := newHarness(t, idempotency.Config{}, created)
	if err := h.store.Preload(context.Background()); err != nil {
		t.Fatal(err)
	}
	count := func(what string, want int64, f func()) {
		t.Helper()
		h.rt.Reset()
		f()
		if got := h.rt.Redis(); got != want {
			t.Errorf("%s: %d Redis round trips, want %d", what, got, want)
		}
	}
	count("accepted", 2, func() { h.post("key-acme", key1, body1) })
	count("replay", 1, func() { h.post("key-acme", key1, body1) })
	count("422", 1, func() { h.post("key-acme", key1, `{"x":1}`) })
	count("400 (no Redis)", 0, func() { h.post("key-acme", "short", body1) })
}

// TestLargeResponse: a response over MaxResponseBytes reaches the client whole, is
// stored without its body, and a replay sends the status and stored headers with an
// empty body.
func TestLargeResponse(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("x", 5000)
	h := newHarness(t, idempotency.Config{MaxResponseBytes: 1000}, func(w http.ResponseWriter, r *http.Request, run int64) error {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Location", "/v1/things/big")
		w.WriteHeader(http.StatusCreated)
		for i := 0; i < len(big); i += 100 {
			_, _ = w.Write([]byte(big[i : i+100]))
		}
		return nil
	})
	first := h.post("key-acme", key1, body1)
	if first.status != 201 || first.body != big {
		t.Fatalf("first response: %d, %d bytes", first.status, len(first.body))
	}
	replay := h.post("key-acme", key1, body1)
	if replay.status != 201 || !replay.replayed() || replay.body != "" || replay.header.Get("Location") != "/v1/things/big" {
		t.Fatalf("replay: %d %v %d bytes", replay.status, replay.header, len(replay.body))
	}
	if n := h.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times", n)
	}
	h.wantOutcomes(map[string]float64{"new_truncated": 1, "replayed": 1})
}

func TestNewValidatesConfig(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	store, _ := redisstore.New(rdb, redisstore.Config{Prefix: prefix})
	for name, cfg := range map[string]idempotency.Config{
		"no store":  {Tenant: tenantFromBearer},
		"no tenant": {Store: store},
		"negative":  {Store: store, Tenant: tenantFromBearer, LockTTL: -time.Second},
	} {
		if _, err := idempotency.New(cfg); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}
