package gateway_test

import (
	"bufio"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// With the limiter on, the gateway keeps its callers, keyed or not, under the
// provider's requests per minute: the calls beyond it get the gateway's own 429 with
// Retry-After and retry-after-ms (so the SDKs wait that long), and the provider never
// answers 429. Without it, the same burst meets the provider's 429s.
func TestLimiterKeepsGatewayTrafficUnderTheProvidersLimit(t *testing.T) {
	t.Parallel()
	const rpm = 20
	for _, on := range []bool{true, false} {
		t.Run("limiter="+strconv.FormatBool(on), func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{RPM: rpm, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			var cfg gateway.Config
			if on {
				rdb, prefix := testenv.Redis(t)
				lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, Provider: "openai", Limits: limiter.Limits{RPM: rpm},
					MaxWait: 50 * time.Millisecond, Logger: testenv.Logger(t)})
				if err != nil {
					t.Fatal(err)
				}
				cfg.Limiter = lim
			}
			fl := gatewaysOn(t, fs, 2, cfg)
			var mu sync.Mutex
			codes := map[int]int{}
			var wg sync.WaitGroup
			for i := range 2 * rpm {
				wg.Go(func() {
					key := ""
					if i%2 == 0 {
						key = "limited-key-" + strconv.Itoa(i) + "-0000000"
					}
					r, b := post(t, fl.urls[i%2]+"/chat/completions", key, "Bearer sk-"+strconv.Itoa(i%3), chatBody)
					mu.Lock()
					defer mu.Unlock()
					codes[r.StatusCode]++
					if r.StatusCode == http.StatusTooManyRequests && on {
						eb, _ := llm.ParseErrorBody(b)
						ms, err := strconv.Atoi(r.Header.Get("retry-after-ms"))
						if eb.Code != "rate_limit_exceeded" || err != nil || ms <= 0 || r.Header.Get("Retry-After") == "" {
							t.Errorf("the limiter's 429: %v %s", r.Header, b)
						}
					}
				})
			}
			wg.Wait()
			st := fs.Stats()
			t.Logf("limiter %v: answers %v; upstream requests %d, by status %v", on, codes, st.Requests, st.ByStatus)
			if on {
				if st.ByStatus["429"] != 0 || codes[200] != rpm || codes[429] != rpm {
					t.Fatalf("with the limiter: upstream 429s %d, answers %v; want %d 200s, %d 429s from the gateway, none from the provider",
						st.ByStatus["429"], codes, rpm, rpm)
				}
				return
			}
			if st.ByStatus["429"] == 0 {
				t.Fatalf("without the limiter the burst met no provider 429 (%v): the test proves nothing", st.ByStatus)
			}
		})
	}
}

// Redis down with the limiter on (a tenant cap needs Redis for every call): keyed,
// keyless and derived calls get 503 limiter_unavailable with retry-after-ms at once,
// nothing goes upstream, and nothing is left stuck: once Redis is back the same key
// makes its call (the refused attempt freed the row) and the next calls go through.
// "At once" is against the limiter's admission wait, set long here (30 s): a call that
// waited for it would take longer than the test's 10 s bound, which leaves room for a
// loaded machine.
func TestLimiterRedisDownFailsClosedAndLeavesNothingStuck(t *testing.T) {
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
	lim, err := limiter.New(rdb, limiter.Config{Prefix: "a16", Provider: "openai", TenantConcurrency: 4, MaxWait: 30 * time.Second, Logger: testenv.Logger(t)})
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
			time.Since(start) > 10*time.Second {
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

// ONCEFLOW_TENANT_CONCURRENCY caps each caller, whatever headers it sends.
func TestTenantCap(t *testing.T) {
	t.Parallel()
	// ONCEFLOW_TENANT_CONCURRENCY caps each caller: with a cap of one call in flight, a
	// second call with the same Authorization is put off (429), whatever other credential
	// headers it carries.
	t.Run("is not one credential header away", func(t *testing.T) {
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
	})
	// A call that carries a credential but not the limiter's tenant header is still a
	// caller's: two concurrent calls with the same credential, under a cap of one, get one
	// 429, whether the credential is Azure's api-key or an Anthropic x-api-key under a
	// tenant header of Authorization, or an Entra token in Authorization under a tenant
	// header of api-key (upstreams commonly take more than one header).
	t.Run("holds without the tenant header", func(t *testing.T) {
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
	})
}

// The limiter's permit of a stream is settled when the upstream's part ends, not when
// the record commits after the handler returned: under a tenant cap of one call in
// flight, the tenant's next call goes at once while the first one's record waits.
func TestStreamPermitIsFreeBeforeTheRecordCommits(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, Provider: "openai", Logger: testenv.Logger(t),
		TenantConcurrency: 1, MaxWait: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	up := newGatedStream()
	fl := gatewaysOn(t, up, 1, gateway.Config{Limiter: lim, Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "permit-before-record"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, fl.urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 2); got != gatedHead {
		t.Fatalf("head: %q (status %d)", got, owner.StatusCode)
	}
	<-up.sent
	waitRow(t, fl.pool, row, "the stream's announcement", announced)
	release := holdRecord(t, fl.pool, row)
	close(up.release)
	if tail, err := readAllWithin(or, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("tail: %q %v", tail, err)
	}
	r, body, err := streamPost(t, fl.urls[0], "permit-before-record-2")
	if r.StatusCode != http.StatusOK || err != nil || body != gatedHead+gatedTail {
		t.Fatalf("the tenant's next call while the first one's record waits: %d %v %q (the permit is held by the background record)", r.StatusCode, err, body)
	}
	release()
	waitRow(t, fl.pool, row, "the record", func(r *ledger.Row) bool { return r.State == ledger.StateSucceeded })
	r, body, err = streamPost(t, fl.urls[0], "permit-before-record-3")
	if r.StatusCode != http.StatusOK || err != nil || body != gatedHead+gatedTail {
		t.Fatalf("a call after the record: %d %v %q", r.StatusCode, err, body)
	}
	if n := up.Calls(); n != 3 {
		t.Fatalf("%d upstream calls, want 3", n)
	}
}
