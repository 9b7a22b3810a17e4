package idempotency_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// TestHelperServer is not a test: it is the server process TestCrashMidHandler starts
// (this test binary, re-executed with IDEM_HELPER=1) and kills. Its handler counts its
// effect in Redis, then hangs when asked to, like a process that dies after doing the
// work and before storing the response.
func TestHelperServer(t *testing.T) {
	if os.Getenv("IDEM_HELPER") != "1" {
		t.Skip("helper process for TestCrashMidHandler")
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	rdb, err := connect.Redis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		log.Error("redis", "error", err)
		os.Exit(1)
	}
	prefix := os.Getenv("IDEM_PREFIX")
	lockTTL, _ := time.ParseDuration(os.Getenv("IDEM_LOCK_TTL"))
	store, _ := redisstore.New(rdb, redisstore.Config{Prefix: prefix})
	mw, err := idempotency.New(idempotency.Config{Store: store, Tenant: tenantFromBearer, LockTTL: lockTTL, Logger: log})
	if err != nil {
		log.Error("middleware", "error", err)
		os.Exit(1)
	}
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := rdb.Incr(r.Context(), prefix+":effects").Result()
		if r.Header.Get("X-Hang") == "1" {
			select {} // killed here, after the effect, before the response is stored
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"effect":%d}`, n)
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Error("listen", "error", err)
		os.Exit(1)
	}
	log.Info("listening", "addr", ln.Addr().String())
	_ = http.Serve(ln, h)
}

// TestCrashMidHandler kills (SIGKILL) a server after its handler did its effect and
// before the response was stored. Nothing releases the in-progress marker, so retries
// to a fresh server get 409 with Retry-After (no second effect) until the lock TTL
// expires; then the key is free and a retry runs the handler again: the lock TTL is the
// crash-recovery time, and the effect may happen twice, which is why the summaries route
// takes the single-round-trip path (and derives its job id from the key).
func TestCrashMidHandler(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	// Long enough for a second server to start and answer before it ends: under make
	// test's load a start took 2.4s, and a 2s TTL had already freed the key.
	const lockTTL = 6 * time.Second
	env := []string{
		"IDEM_HELPER=1", "IDEM_PREFIX=" + prefix, "IDEM_LOCK_TTL=" + lockTTL.String(),
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t),
	}
	start := func() (*testenv.Process, string) {
		p := testenv.Start(t, os.Args[0], env, "-test.run=^TestHelperServer$")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return p, "http://" + p.WaitLog(ctx, "listening")["addr"].(string)
	}
	post := func(base string, hang bool) (int, http.Header, string) {
		req, _ := http.NewRequest("POST", base+path, strings.NewReader(body1))
		req.Header.Set("Authorization", "Bearer key-acme")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idempotency.HeaderKey, key1)
		if hang {
			req.Header.Set("X-Hang", "1")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return -1, nil, err.Error()
		}
		defer resp.Body.Close()
		b := make([]byte, 512)
		n, _ := resp.Body.Read(b)
		return resp.StatusCode, resp.Header, string(b[:n])
	}
	effects := func() int {
		n, _ := rdb.Get(context.Background(), prefix+":effects").Int()
		return n
	}

	p1, base1 := start()
	go post(base1, true)
	testenv.WaitFor(t, 20*time.Second, "the first effect", func() bool { return effects() == 1 })
	p1.Kill()

	p2, base2 := start()
	defer p2.Kill()
	code, h, _ := post(base2, false)
	if code != http.StatusConflict || h.Get("Retry-After") == "" {
		t.Fatalf("retry right after the crash: %d, want 409 with Retry-After", code)
	}
	if effects() != 1 {
		t.Fatalf("a retry during the lock TTL ran the handler: %d effects", effects())
	}
	var body string
	testenv.WaitFor(t, 20*time.Second, "crash recovery after the lock TTL", func() bool {
		code, _, body = post(base2, false)
		if code != http.StatusConflict && code != http.StatusCreated {
			t.Fatalf("retry: %d %s", code, body)
		}
		return code == http.StatusCreated
	})
	if effects() != 2 || body != `{"effect":2}` {
		t.Fatalf("after recovery: %d effects, body %s; want the second run", effects(), body)
	}
	if code, h, again := post(base2, false); code != http.StatusCreated || h.Get(idempotency.HeaderReplayed) != "true" || again != body {
		t.Fatalf("replay after recovery: %d %s", code, again)
	}
	if effects() != 2 {
		t.Fatalf("replay ran the handler: %d effects", effects())
	}
}
