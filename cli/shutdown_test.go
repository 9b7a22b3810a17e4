package cli

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
)

// halfPOST opens a connection to addr and sends a POST /v1/summaries whose body is only
// half there: the request is in flight (its handler is reading the body) until finish
// sends the rest and returns the status.
func halfPOST(t *testing.T, addr, idem string) (finish func() int) {
	t.Helper()
	body := `{"text":"a request in flight at shutdown","notify":"a@example.com"}`
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	fmt.Fprintf(conn, "POST /v1/summaries HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer test-key-acme-0123456789\r\n"+
		"Idempotency-Key: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", addr, idem, len(body), body[:10])
	time.Sleep(200 * time.Millisecond) // let the server read the headers and start the handler
	return func() int {
		t.Helper()
		if _, err := conn.Write([]byte(body[10:])); err != nil {
			t.Fatalf("send the rest of the body: %v", err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("read the response: %v", err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
}

// waitStderr waits until the process has written s to stderr (the plain line main
// prints at a signal, for instance).
func waitStderr(t *testing.T, p *testenv.Process, s string) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, "stderr to show "+s, func() bool { return strings.Contains(p.Stderr(), s) })
}

// serve drains: at SIGTERM it stops accepting connections, the request in flight
// completes (its job is enqueued and answered 202), and the process exits 0.
func TestServeSIGTERMDrainsTheRequestInFlight(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	p, base := startServe(t, "ONCEFLOW_REDIS_URL="+testenv.RedisURL(t), "ONCEFLOW_PREFIX="+prefix, "ONCEFLOW_DATABASE_URL="+dsn,
		"ONCEFLOW_SHUTDOWN_TIMEOUT=20s")
	addr := strings.TrimPrefix(base, "http://")
	finish := halfPOST(t, addr, "drain-test-key-000001")
	p.Signal(syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p.WaitLog(ctx, "http draining")
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Error("a new connection was accepted while draining")
	}
	if p.Exited() {
		t.Fatal("serve exited with a request in flight")
	}
	if code := finish(); code != http.StatusAccepted {
		t.Fatalf("the request in flight got %d, want 202", code)
	}
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d after draining", code)
	}
	keys := queue.Keys{Prefix: prefix, Queue: "summaries"}
	if n := rdb.XLen(context.Background(), keys.Stream()).Val(); n != 1 {
		t.Fatalf("%d jobs enqueued, want the in-flight request's 1", n)
	}
}

// work at the shutdown timeout: the job that finished before the signal is
// acknowledged; the one still running is cancelled and handed back (re-added to the
// stream as a new entry, nothing left pending, no attempt spent); the process exits 0
// soon after the timeout; another worker (ClaimIdle an hour: no reclaim) finishes it.
func TestWorkSIGTERMHandsBackTheJobsStillRunningAtTheTimeout(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t, "ONCEFLOW_SHUTDOWN_TIMEOUT=1s", "ONCEFLOW_CLAIM_IDLE=1h")
	a := startWork(t, env, "--test-handler=record:3s")
	done := testJob(t, rdb, keys, 1)
	testenv.WaitFor(t, 15*time.Second, "the first job to finish", func() bool { return runCount(t, rdb, keys, "finished:"+done) == 1 })
	slow := testJob(t, rdb, keys, 2)
	testenv.WaitFor(t, 10*time.Second, "the second job to start", func() bool { return runCount(t, rdb, keys, "started:"+slow) == 1 })
	start := time.Now()
	a.Signal(syscall.SIGTERM)
	if code := a.Wait(15 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if took := time.Since(start); took > 8*time.Second {
		t.Errorf("took %v to stop with a 1s shutdown timeout", took)
	}
	ctx := context.Background()
	pending := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Val()
	lag := int64(-1)
	if groups, err := rdb.XInfoGroups(ctx, keys.Stream()).Result(); err == nil && len(groups) == 1 {
		lag = groups[0].Lag
	}
	if pending == nil || pending.Count != 0 || lag != 1 || runCount(t, rdb, keys, "finished:"+slow) != 0 {
		t.Fatalf("after the stop: pending %+v (want none), undelivered %d (want 1, the handed-back job), finished %d",
			pending, lag, runCount(t, rdb, keys, "finished:"+slow))
	}
	b := startWork(t, env, "--test-handler=record:0s")
	testenv.WaitFor(t, 15*time.Second, "another worker to finish the handed-back job", func() bool { return runCount(t, rdb, keys, "finished:"+slow) == 1 })
	if n := runCount(t, rdb, keys, "started:"+done); n != 1 {
		t.Errorf("the acknowledged job ran %d times, want 1", n)
	}
	if d := runCount(t, rdb, keys, "deliveries:"+slow); d != 1 {
		t.Errorf("the handed-back job's second run saw delivery %d, want 1 (the run cut by the shutdown spent none)", d)
	}
	b.Signal(syscall.SIGTERM)
	if code := b.Wait(15 * time.Second); code != 0 {
		t.Errorf("worker b exit %d", code)
	}
}

// relay at the shutdown timeout: sends still running are abandoned and their rows
// released at once (no attempt counted, no lease left), the process exits 0, and
// another relay sends every row.
func TestRelaySIGTERMReleasesSendsThatOutliveTheTimeout(t *testing.T) {
	t.Parallel()
	const rows = 5
	pool, dsn := testenv.Postgres(t)
	seedOutbox(t, pool, rows)
	release := make(chan struct{})
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
	}))
	t.Cleanup(hook.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	bin := testenv.Binary(t)
	env := relayEnv(dsn, hook.URL, "ONCEFLOW_SHUTDOWN_TIMEOUT=1s", "ONCEFLOW_RELAY_BATCH_SIZE=5", "ONCEFLOW_RELAY_CONCURRENCY=2")
	p := testenv.Start(t, bin, env, "relay")
	testenv.WaitFor(t, 20*time.Second, "the batch claimed", func() bool { return countOutbox(t, pool, "claimed_by IS NOT NULL") == rows })
	time.Sleep(200 * time.Millisecond) // the sends are in flight
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(15 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if n := countOutbox(t, pool, "claimed_by IS NULL AND sent_at IS NULL AND attempts = 0"); n != rows {
		t.Fatalf("%d rows released untouched, want %d", n, rows)
	}
	close(release)
	q := testenv.Start(t, bin, env, "relay")
	testenv.WaitFor(t, 20*time.Second, "every row sent by another relay", func() bool { return countOutbox(t, pool, "sent_at IS NOT NULL") == rows })
	q.Signal(syscall.SIGTERM)
	if code := q.Wait(15 * time.Second); code != 0 {
		t.Errorf("second relay exit %d", code)
	}
}

// run drains its three roles: the job whose model call is in flight at SIGTERM
// finishes (summary and outbox row committed, entry acknowledged), and it exits 0.
func TestRunSIGTERMFinishesTheJobInFlight(t *testing.T) {
	t.Parallel()
	model, err := fakeserver.New(fakeserver.Config{Latency: 1500 * time.Millisecond, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	llmSrv := httptest.NewServer(model)
	t.Cleanup(func() { model.Close(); llmSrv.Close() })
	rdb, prefix := testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		testAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=15s",
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + llmSrv.URL + "/v1"}
	p := testenv.Start(t, testenv.Binary(t), env, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	addr := fmt.Sprint(p.WaitLog(ctx, "http listening")["addr"])
	p.WaitLog(ctx, "worker started")
	if code := halfPOST(t, addr, "run-drain-key-0000001")(); code != http.StatusAccepted {
		t.Fatalf("POST: %d", code)
	}
	testenv.WaitFor(t, 10*time.Second, "the model call in flight", func() bool { return model.Stats().InFlight == 1 })
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	var summaries, outbox int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM summaries), (SELECT count(*) FROM outbox)`).Scan(&summaries, &outbox); err != nil {
		t.Fatal(err)
	}
	if summaries != 1 || outbox != 1 {
		t.Fatalf("after the drain: %d summaries, %d outbox rows; want the job in flight finished", summaries, outbox)
	}
	keys := queue.Keys{Prefix: prefix, Queue: "summaries"}
	if n := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Val().Count; n != 0 {
		t.Fatalf("%d entries pending after a clean stop, want 0", n)
	}
}

// A second SIGINT/SIGTERM while draining exits at once, with status 1, for every role.
func TestSecondSignalExitsAtOnce(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	second := func(t *testing.T, p *testenv.Process, sig syscall.Signal) {
		t.Helper()
		p.Signal(sig)
		waitStderr(t, p, "shutting down (send it again to exit at once)")
		time.Sleep(100 * time.Millisecond)
		if p.Exited() {
			t.Fatal("exited after the first signal: there was nothing to drain, nothing tested")
		}
		start := time.Now()
		p.Signal(sig)
		if code := p.Wait(10 * time.Second); code != 1 {
			t.Errorf("exit %d after a second signal, want 1", code)
		}
		if took := time.Since(start); took > 3*time.Second {
			t.Errorf("second signal took %v to exit", took)
		}
		if !strings.Contains(p.Stderr(), "again: exiting now") {
			t.Errorf("no line about the second signal")
		}
	}

	t.Run("serve", func(t *testing.T) {
		t.Parallel()
		_, dsn := testenv.Postgres(t)
		p, base := startServe(t, "ONCEFLOW_REDIS_URL="+testenv.RedisURL(t), "ONCEFLOW_PREFIX="+testenv.Prefix(t), "ONCEFLOW_DATABASE_URL="+dsn,
			"ONCEFLOW_SHUTDOWN_TIMEOUT=60s")
		halfPOST(t, strings.TrimPrefix(base, "http://"), "second-signal-key-001") // never finished
		second(t, p, syscall.SIGTERM)
	})
	t.Run("work", func(t *testing.T) {
		t.Parallel()
		env, rdb, keys := workEnv(t, "ONCEFLOW_SHUTDOWN_TIMEOUT=60s")
		p := startWork(t, env, "--test-handler=record:1h")
		job := testJob(t, rdb, keys, 1)
		testenv.WaitFor(t, 10*time.Second, "the job to start", func() bool { return runCount(t, rdb, keys, "started:"+job) == 1 })
		second(t, p, syscall.SIGINT)
		if n := rdb.XPending(context.Background(), keys.Stream(), queue.DefaultGroup).Val().Count; n != 1 {
			t.Errorf("%d pending after a forced exit, want the running job (1): never acknowledged, never lost", n)
		}
	})
	t.Run("relay", func(t *testing.T) {
		t.Parallel()
		pool, dsn := testenv.Postgres(t)
		seedOutbox(t, pool, 2)
		hang := make(chan struct{})
		var posted atomic.Int32
		hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			posted.Add(1)
			select {
			case <-hang:
			case <-r.Context().Done():
			}
		}))
		t.Cleanup(func() { close(hang); hook.Close() })
		p := testenv.Start(t, bin, relayEnv(dsn, hook.URL, "ONCEFLOW_SHUTDOWN_TIMEOUT=60s"), "relay")
		testenv.WaitFor(t, 20*time.Second, "the batch claimed", func() bool { return countOutbox(t, pool, "claimed_by IS NOT NULL") == 2 })
		// A delivery in flight, for the drain to wait on: a claimed batch not yet posted
		// would be let go at the first signal.
		testenv.WaitFor(t, 20*time.Second, "a delivery in flight", func() bool { return posted.Load() > 0 })
		second(t, p, syscall.SIGTERM)
		if n := countOutbox(t, pool, "sent_at IS NULL"); n != 2 {
			t.Errorf("%d rows unsent after a forced exit, want 2 (sent again after their lease)", n)
		}
	})
	t.Run("run", func(t *testing.T) {
		t.Parallel()
		model, err := fakeserver.New(fakeserver.Config{Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		model.Script(fakeserver.Fault{Kind: fakeserver.FaultHang})
		llmSrv := httptest.NewServer(model)
		t.Cleanup(func() { model.Close(); llmSrv.Close() })
		_, prefix := testenv.Redis(t)
		_, dsn := testenv.Postgres(t)
		env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
			testAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=60s",
			"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + llmSrv.URL + "/v1"}
		p := testenv.Start(t, bin, env, "run")
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		addr := fmt.Sprint(p.WaitLog(ctx, "http listening")["addr"])
		p.WaitLog(ctx, "worker started")
		if code := halfPOST(t, addr, "second-signal-run-001")(); code != http.StatusAccepted {
			t.Fatalf("POST: %d", code)
		}
		testenv.WaitFor(t, 10*time.Second, "the model call in flight", func() bool { return model.Stats().InFlight == 1 })
		second(t, p, syscall.SIGTERM)
	})
}

// Every role's listener answers /readyz naming the store that is down, and /healthz
// stays 200 and fast without touching it.
func TestWorkAndRelayListenersReportTheStoreThatIsDown(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	check := func(t *testing.T, p *testenv.Process, stop func(), down, up string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		base := "http://" + fmt.Sprint(p.WaitLog(ctx, "http listening")["addr"])
		awaitReady(t, base)
		stop()
		code, body, _ := getJSON(t, base+"/readyz")
		checks, _ := body["checks"].(map[string]any)
		if code != http.StatusServiceUnavailable || !strings.HasPrefix(fmt.Sprint(checks[down]), "unavailable") {
			t.Errorf("readyz with %s down: %d %v", down, code, body)
		}
		if up != "" && checks[up] != "ok" {
			t.Errorf("readyz with %s down: %s is %v, want ok", down, up, checks[up])
		}
		code, _, took := getJSON(t, base+"/healthz")
		if code != 200 || took > time.Second {
			t.Errorf("healthz with %s down: %d in %v", down, code, took)
		}
	}
	t.Run("work", func(t *testing.T) {
		t.Parallel()
		r := testenv.PrivateRedis(t)
		_, dsn := testenv.Postgres(t)
		p := testenv.Start(t, bin, []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURLOf(r), "ONCEFLOW_DATABASE_URL=" + dsn,
			"ONCEFLOW_METRICS_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s"}, "work")
		check(t, p, r.Stop, "redis", "postgres")
	})
	t.Run("relay", func(t *testing.T) {
		t.Parallel()
		pg := testenv.PrivatePostgres(t)
		p := testenv.Start(t, bin, []string{"ONCEFLOW_DATABASE_URL=" + testenv.PostgresURLOf(pg),
			"ONCEFLOW_METRICS_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s"}, "relay")
		check(t, p, pg.Stop, "postgres", "")
	})
}
