package gateway_test

// Attacks on issue 16 (join in flight, derived keys, the limiter in front of the
// gateway), kept as regression tests: each states what must hold, and counts upstream
// calls and bytes. Those that say "Found" failed on the commit they name and hold
// since the fix.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// bigStream is an upstream whose first call sends one event, waits for release, then
// sends n more events of about 1 KiB each as fast as its client reads, and [DONE].
// Later calls send the whole stream at once. It counts its calls.
type bigStream struct {
	n       int
	release chan struct{}
	sent    chan struct{}
	calls   atomic.Int64
}

func newBigStream(n int) *bigStream {
	return &bigStream{n: n, release: make(chan struct{}), sent: make(chan struct{})}
}

const bigHead = "data: {\"choices\":[{\"delta\":{\"content\":\"head\"}}]}\n\n"

// bigEvent is the i-th event of a bigStream's body.
func bigEvent(i int) string {
	return fmt.Sprintf("data: {\"choices\":[{\"delta\":{\"content\":\"%04d %s\"}}]}\n\n", i%10000, strings.Repeat("x", 1000))
}

// whole is the stream a client must receive.
func (u *bigStream) whole() string {
	var b strings.Builder
	b.WriteString(bigHead)
	for i := range u.n {
		b.WriteString(bigEvent(i))
	}
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

func (u *bigStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	first := u.calls.Add(1) == 1
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, bigHead)
	http.NewResponseController(w).Flush()
	if first {
		close(u.sent)
		select {
		case <-u.release:
		case <-r.Context().Done():
			return
		}
	}
	bw := bufio.NewWriterSize(w, 64<<10)
	for i := range u.n {
		if _, err := io.WriteString(bw, bigEvent(i)); err != nil {
			return
		}
	}
	_, _ = io.WriteString(bw, "data: [DONE]\n\n")
	_ = bw.Flush()
}

// stalledClient sends a keyed streaming request over a raw connection with a 4 KiB
// receive buffer and never reads the answer, as a client that is suspended (a laptop
// lid closed, a process stopped in a debugger, a consumer stuck on its first event)
// does while its connection stays open.
func stalledClient(t *testing.T, gatewayV1, key string) net.Conn {
	t.Helper()
	host := strings.TrimPrefix(strings.TrimSuffix(gatewayV1, "/v1"), "http://")
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	req := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAuthorization: Bearer sk\r\n"+
		"Idempotency-Key: %s\r\nContent-Length: %d\r\n\r\n%s", host, key, len(streamBody), streamBody)
	if _, err := io.WriteString(conn, req); err != nil {
		t.Fatal(err)
	}
	return conn
}

// derivedPost sends p's body as an SDK does (no Idempotency-Key, X-Stainless-Retry-Count
// count), with secret in p's credential header ("" for no credential) and extra headers.
func derivedPost(url string, p protocol, count, secret string, extra http.Header) protoAnswer {
	h := http.Header{}
	if count != "" {
		h.Set("X-Stainless-Retry-Count", count)
	}
	for k, vs := range extra {
		h[k] = vs
	}
	return protoSend(url, p, false, secret, h)
}

