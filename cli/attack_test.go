package cli

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// An operator's outage: the provider answers insufficient_quota for minutes, and
// `onceflow work` is restarted (a deploy) during the stop. docs/retries.md promises "one
// 429 per process, then one probe per interval per process", /readyz on
// ONCEFLOW_METRICS_ADDR reporting it, and no delivery spent. With a backlog, the first
// read takes ONCEFLOW_WORKER_CONCURRENCY jobs and every one of them calls the provider
// before the first 429 trips the breaker; a restart forgets the stop and does it again.
func TestAttackWorkQuotaStopCallsAtMostItsConcurrencyPerProcess(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	model := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		time.Sleep(50 * time.Millisecond) // a real provider takes a moment to refuse
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"error":{"message":"You exceeded your current quota.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}`)
	}))
	t.Cleanup(model.Close)
	_, dsn := testenv.Postgres(t)
	env, rdb, keys := workEnv(t, "ONCEFLOW_DATABASE_URL="+dsn,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL="+model.URL+"/v1", "OPENAI_API_KEY=sk-test-attack-quota",
		"ONCEFLOW_LLM_QUOTA_PROBE=1h", "ONCEFLOW_WORKER_CONCURRENCY=8", "ONCEFLOW_CLAIM_IDLE=200ms",
		"ONCEFLOW_METRICS_ADDR=127.0.0.1:0")
	testenv.Binary(t) // built before the clock starts
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	for i := range 16 {
		req := summaries.Request{Text: fmt.Sprintf("Backlog item %d to summarise.", i), Notify: "team@example.com"}
		id := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
		if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: id, Tenant: "acme", Payload: req.Canonical()}); err != nil {
			t.Fatal(err)
		}
	}
	var perProcess []int64
	for round := range 2 {
		before := calls.Load()
		p := startWork(t, env)
		p.WaitLog(ctx, "dependency unavailable: stopped calling it and taking work that needs it, until a probe succeeds")
		addr := p.WaitLog(ctx, "http listening")["addr"]
		code, body := httpGet(t, fmt.Sprintf("http://%v/readyz", addr), "")
		if code != 200 || !strings.Contains(body, `"degraded"`) || !strings.Contains(body, "insufficient_quota") {
			t.Errorf("round %d: /readyz of work: %d %s, want 200 degraded naming the quota", round, code, body)
		}
		time.Sleep(500 * time.Millisecond) // let every call already made land
		perProcess = append(perProcess, calls.Load()-before)
		p.Signal(syscall.SIGTERM)
		if c := p.Wait(15 * time.Second); c != 0 {
			t.Fatalf("round %d: exit %d", round, c)
		}
	}
	if n := rdb.XLen(ctx, keys.Dead()).Val(); n != 0 {
		t.Fatalf("%d dead letters during the quota stop", n)
	}
	pend, err := rdb.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: queue.DefaultGroup, Start: "-", End: "+", Count: 100}).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range pend {
		if e.RetryCount > 1 {
			t.Errorf("entry %s has %d deliveries counted after the stop", e.ID, e.RetryCount)
		}
	}
	// Calls already sent when the first quota answer arrives cannot be recalled: at most
	// the process's concurrency of them (docs/retries.md), then none until a probe. The
	// process restarted during the stop makes none: its first call reads the fleet's
	// quota pause from the limiter, and its breaker opens for it.
	if n := perProcess[0]; n < 1 || n > 8 {
		t.Errorf("the first process made %d provider calls into the exhausted quota; want 1 to its concurrency (8)", n)
	}
	if n := perProcess[1]; n != 0 {
		t.Errorf("the process restarted during the stop made %d provider calls into the exhausted quota; want 0 (the fleet's pause)", n)
	}
}

// A rolling restart of the gateway while a call outlasts ONCEFLOW_SHUTDOWN_TIMEOUT (a
// long generation, a slow stream): the old gateway gives the call up and exits 0, but
// leaves its row in_flight with a live-looking lease, so the client's retry to the new
// gateway is answered 409 for up to ONCEFLOW_LEDGER_LEASE (15s), longer than the
// OpenAI SDKs' default retries last. A call the gateway abandons on SIGTERM should be
// released (ambiguous), as one that hits ONCEFLOW_GATEWAY_TIMEOUT is, for the retry to
// take over at once.
func TestAttackGatewaySIGTERMReleasesTheCallsItGivesUp(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	_, fake := startFakeLLM(t, "--drip", "1") // the answer arrives one byte a second
	gw, gwURL := startGateway(t, dsn, fake, "ONCEFLOW_SHUTDOWN_TIMEOUT=1s")
	key := "rolling-restart-key-01"
	go func() { _, _, _ = keyedPost(gwURL, key) }()
	waitInFlight(t, fake)
	gw.Signal(syscall.SIGTERM)
	if code := gw.Wait(15 * time.Second); code != 0 {
		t.Fatalf("gateway exit %d", code)
	}
	_, gwURL = startGateway(t, dsn, fake)
	// The client's retry, at once. Taken over, it drips too: give it a few seconds to
	// get past the 409, not the minutes the answer takes.
	req, _ := http.NewRequest(http.MethodPost, gwURL+"/chat/completions", strings.NewReader(`{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"hello"}]}`))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk-test")
	resp, err := (&http.Client{Timeout: 3 * time.Second}).Do(req)
	if err == nil {
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusConflict {
			t.Fatal("the retry after a graceful restart got 409: the call the old gateway abandoned still holds its row")
		}
	}
}
