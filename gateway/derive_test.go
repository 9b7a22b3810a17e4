package gateway_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// sdkPost sends a request without Idempotency-Key as the official SDKs do, with
// X-Stainless-Retry-Count count ("" for none), giving up after timeout.
func sdkPost(t *testing.T, url, auth, count, body string, timeout time.Duration) (int, []byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", auth)
	if count != "" {
		req.Header.Set("X-Stainless-Retry-Count", count)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// With ONCEFLOW_GATEWAY_DERIVE_KEYS=retry-count, an SDK's automatic retry of a request
// without a key (X-Stainless-Retry-Count: 1) is answered from its first attempt's call,
// on any gateway process: joined while it runs, replayed after. A new first attempt
// with the same body is a new call; so is a retry with other credentials, and every
// request of a client that does not number its attempts.
func TestDerivedKeysAnswerAnSDKRetryFromTheFirstAttempt(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Latency: 800 * time.Millisecond, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 2, gateway.Config{DeriveKeys: gateway.DeriveRetryCount})
	// The first attempt times out at the client; the SDK retries on the other process.
	if _, _, err := sdkPost(t, fl.urls[0], "Bearer sk-a", "0", chatBody, 200*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the first attempt did not time out: %v", err)
	}
	code, retried, err := sdkPost(t, fl.urls[1], "Bearer sk-a", "1", chatBody, 10*time.Second)
	if err != nil || code != 200 {
		t.Fatalf("retry: %d %s %v", code, retried, err)
	}
	if n := fs.Stats().Requests; n != 1 {
		t.Fatalf("%d upstream requests for one request and its retry, want 1", n)
	}
	code, again, err := sdkPost(t, fl.urls[0], "Bearer sk-a", "2", chatBody, 10*time.Second)
	if err != nil || code != 200 || !bytes.Equal(again, retried) {
		t.Fatalf("second retry: %d %s %v; want the first answer replayed", code, again, err)
	}
	// Not retries of it: a new first attempt, other credentials, no count, a bad count.
	for _, c := range []struct{ auth, count string }{{"Bearer sk-a", "0"}, {"Bearer sk-b", "1"}, {"Bearer sk-a", ""}, {"Bearer sk-a", "x"}} {
		code, b, err := sdkPost(t, fl.urls[0], c.auth, c.count, chatBody, 10*time.Second)
		if err != nil || code != 200 || bytes.Equal(b, retried) {
			t.Fatalf("%+v: %d %s %v; want a new call", c, code, b, err)
		}
	}
	if n := fs.Stats().Requests; n != 5 {
		t.Fatalf("%d upstream requests, want 5 (one per request that is not a retry)", n)
	}
	// A minute after its answer a note is no longer offered: an SDK retries within
	// seconds, so this is the retry of a later identical request whose first attempt
	// never reached the gateway, and it gets a call of its own.
	if _, err := fl.pool.Exec(context.Background(), `UPDATE llm_calls SET updated_at = now() - interval '61 seconds' WHERE state = 'succeeded'`); err != nil {
		t.Fatal(err)
	}
	code, late, err := sdkPost(t, fl.urls[1], "Bearer sk-a", "1", chatBody, 10*time.Second)
	if err != nil || code != 200 || bytes.Equal(late, retried) {
		t.Fatalf("a retry a minute after the answer: %d %s %v; want a new call", code, late, err)
	}
	if n := fs.Stats().Requests; n != 6 {
		t.Fatalf("%d upstream requests, want 6", n)
	}
}

// Without the option, X-Stainless-Retry-Count changes nothing: every request without a
// key is passed through.
func TestWithoutDerivedKeysRetriesPassThrough(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 1, gateway.Config{})
	for _, count := range []string{"0", "1"} {
		if code, b, err := sdkPost(t, fl.urls[0], "Bearer sk-a", count, chatBody, 10*time.Second); err != nil || code != 200 {
			t.Fatalf("%d %s %v", code, b, err)
		}
	}
	if n := fs.Stats().Requests; n != 2 {
		t.Fatalf("%d upstream requests, want 2", n)
	}
}