// Derived keys never cross credentials, for every protocol and its credential header
// (Azure's api-key too): while tenant A's first attempt is in flight and after it is
// recorded, a "retry" (X-Stainless-Retry-Count >= 1) with the identical body from
// tenant B, from a request without credentials, or from A's credential plus another
// credential header is a call of its own, never A's answer; A's own retries get it.
// Holds (a regression test).
func TestAttack16DerivedRetryNeverCrossesCredentials(t *testing.T) {
	t.Parallel()
	azure := protocol{"azure chat completions", "/chat/completions", protocols[0].body,
		func(h http.Header, s string) { h.Set("Api-Key", s) }}
	for _, p := range append(slices.Clone(protocols), azure) {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{Latency: 700 * time.Millisecond, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			fl := gatewaysOn(t, fs, 2, gateway.Config{DeriveKeys: gateway.DeriveRetryCount})
			firstc := make(chan protoAnswer, 1)
			go func() { firstc <- derivedPost(fl.urls[0], p, "0", "secret-a", nil) }()
			waitUpstreamInFlight(t, fs)
			type probe struct {
				name, secret string
				extra        http.Header
			}
			strangers := []probe{{"tenant B", "secret-b", nil}, {"no credential", "", nil},
				{"A plus another credential", "secret-a", http.Header{"Authorization": {"Bearer other"}, "X-Api-Key": {"other"}}}}
			if p.name != "chat completions" && p.name != "responses" {
				strangers[2].extra = http.Header{"Authorization": {"Bearer other"}}
			}
			var mu sync.Mutex
			var inFlight []protoAnswer
			var wg sync.WaitGroup
			for i, s := range strangers {
				wg.Go(func() {
					a := derivedPost(fl.urls[i%2], p, "1", s.secret, s.extra)
					mu.Lock()
					defer mu.Unlock()
					inFlight = append(inFlight, a)
				})
			}
			mine := derivedPost(fl.urls[1], p, "1", "secret-a", nil)
			wg.Wait()
			first := <-firstc
			if first.status != 200 || mine.status != 200 || mine.joined != "true" || !bytes.Equal(mine.body, first.body) {
				t.Fatalf("A's retry while in flight: %d joined=%q; first %d", mine.status, mine.joined, first.status)
			}
			for _, a := range inFlight {
				if a.status != 200 || a.joined != "" || a.replay != "" || bytes.Equal(a.body, first.body) {
					t.Fatalf("a stranger's retry while A's call was in flight: %d joined=%q replayed=%q: got A's answer", a.status, a.joined, a.replay)
				}
			}
			for i, s := range strangers {
				a := derivedPost(fl.urls[i%2], p, "2", s.secret, s.extra)
				if a.status != 200 || a.replay == "true" && bytes.Equal(a.body, first.body) {
					t.Fatalf("%s's retry after A's call was recorded: %d replayed=%q: got A's answer", s.name, a.status, a.replay)
				}
			}
			if n := fs.Stats().Requests; n != 4 {
				t.Fatalf("%d upstream calls, want 4 (A's, and the strangers' 3 first retries; their second retries replay their own)", n)
			}
		})
	}
}

// X-Stainless-Retry-Count that is not one non-negative integer (negative, beyond int,
// a list, the header twice, empty) is not an SDK's count: the request passes through
// unrecorded and never joins or replays, even with a body a first attempt noted. A
// count with spaces or a plus sign is still a count. Holds (a regression test).
func TestAttack16SmuggledRetryCountsPassThrough(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 1, gateway.Config{DeriveKeys: gateway.DeriveRetryCount})
	p := protocols[0]
	first := derivedPost(fl.urls[0], p, "0", "secret-a", nil)
	if first.status != 200 {
		t.Fatalf("first: %+v", first)
	}
	for _, vs := range [][]string{{"-1"}, {"99999999999999999999"}, {"1, 1"}, {"1", "1"}, {""}, {"0x1"}, {"1e0"}} {
		a := derivedPost(fl.urls[0], p, "", "secret-a", http.Header{"X-Stainless-Retry-Count": vs})
		if a.status != 200 || a.replay != "" || bytes.Equal(a.body, first.body) {
			t.Fatalf("X-Stainless-Retry-Count %q: %d replayed=%q; want a pass-through call", vs, a.status, a.replay)
		}
	}
	for _, v := range []string{" 1 ", "+1", "2147483647"} {
		a := derivedPost(fl.urls[0], p, "", "secret-a", http.Header{"X-Stainless-Retry-Count": {v}})
		if a.status != 200 || a.replay != "true" || !bytes.Equal(a.body, first.body) {
			t.Fatalf("X-Stainless-Retry-Count %q: %d replayed=%q; want the first attempt's answer", v, a.status, a.replay)
		}
	}
	var rows int
	if err := fl.pool.QueryRow(context.Background(), `SELECT count(*) FROM llm_calls`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if n := fs.Stats().Requests; n != 8 || rows != 1 {
		t.Fatalf("%d upstream calls and %d recorded calls, want 8 (the first and 7 pass-throughs) and 1", n, rows)
	}
}

