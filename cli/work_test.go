package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
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

// workEnv returns the environment of a `work` process on the shared test Redis under a
// prefix of the test's own, and the client and keys to inspect it.
func workEnv(t *testing.T, extra ...string) ([]string, *redis.Client, queue.Keys) {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	env := append([]string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_PREFIX=" + prefix, "ONCEFLOW_SHUTDOWN_TIMEOUT=5s"}, extra...)
	return env, rdb, queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
}

func startWork(t *testing.T, env []string, args ...string) *testenv.Process {
	t.Helper()
	p := testenv.Start(t, testenv.Binary(t), env, append([]string{"work"}, args...)...)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p.WaitLog(ctx, "worker started")
	return p
}

func testJob(t *testing.T, rdb *redis.Client, keys queue.Keys, n int) string {
	t.Helper()
	id := "00000000-0000-4000-8000-" + strings.Repeat("0", 12-len(strconv.Itoa(n))) + strconv.Itoa(n)
	if _, err := queue.Enqueue(context.Background(), rdb, keys, queue.Message{JobID: id, Tenant: "acme", Payload: json.RawMessage(`{"text":"x"}`)}); err != nil {
		t.Fatal(err)
	}
	return id
}

// runCount reads a counter the record test handler keeps in Redis.
func runCount(t *testing.T, rdb *redis.Client, keys queue.Keys, field string) int {
	t.Helper()
	v, err := rdb.HGet(context.Background(), keys.Key("test:runs"), field).Int()
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	return v
}

// Issue 3: a worker process killed with kill -9 mid-job leaves the job pending; a
// second worker process reclaims it after ClaimIdle and finishes it (delivery 2).
func TestWorkKilledMidJobIsFinishedByAnotherProcess(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t, "ONCEFLOW_CLAIM_IDLE=1s")
	a := startWork(t, env, "--test-handler=record:1h")
	job := testJob(t, rdb, keys, 1)
	testenv.WaitFor(t, 10*time.Second, "worker a to start the job", func() bool { return runCount(t, rdb, keys, "started:"+job) == 1 })
	a.Kill()
	killed := time.Now()
	pending := rdb.XPending(context.Background(), keys.Stream(), queue.DefaultGroup).Val()
	if pending == nil || pending.Count != 1 {
		t.Fatalf("after kill -9: pending %+v, want the job pending to the dead worker", pending)
	}

	b := startWork(t, env, "--test-handler=record:0s")
	testenv.WaitFor(t, 15*time.Second, "worker b to finish the job", func() bool { return runCount(t, rdb, keys, "finished:"+job) == 1 })
	// a renewed its lease at most ClaimIdle/3 before it died; b may not take it sooner.
	if after := time.Since(killed); after < 500*time.Millisecond {
		t.Errorf("reclaimed %v after the kill, before ClaimIdle could pass", after)
	}
	if n := runCount(t, rdb, keys, "started:"+job); n != 2 {
		t.Errorf("job started %d times, want 2 (a, then b)", n)
	}
	if d := runCount(t, rdb, keys, "deliveries:"+job); d != 2 {
		t.Errorf("b saw delivery %d, want 2", d)
	}
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool {
		return rdb.XPending(context.Background(), keys.Stream(), queue.DefaultGroup).Val().Count == 0
	})
	b.Signal(syscall.SIGTERM)
	if code := b.Wait(15 * time.Second); code != 0 {
		t.Errorf("worker b exit %d after SIGTERM", code)
	}
}

// SIGTERM with a job in flight: the job finishes and is acknowledged, the process exits 0.
func TestWorkSIGTERMFinishesInFlightJob(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t, "ONCEFLOW_METRICS_ADDR=127.0.0.1:0")
	p := startWork(t, env, "--test-handler=record:700ms")
	job := testJob(t, rdb, keys, 1)
	testenv.WaitFor(t, 10*time.Second, "the job to start", func() bool { return runCount(t, rdb, keys, "started:"+job) == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addr := p.WaitLog(ctx, "http listening")["addr"]
	resp, err := http.Get(fmt.Sprintf("http://%v/metrics", addr))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`onceflow_queue_deliveries_total{queue="summaries"} 1`, `onceflow_queue_in_flight{queue="summaries"} 1`, `onceflow_queue_dead_lettered_total{queue="summaries",reason="malformed"} 0`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(15 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if n := runCount(t, rdb, keys, "finished:"+job); n != 1 {
		t.Errorf("job finished %d times, want 1", n)
	}
	if c := rdb.XPending(context.Background(), keys.Stream(), queue.DefaultGroup).Val().Count; c != 0 {
		t.Errorf("%d pending after a graceful stop, want 0", c)
	}
}

func TestWorkUsageErrors(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	cases := []struct {
		env      []string
		args     []string
		contains string
	}{
		{[]string{"ONCEFLOW_WORKER_CONCURRENCY=0"}, []string{"work", "--test-handler=noop"}, "ONCEFLOW_WORKER_CONCURRENCY"},
		{nil, []string{"work", "--test-handler=bogus"}, `invalid --test-handler="bogus"`},
		{nil, []string{"work", "--test-handler=sleep:soon"}, `invalid --test-handler="sleep:soon"`},
		{[]string{"ONCEFLOW_CLAIM_IDLE=abc"}, []string{"work"}, `invalid ONCEFLOW_CLAIM_IDLE="abc"`},
		{[]string{"ONCEFLOW_LLM=gpt"}, []string{"work"}, "ONCEFLOW_LLM"},
	}
	for _, tc := range cases {
		p := testenv.Start(t, bin, tc.env, tc.args...)
		if code := p.Wait(10 * time.Second); code != 2 {
			t.Errorf("%v: exit %d, want 2; stderr:\n%s", tc.args, code, p.Stderr())
		}
		if !strings.Contains(p.Stderr(), tc.contains) {
			t.Errorf("%v: stderr does not contain %q:\n%s", tc.args, tc.contains, p.Stderr())
		}
	}
}

// An operator's outage: the provider answers insufficient_quota for minutes, and
// `onceflow work` is restarted (a deploy) during the stop. docs/retries.md promises "one
// 429 per process, then one probe per interval per process", /readyz on
// ONCEFLOW_METRICS_ADDR reporting it, and no delivery spent: with a backlog, a process
// calls the provider at most ONCEFLOW_WORKER_CONCURRENCY times before the first 429
// trips its breaker, and a restarted one no more.
func TestWorkQuotaStopCallsAtMostItsConcurrencyPerProcess(t *testing.T) {
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
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL="+model.URL+"/v1", "OPENAI_API_KEY=sk-test-quota-stop",
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
		// Polled, as an orchestrator's probe is: under load a check of PostgreSQL can
		// miss its one-second bound once while the pool dials.
		var code int
		var body string
		for try := 0; try < 20; try++ {
			code, body = httpGet(t, fmt.Sprintf("http://%v/readyz", addr), "")
			if code == 200 {
				break
			}
			time.Sleep(250 * time.Millisecond)
		}
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