// A derived first attempt costs one PostgreSQL round trip more than a keyed request
// (the note), and a derived retry answered by a replay one more than a keyed replay
// (finding the note), as docs/providers.md says.
func TestDerivedKeysCostOneRoundTripMore(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ups := httptest.NewServer(fs)
	t.Cleanup(func() { fs.Close(); ups.Close() })
	_, dsn := testenv.Postgres(t)
	var rt roundtrip.Counter
	// One connection, warmed up below, so that statement preparation is not counted.
	pool, err := connect.Postgres(context.Background(), dsn+"&pool_max_conns=1", &rt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: pool, DeriveKeys: gateway.DeriveRetryCount, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	url := gs.URL + "/v1"
	body := func(i int) string { return strings.Replace(chatBody, "random word", "random word "+strconv.Itoa(i), 1) }
	count := func(send func()) int64 {
		rt.Reset()
		send()
		return rt.Postgres()
	}
	keyed := func(i int) func() {
		return func() {
			if r, b := post(t, url+"/chat/completions", "round-trip-key-"+strconv.Itoa(i)+"-000000", "Bearer sk", body(i)); r.StatusCode != 200 {
				t.Fatalf("keyed: %d %s", r.StatusCode, b)
			}
		}
	}
	derived := func(i int, n string) func() {
		return func() {
			if code, b, err := sdkPost(t, url, "Bearer sk", n, body(i), 10*time.Second); err != nil || code != 200 {
				t.Fatalf("derived %s: %d %s %v", n, code, b, err)
			}
		}
	}
	for i := range 2 { // warm-up: every statement prepared
		count(keyed(i))
		count(keyed(i))
		count(derived(10+i, "0"))
		count(derived(10+i, "1"))
	}
	keyedFirst, keyedReplay := count(keyed(2)), count(keyed(2))
	derivedFirst, derivedRetry := count(derived(12, "0")), count(derived(12, "1"))
	t.Logf("round trips: keyed %d, replayed %d; derived %d, retry replayed %d", keyedFirst, keyedReplay, derivedFirst, derivedRetry)
	if derivedFirst != keyedFirst+1 || derivedRetry != keyedReplay+1 {
		t.Fatalf("derived first attempt %d and retry %d round trips; want %d and %d (a keyed request's and a keyed replay's, plus one)",
			derivedFirst, derivedRetry, keyedFirst+1, keyedReplay+1)
	}
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
func TestDerivedRetryNeverCrossesCredentials(t *testing.T) {
	t.Parallel()
	azure := protocol{"azure chat completions", "/chat/completions", protocols[0].body,
		func(h http.Header, s string) { h.Set("Api-Key", s) }}
	for _, p := range append(slices.Clone(protocols), azure) {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			// Long enough that the retries below reach the gateways while A's first
			// attempt is still in flight, on a loaded machine too.
			fs, err := fakeserver.New(fakeserver.Config{Latency: 2 * time.Second, Logger: testenv.Logger(t)})
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

// X-Stainless-Retry-Count that is not one non-negative integer (negative, beyond int, a
// list, the header twice, empty) is not an SDK's count: the request passes through
// unrecorded and never joins or replays, even with a body a first attempt noted. A
// count with spaces or a plus sign is still a count.
func TestMalformedRetryCountsPassThrough(t *testing.T) {
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

// With ONCEFLOW_GATEWAY_DERIVE_KEYS=retry-count every first attempt of an SDK call
// notes a row in gateway_derived_keys, and Run purges the notes older than the window:
// three minutes of Run (on a fake clock) purge 5000 notes a day old.
func TestDerivedKeyPurgeKeepsUp(t *testing.T) {
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