// Redis down with the limiter on (a tenant cap needs Redis for every call): keyed,
// keyless and derived calls get 503 limiter_unavailable with retry-after-ms at once,
// nothing goes upstream, and nothing is left stuck: once Redis is back the same key
// makes its call (the refused attempt freed the row) and the next calls go through.
// Holds (a regression test).
func TestAttack16RedisDownFailsClosedAndLeavesNothingStuck(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	opt, err := redis.ParseURL(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	lim, err := limiter.New(rdb, limiter.Config{Prefix: "a16", Provider: "openai", TenantConcurrency: 4, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	fl := gatewaysOn(t, fs, 1, gateway.Config{Limiter: lim, DeriveKeys: gateway.DeriveRetryCount})
	calls := []http.Header{
		{"Idempotency-Key": {"redis-down-key-000001"}},
		{},
		{"X-Stainless-Retry-Count": {"0"}},
	}
	srv.Stop()
	for _, h := range calls {
		h.Set("Authorization", "Bearer sk-a")
		start := time.Now()
		req, _ := http.NewRequest(http.MethodPost, fl.urls[0]+"/chat/completions", strings.NewReader(chatBody))
		req.Header = h.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("retry-after-ms") == "" || !strings.Contains(string(b), "limiter_unavailable") ||
			time.Since(start) > 3*time.Second {
			t.Fatalf("%v with Redis down: %d %v %s after %v; want 503 limiter_unavailable with retry-after-ms, at once", h, resp.StatusCode, resp.Header, b, time.Since(start))
		}
	}
	if n := fs.Stats().Requests; n != 0 {
		t.Fatalf("%d upstream calls with Redis down, want 0", n)
	}
	srv.Start()
	for _, h := range calls {
		code, replayed, b := rawPost(t, fl.urls[0]+"/chat/completions", chatBody, h)
		if code != http.StatusOK || replayed != "" {
			t.Fatalf("%v once Redis is back: %d replayed=%q %s", h, code, replayed, b)
		}
	}
	if n := fs.Stats().Requests; n != 3 {
		t.Fatalf("%d upstream calls once Redis is back, want 3", n)
	}
}

// A joiner whose client stopped reading (on the owner's process and on another) holds
// back neither the owner nor the other joiners: they get the whole stream in time, and
// the answer is recorded, from one upstream call. Holds (a regression test).
func TestAttack16StalledJoinerHoldsBackNobody(t *testing.T) {
	t.Parallel()
	up := newBigStream(3 << 10)
	fl := gatewaysOn(t, up, 2, gateway.Config{Timeout: 15 * time.Second,
		Ledger: ledger.Config{StreamFlushBytes: 64 << 20}})
	key := "stalled-joiner-key-0001"
	owner := openStream(t, fl.urls[0], key)
	<-up.sent
	stalledClient(t, fl.urls[0], key)
	stalledClient(t, fl.urls[1], key)
	fl.waitJoining(t, 0, 1)
	fl.waitJoining(t, 1, 1)
	joiner := openStream(t, fl.urls[0], key)
	close(up.release)
	want := up.whole()
	done := make(chan error, 2)
	for _, r := range []*http.Response{owner, joiner} {
		go func() {
			b, err := io.ReadAll(r.Body)
			if err == nil && string(b) != want {
				err = fmt.Errorf("%d bytes, want %d", len(b), len(want))
			}
			done <- err
		}()
	}
	for range 2 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(8 * time.Second):
			t.Fatal("a stalled joiner held back the owner or another joiner")
		}
	}
	_, replay, err := streamPost(t, fl.urls[1], key)
	if err != nil || replay != want {
		t.Fatalf("replay: %d bytes %v", len(replay), err)
	}
	if c := up.calls.Load(); c != 1 {
		t.Fatalf("%d upstream calls, want 1", c)
	}
}

// A request that reuses a key in flight with another body (or on another path) gets
// 422 with x-should-retry: false on the owner's process and on another, never joins
// the call and makes none; the call's own answer is unaffected. Holds (a regression
// test).
func TestAttack16KeyReuseWhileInFlightIs422(t *testing.T) {
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

// While tenant A's keyed call is in flight, the same Idempotency-Key and body under
// another credential (B, none, or A's plus another credential header), for every
// protocol, is a call of its own on either process: it never joins A's call. Holds (a
// regression test).
func TestAttack16KeyedJoinNeverCrossesCredentials(t *testing.T) {
	t.Parallel()
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{Latency: 700 * time.Millisecond, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			fl := gatewaysOn(t, fs, 2, gateway.Config{})
			key := "cross-credential-join-" + strings.ReplaceAll(p.name, " ", "-")
			firstc := make(chan protoAnswer, 1)
			go func() { firstc <- protoPost(fl.urls[0], p, false, key, "secret-a") }()
			waitUpstreamInFlight(t, fs)
			strangers := []func(h http.Header){
				func(h http.Header) { p.cred(h, "secret-b") },
				func(h http.Header) {},
				func(h http.Header) { p.cred(h, "secret-a"); h.Add("Api-Key", "other") },
			}
			answers := make([]protoAnswer, 2*len(strangers))
			var wg sync.WaitGroup
			for i := range answers {
				wg.Go(func() {
					req, _ := http.NewRequest(http.MethodPost, fl.urls[i%2]+p.path, strings.NewReader(strings.Replace(p.body, "%s", "", 1)))
					req.Header.Set("Idempotency-Key", key)
					strangers[i/2](req.Header)
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						answers[i] = protoAnswer{err: err}
						return
					}
					defer resp.Body.Close()
					b, err := io.ReadAll(resp.Body)
					answers[i] = protoAnswer{resp.StatusCode, resp.Header.Get("Onceflow-Joined"), resp.Header.Get("Idempotent-Replayed"), "", b, err}
				})
			}
			wg.Wait()
			first := <-firstc
			if first.status != 200 {
				t.Fatalf("first: %+v", first)
			}
			// Two requests of one stranger share the stranger's own call (one joins
			// the other); none may get A's answer.
			for i, a := range answers {
				if a.err != nil || a.status != 200 || bytes.Equal(a.body, first.body) {
					t.Fatalf("stranger %d (gateway %d): %d joined=%q replayed=%q err=%v: want a call of its own, not A's answer", i/2, i%2, a.status, a.joined, a.replay, a.err)
				}
			}
			if n := fs.Stats().Requests; n != 1+int64(len(strangers)) {
				t.Fatalf("%d upstream calls, want %d (A's and one per stranger)", n, 1+len(strangers))
			}
		})
	}
}

// Bodies over ONCEFLOW_GATEWAY_MAX_BODY sent without a Content-Length (chunked) on the
// join path (the key in flight) and on the derive path get 413 with x-should-retry:
// false; they neither disturb the call in flight nor note a derived key nor call the
// upstream. Holds (a regression test).
func TestAttack16OversizedBodiesOnTheJoinAndDerivePaths(t *testing.T) {
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
// Holds (a regression test).
func TestAttack16NoCredentialInLogsOrTables(t *testing.T) {
	t.Parallel()
	const secret = "sk-live-attack16-0123456789abcdef"
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
	time.Sleep(100 * time.Millisecond)
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

// A client that opened a stream and stopped reading (its connection still open) must
// not hold back the call that every other request for its key follows: a joiner on
// this process and one on another each get the whole stream, with one upstream call.
// Found on 2b9177d: the owner's loop wrote each chunk to its own client before reading
// the next from the upstream, so the call stalled for every joiner and nothing was
// recorded.
func TestAttack16StalledOwnerClientHoldsBackEveryJoiner(t *testing.T) {
	t.Parallel()
	for _, other := range []bool{false, true} {
		t.Run(fmt.Sprintf("joiner on other process=%v", other), func(t *testing.T) {
			t.Parallel()
			up := newBigStream(3 << 10) // about 3 MiB, beyond the socket buffers
			// Partials flushed on the timer only: PostgreSQL is not what holds the
			// stream back here (TestAttack16LargeStreamIsNotSlowedByItsPartials).
			fl := gatewaysOn(t, up, 2, gateway.Config{Timeout: 15 * time.Second,
				Ledger: ledger.Config{StreamFlushBytes: 64 << 20}})
			key := fmt.Sprintf("stalled-owner-%v-0001", other)
			stalledClient(t, fl.urls[0], key)
			<-up.sent
			url := fl.urls[0]
			if other {
				url = fl.urls[1]
			}
			joiner := openStream(t, url, key)
			if joiner.Header.Get("Onceflow-Joined") != "true" {
				t.Fatalf("the second request did not join: %d %v", joiner.StatusCode, joiner.Header)
			}
			close(up.release)
			type read struct {
				b   []byte
				err error
			}
			got := make(chan read, 1)
			var n atomic.Int64
			go func() {
				var b strings.Builder
				buf := make([]byte, 64<<10)
				for {
					k, err := joiner.Body.Read(buf)
					b.Write(buf[:k])
					n.Add(int64(k))
					if err == io.EOF {
						got <- read{b: []byte(b.String())}
						return
					}
					if err != nil {
						got <- read{b: []byte(b.String()), err: err}
						return
					}
				}
			}()
			want := up.whole()
			select {
			case r := <-got:
				if r.err != nil || string(r.b) != want {
					t.Fatalf("joiner: %d bytes, err %v; want the whole stream (%d bytes)", len(r.b), r.err, len(want))
				}
			case <-time.After(8 * time.Second):
				t.Fatalf("the joiner got %d of the stream's %d bytes in 8 s: a client that stopped reading holds back the call every joiner follows",
					n.Load(), len(want))
			}
			if c := up.calls.Load(); c != 1 {
				t.Fatalf("%d upstream calls, want 1", c)
			}
		})
	}
}

// A long generation streams megabytes (an OpenAI chunk is about 200 bytes a token: 16k
// output tokens are over 3 MiB). A 6 MiB stream that the upstream sends in
// milliseconds passes through the gateway within 6 s more than directly (about 3 s
// under -race). Found on 2b9177d: every partial write (`partial = partial || $4`, each
// rewriting the whole value) ran inline in the loop reading the upstream, so a
// stream's cost grew with the square of its size (1 MiB 0.8 s, 4 MiB 9 s, 12 MiB 48 s).
// Not parallel: it measures time.
func TestAttack16LargeStreamIsNotSlowedByItsPartials(t *testing.T) {
	up := newBigStream(6 << 10)
	close(up.release)
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	start := time.Now()
	req, _ := http.NewRequest(http.MethodPost, ups.URL+"/v1/chat/completions", strings.NewReader(streamBody))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	direct, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	directTook := time.Since(start)
	if err != nil || string(direct) != up.whole() {
		t.Fatalf("direct: %d bytes %v", len(direct), err)
	}
	fl := gatewaysOn(t, up, 1, gateway.Config{Timeout: 30 * time.Second})
	start = time.Now()
	_, body, err := streamPost(t, fl.urls[0], "large-stream-key-00001")
	took := time.Since(start)
	if err != nil || body != up.whole() {
		t.Fatalf("through the gateway: %d bytes %v", len(body), err)
	}
	t.Logf("%d bytes: direct %v, through the gateway %v", len(body), directTook, took)
	if took > directTook+6*time.Second {
		t.Fatalf("a %d-byte stream took %v through the gateway, %v directly: its partial writes rewrite the whole partial each time",
			len(body), took.Round(time.Millisecond), directTook.Round(time.Millisecond))
	}
}

// peakHeap samples the heap in use until stop is closed and returns the largest value.
func peakHeap(stop <-chan struct{}) <-chan uint64 {
	out := make(chan uint64, 1)
	go func() {
		var peak uint64
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			peak = max(peak, m.HeapInuse)
			select {
			case <-stop:
				out <- peak
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	return out
}

// joinedStreamPeak runs one stream of up with n joiners on the owner's process, every
// client reading as fast as it can, and returns the peak heap in use above the heap
// before the call.
func joinedStreamPeak(t *testing.T, n int) uint64 {
	up := newBigStream(4 << 10) // about 4 MiB
	fl := gatewaysOn(t, up, 1, gateway.Config{Timeout: 30 * time.Second,
		Ledger: ledger.Config{StreamFlushBytes: 64 << 20}}) // PostgreSQL is not what this measures
	key := fmt.Sprintf("joiner-memory-%03d-0001", n)
	owner := openStream(t, fl.urls[0], key)
	<-up.sent
	joiners := make([]*http.Response, n)
	for i := range joiners {
		joiners[i] = openStream(t, fl.urls[0], key)
	}
	fl.waitJoining(t, 0, n)
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	base := m.HeapInuse
	stop := make(chan struct{})
	peak := peakHeap(stop)
	close(up.release)
	want := up.whole()
	var wg sync.WaitGroup
	for _, r := range append(joiners, owner) {
		wg.Go(func() {
			n, err := io.Copy(io.Discard, r.Body)
			if err != nil || n != int64(len(want)) {
				t.Errorf("a client got %d bytes (%v), want %d", n, err, len(want))
			}
		})
	}
	wg.Wait()
	close(stop)
	if c := up.calls.Load(); c != 1 {
		t.Fatalf("%d upstream calls, want 1", c)
	}
	return max(<-peak, base) - base
}

// Following a stream costs a joiner a counter, not a copy of the stream: 15 more
// joiners of a 4 MiB stream cost less than two streams' size of heap in all. Found on
// 2b9177d: each joiner kept every byte it passed on (joiner.sent), so memory grew with
// joiners × stream size (15 more joiners: 130 MiB).
func TestAttack16JoinersDoNotEachCopyTheStream(t *testing.T) {
	// Not parallel: the heap is the process's. Frequent collections keep garbage out
	// of the measure.
	defer debug.SetGCPercent(debug.SetGCPercent(20))
	one := joinedStreamPeak(t, 1)
	many := joinedStreamPeak(t, 16)
	const size = 4 << 20
	t.Logf("peak heap above the start: 1 joiner %d MiB, 16 joiners %d MiB (the stream: %d MiB)", one>>20, many>>20, size>>20)
	if many > one+2*size {
		t.Fatalf("15 more joiners of an %d MiB stream cost %d MiB more heap: each joiner keeps a copy of the stream",
			size>>20, (many-one)>>20)
	}
}

// privateFleet is two gateways, each with a pool of its own (as two processes have),
// on a PostgreSQL of the test's own that the test can restart.
func privateFleet(t *testing.T, up http.Handler, cfg gateway.Config) (*testenv.Server, []string) {
	t.Helper()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pg, dsn, _ := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	var urls []string
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		pool, err := connect.Postgres(ctx, dsn, nil)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		c := cfg
		c.Upstream, c.DB, c.Logger = ups.URL+"/v1", pool, testenv.Logger(t)
		g, err := gateway.New(c)
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		urls = append(urls, gs.URL+"/v1")
	}
	return pg, urls
}

// PostgreSQL restarts (a failover, a minor-version upgrade, a crash) while a stream is
// joined from another gateway process: the joiner, which already passes the stream on,
// rides out the outage and ends with the whole stream, as the owner's client does; one
// upstream call. Found on 2b9177d: the joiner was cut at its first failed poll, and the
// official SDKs do not retry a stream cut after its headers.
func TestAttack16JoinerRidesOutAPostgresRestart(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	pg, urls := privateFleet(t, up, gateway.Config{Timeout: 30 * time.Second})
	key := "pg-restart-joiner-0001"
	owner := openStream(t, urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 2); got != gatedHead {
		t.Fatalf("owner's head: %q", got)
	}
	<-up.sent
	joiner := openStream(t, urls[1], key)
	if joiner.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("did not join: %d %v", joiner.StatusCode, joiner.Header)
	}
	jr := bufio.NewReader(joiner.Body)
	if got := readEvents(t, jr, 2); got != gatedHead {
		t.Fatalf("joiner's head: %q", got)
	}
	start := time.Now()
	pg.Stop()
	time.Sleep(500 * time.Millisecond) // a few of the joiner's polls
	pg.Start()
	t.Logf("PostgreSQL was down for %v", time.Since(start).Round(time.Millisecond))
	close(up.release)
	rest, err := io.ReadAll(or)
	if err != nil || string(rest) != gatedTail {
		t.Fatalf("owner's tail: %q %v", rest, err)
	}
	jrest, err := io.ReadAll(jr)
	if err != nil || string(jrest) != gatedTail {
		t.Fatalf("joiner's tail: %q, %v: a joiner passing a live stream on was cut by a PostgreSQL restart although the call completed", jrest, err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// limitedFleet is one gateway (gc) in front of fake-llm (latency d) with a limiter of
// lc on the shared Redis.
func limitedFleet(t *testing.T, d time.Duration, lc limiter.Config, gc gateway.Config) (*fakeserver.Server, *fleet) {
	t.Helper()
	fs, err := fakeserver.New(fakeserver.Config{Latency: d, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	rdb, prefix := testenv.Redis(t)
	lc.Prefix, lc.Provider, lc.Logger = prefix, "openai", testenv.Logger(t)
	lim, err := limiter.New(rdb, lc)
	if err != nil {
		t.Fatal(err)
	}
	gc.Limiter = lim
	return fs, gatewaysOn(t, fs, 1, gc)
}

// ONCEFLOW_TENANT_CONCURRENCY caps each caller: with a cap of one call in flight, a
// second call with the same Authorization is put off (429), whatever other credential
// headers it carries. Found on 2b9177d: the tenant was the credential scope (every
// credential header), so adding a header the upstream ignores (api-key: x) made a new
// tenant, and the cap (and the daily budget) was one header away.
func TestAttack16TenantCapIsNotOneHeaderAway(t *testing.T) {
	t.Parallel()
	fs, fl := limitedFleet(t, 1500*time.Millisecond, limiter.Config{TenantConcurrency: 1, MaxWait: 50 * time.Millisecond}, gateway.Config{})
	sendBody := func(extra http.Header) (int, string) {
		h := http.Header{"Authorization": {"Bearer sk-team-a"}}
		for k, vs := range extra {
			h[k] = vs
		}
		code, _, b := rawPost(t, fl.urls[0]+"/chat/completions", chatBody, h)
		return code, string(b)
	}
	send := func(extra http.Header) int { code, _ := sendBody(extra); return code }
	// The limiter's first call to a model is a probe that the next calls wait for:
	// one call first, so that the 429s below are the cap's.
	if code := send(http.Header{"Authorization": {"Bearer sk-warm-up"}}); code != http.StatusOK {
		t.Fatalf("warm-up call: %d", code)
	}
	first := make(chan int, 1)
	go func() { first <- send(nil) }()
	waitUpstreamInFlight(t, fs)
	// The cap holds for the same headers...
	if code, b := sendBody(nil); code != http.StatusTooManyRequests || !strings.Contains(b, "ONCEFLOW_TENANT_CONCURRENCY") {
		t.Fatalf("a second call with the same credential: %d %s, want the limiter's 429 for the tenant's concurrency", code, b)
	}
	// ...and must for the same credential with a header the upstream ignores.
	for _, extra := range []http.Header{{"Api-Key": {"x"}}, {"X-Api-Key": {"1"}}} {
		if code, b := sendBody(extra); code != http.StatusTooManyRequests || !strings.Contains(b, "ONCEFLOW_TENANT_CONCURRENCY") {
			t.Errorf("the same Authorization with %v: %d %s, want the cap's 429: a caller escapes its cap with a header the upstream ignores", extra, code, b)
		}
	}
	if code := <-first; code != http.StatusOK {
		t.Fatalf("first call: %d", code)
	}
	if n := fs.Stats().Requests; n != 2 {
		t.Errorf("%d upstream calls (the warm-up and one for a credential capped at one in flight), want 2", n)
	}
}

// With ONCEFLOW_GATEWAY_DERIVE_KEYS=retry-count every first attempt of an SDK call
// notes a row in gateway_derived_keys, and Run purges the notes older than the window:
// three minutes of Run (on a fake clock) purge 5000 notes a day old. Found on 2b9177d:
// one statement of at most 1000 rows a minute, so a gateway seeing more than 17 first
// attempts a second grew the table without bound.
func TestAttack16DerivedKeyPurgeKeepsUp(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO gateway_derived_keys (fingerprint, idem_key, seen_at)
		SELECT 'fp-' || i, 'gwd-' || i, now() - interval '1 day' FROM generate_series(1, 5000) i`); err != nil {
		t.Fatal(err)
	}
	synctest.Test(t, func(t *testing.T) {
		g, err := gateway.New(gateway.Config{Upstream: "http://127.0.0.1:1/v1", DB: pool, DeriveKeys: gateway.DeriveRetryCount,
			Ledger: ledger.Config{PurgeInterval: time.Hour}, Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- g.Run(rctx) }()
		time.Sleep(3*time.Minute + time.Second)
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM gateway_derived_keys`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Fatalf("%d of 5000 expired derived-key notes left after three minutes of Run: the purge deletes at most 1000 a minute", left)
	}
}

// A call that carries a credential but not the limiter's tenant header is still a
// caller's: two concurrent calls with the same credential, under a cap of one, get one
// 429, whether the credential is Azure's api-key or an Anthropic x-api-key under a
// tenant header of Authorization, or an Entra token in Authorization under a tenant
// header of api-key (upstreams commonly take more than one header). Found on 8befa99
// (fixed by aae4368): a request without the tenant header was nobody's tenant, neither
// capped nor budgeted, so a caller escaped its cap by sending its credential in another
// header.
func TestAttack16TenantCapHoldsWithoutTheTenantHeader(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, tenantHeader string
		cred               http.Header
	}{
		{"azure api-key, tenant header Authorization", "", http.Header{"Api-Key": {"azure-key-a"}}},
		{"azure Entra token, tenant header api-key", "Api-Key", http.Header{"Authorization": {"Bearer entra-token-a"}}},
		{"anthropic x-api-key, tenant header Authorization", "", http.Header{"X-Api-Key": {"sk-ant-a"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			fs, fl := limitedFleet(t, 1500*time.Millisecond, limiter.Config{TenantConcurrency: 1, MaxWait: 50 * time.Millisecond},
				gateway.Config{TenantHeader: c.tenantHeader})
			// The limiter's first call to a model is a probe that the next calls wait
			// for: one call first, so that a 429 below is the cap's.
			if code, _, b := rawPost(t, fl.urls[0]+"/chat/completions", chatBody, http.Header{"Authorization": {"Bearer warm-up"}}); code != http.StatusOK {
				t.Fatalf("warm-up call: %d %s", code, b)
			}
			first := make(chan int, 1)
			go func() {
				code, _, _ := rawPost(t, fl.urls[0]+"/chat/completions", chatBody, c.cred.Clone())
				first <- code
			}()
			waitUpstreamInFlight(t, fs)
			code, _, b := rawPost(t, fl.urls[0]+"/chat/completions", chatBody, c.cred.Clone())
			if code != http.StatusTooManyRequests || !strings.Contains(string(b), "ONCEFLOW_TENANT_CONCURRENCY") {
				t.Errorf("a second call with the same credential under a cap of one: %d %s, want the cap's 429: without the tenant header a caller is uncapped", code, b)
			}
			if code := <-first; code != http.StatusOK {
				t.Fatalf("first call: %d", code)
			}
			if n := fs.Stats().Requests; n != 2 {
				t.Errorf("%d upstream calls (the warm-up and one for a credential capped at one in flight), want 2", n)
			}
		})
	}
}
