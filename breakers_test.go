package onceflow_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/queue"
)

// breakerOf returns the client's breaker named name, failing the test without one.
func breakerOf(t *testing.T, c *onceflow.Client, name string) *breaker.Breaker {
	t.Helper()
	for _, b := range c.Inspector().Breakers() {
		if b.Name() == name {
			return b
		}
	}
	t.Fatalf("the client has no %q breaker", name)
	return nil
}

// gauge returns the value of metric name labelled dependency=dep in reg (-1 without it).
func gauge(t *testing.T, reg *prometheus.Registry, name, dep string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "dependency" && l.GetValue() == dep {
					return m.GetGauge().GetValue() + m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// readyz serves /readyz over the client's breakers as `onceflow work` does
// (httpapi.BreakerCheck) and returns a function that GETs it.
func readyz(t *testing.T, c *onceflow.Client, checks map[string]httpapi.Check) func() (int, map[string]string) {
	t.Helper()
	for name, check := range checks {
		for _, b := range c.Inspector().Breakers() {
			if b.Name() == name {
				checks[name] = httpapi.BreakerCheck(b, check)
			}
		}
	}
	srv := httptest.NewServer(httpapi.New(httpapi.Config{Logger: testenv.Logger(t), Checks: checks}))
	t.Cleanup(srv.Close)
	return func() (int, map[string]string) {
		resp, err := http.Get(srv.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body struct {
			Checks map[string]string `json:"checks"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body.Checks
	}
}

// checkSince checks that a /readyz entry says "unavailable since <RFC 3339>: <why>",
// the time within the test's span, and the why containing want.
func checkSince(t *testing.T, entry, want string, start time.Time) {
	t.Helper()
	rest, ok := strings.CutPrefix(entry, "unavailable since ")
	stamp, why, ok2 := strings.Cut(rest, ": ")
	since, err := time.Parse(time.RFC3339, stamp)
	if !ok || !ok2 || err != nil || since.Before(start.Add(-time.Second)) || since.After(time.Now()) || !strings.Contains(why, want) {
		t.Fatalf("/readyz says %q, want \"unavailable since <RFC 3339 time of the trip>: ...%s...\"", entry, want)
	}
}

// PostgreSQL is stopped for about ten seconds while jobs are queued: the postgres
// breaker opens (its health checks fail), /readyz and the metrics say so and since
// when, the workers take no job meanwhile, nothing is dead-lettered, and once
// PostgreSQL is back every job is done once.
func TestPostgresBreakerHoldsTheWorkersBack(t *testing.T) {
	testenv.Long(t) // a PostgreSQL of its own down until the breaker opens, then back
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (job_id text PRIMARY KEY, order_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	rdb, prefix := testenv.Redis(t)
	var entries atomic.Int64 // runs of the Worker
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[outageArgs](func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
		entries.Add(1)
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO orders (job_id, order_id) VALUES ($1, $2)`, j.ID, j.Args.Order)
			c.Emit("email.order", "order:"+j.ID, j.Args)
			return nil
		})
	}))
	// runs counts the deliveries the client's handler got (the middleware sees every
	// one, those handed back without running the Worker included).
	var runs atomic.Int64
	count := func(next onceflow.JobFunc) onceflow.JobFunc {
		return func(ctx context.Context, info *onceflow.JobInfo) error { runs.Add(1); return next(ctx, info) }
	}
	reg := prometheus.NewRegistry()
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		Middleware: []onceflow.Middleware{count}, Registerer: reg, HealthInterval: 100 * time.Millisecond, BreakerThreshold: 3,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: 2, ClaimIdle: 300 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	pgb := breakerOf(t, c, "postgres")
	ready := readyz(t, c, map[string]httpapi.Check{"postgres": pool.Ping, "redis": func(ctx context.Context) error { return rdb.Ping(ctx).Err() }})
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	dead := func() int64 { return rdb.XLen(ctx, keys.Dead()).Val() }
	rows := func(sql string) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	runClient(t, c)
	if _, err := c.Enqueue(ctx, outageArgs{Order: "before"}, nil); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the first job", func() bool { return entries.Load() == 1 && pendingOf(ctx, rdb, keys) == 0 })
	if code, checks := ready(); code != 200 || checks["postgres"] != "ok" {
		t.Fatalf("/readyz with PostgreSQL up: %d %v", code, checks)
	}

	stopped := time.Now()
	pg.Stop()
	testenv.WaitFor(t, 30*time.Second, "the postgres breaker to open", func() bool { return pgb.Err() != nil })
	code, checks := ready()
	if code != http.StatusServiceUnavailable || checks["redis"] != "ok" {
		t.Fatalf("/readyz with PostgreSQL down: %d %v", code, checks)
	}
	checkSince(t, checks["postgres"], "health check", stopped)
	if open, since := gauge(t, reg, "onceflow_breaker_open", "postgres"), gauge(t, reg, "onceflow_breaker_open_since_timestamp_seconds", "postgres"); open != 1 || since < float64(stopped.Unix()-1) {
		t.Fatalf("metrics with PostgreSQL down: open %v, since %v, want 1 and the trip's time", open, since)
	}

	const jobs = 5
	held, heldRuns := entries.Load(), runs.Load()
	for i := range jobs {
		if _, err := c.Enqueue(ctx, outageArgs{Order: fmt.Sprint("during-", i)}, nil); err != nil {
			t.Fatal(err)
		}
	}
	// PostgreSQL stays down for about ten seconds in all; the queued jobs wait.
	time.Sleep(time.Until(stopped.Add(10 * time.Second)))
	if n := entries.Load() - held; n != 0 {
		t.Fatalf("the Worker ran %d jobs while the postgres breaker was open", n)
	}
	// At most one delivery of each: a read already waiting when the breaker opened
	// (handed back at once); the gate holds every later read back. Without it, each
	// job would be delivered again after every ClaimIdle.
	if n := runs.Load() - heldRuns; n > jobs {
		t.Fatalf("the queue delivered %d times %d jobs while the postgres breaker was open", n, jobs)
	}
	if n := dead(); n != 0 {
		t.Fatalf("%d dead letters during the outage", n)
	}
	if pgb.Err() == nil {
		t.Fatal("the postgres breaker closed while PostgreSQL was down")
	}

	pg.Start()
	testenv.WaitFor(t, 60*time.Second, "every job after the outage", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM job_completions`).Scan(&n)
		return err == nil && n == 1+jobs && pendingOf(ctx, rdb, keys) == 0
	})
	if completions, rows, effects := rows(`SELECT count(*) FROM job_completions`), rows(`SELECT count(*) FROM orders`),
		rows(`SELECT count(*) FROM outbox WHERE topic = 'email.order'`); completions != 1+jobs || rows != 1+jobs || effects != 1+jobs || dead() != 0 {
		t.Fatalf("after the outage: %d completions, %d rows, %d effects, %d dead letters; want %d, %d, %d, 0",
			completions, rows, effects, dead(), 1+jobs, 1+jobs, 1+jobs)
	}
	if code, checks := ready(); code != 200 || checks["postgres"] != "ok" || pgb.Err() != nil {
		t.Fatalf("/readyz after the outage: %d %v", code, checks)
	}
	if open := gauge(t, reg, "onceflow_breaker_open", "postgres"); open != 0 {
		t.Fatalf("onceflow_breaker_open{postgres} %v after the outage", open)
	}
	t.Logf("%d deliveries, %d Worker runs for %d jobs", runs.Load(), entries.Load(), 1+jobs)
}

// unavailableModel is an OpenAI-compatible endpoint: fake-llm, except while down, when
// it answers every request 503 as OpenAI does when overloaded.
type unavailableModel struct {
	next           http.Handler
	down           atomic.Bool
	requests, s503 atomic.Int64
	// poison, when set, makes the model answer 503 to every request whose body holds it
	// (an input the provider fails on), whether or not it is down.
	poison string
	// downAfter, when set, takes the model down right after it answered a request
	// whose body holds it (an outage that starts between two steps of a job).
	downAfter string
}

func (m *unavailableModel) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m.requests.Add(1)
	poisoned, last := false, false
	if m.poison != "" || m.downAfter != "" {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		poisoned = m.poison != "" && bytes.Contains(body, []byte(m.poison))
		last = m.downAfter != "" && bytes.Contains(body, []byte(m.downAfter))
	}
	if m.down.Load() || poisoned {
		m.s503.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"error":{"message":"The server is overloaded or not ready yet.","type":"server_error","param":null,"code":null}}`))
		return
	}
	m.next.ServeHTTP(w, r)
	if last {
		m.down.Store(true)
	}
}

// The model answers 503 to everything for a window, through the production OpenAI
// client: the llm breaker opens after BreakerThreshold model calls in a row failed
// after their retries, calls stop but for one probe per QuotaProbe, no job is
// dead-lettered although MaxDeliveries is 2, and every job is done once after the
// window.
func TestModelOutageTripsTheLLMBreaker(t *testing.T) {
	testenv.Long(t) // a model outage long enough to trip the breaker, then its probe
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pool, _ := testenv.Postgres(t)
	rdb, prefix := testenv.Redis(t)
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	model := &unavailableModel{next: fs}
	srv := httptest.NewServer(model)
	t.Cleanup(func() { fs.Close(); srv.Close() })

	var entries atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[outageArgs](func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
		entries.Add(1)
		st, err := j.Complete(ctx, "summarise", prompt("order "+j.Args.Order))
		if err != nil {
			return err
		}
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Result(st.Response.Content)
			c.Emit("email.order", "order:"+j.ID, j.Args)
			return nil
		})
	}))
	const threshold, probe = 3, 500 * time.Millisecond
	reg := prometheus.NewRegistry()
	policy := fastRetry
	policy.MaxAttempts = 2
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		Registerer: reg, BreakerThreshold: threshold, QuotaProbe: probe,
		Model: openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"}), ModelRetry: policy, JobBudget: 2 * time.Second,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: 2, ClaimIdle: 300 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	llmb := breakerOf(t, c, "llm")
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	dead := func() int64 { return rdb.XLen(ctx, keys.Dead()).Val() }

	model.down.Store(true)
	const jobs = 8
	var ids []string
	for i := range jobs {
		res, err := c.Enqueue(ctx, outageArgs{Order: fmt.Sprint("o-", i)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.JobID)
	}
	start := time.Now()
	runClient(t, c)
	testenv.WaitFor(t, 30*time.Second, "the llm breaker to open", func() bool { return llmb.Err() != nil || dead() > 0 })
	var oe *breaker.OpenError
	if err := llmb.Err(); !errors.As(err, &oe) || !strings.Contains(oe.Reason, fmt.Sprintf("%d failures in a row", threshold)) || !strings.Contains(oe.Reason, "503") {
		t.Fatalf("llm breaker: %v, want open after %d failures naming the 503 (%d dead letters)", err, threshold, dead())
	}
	if open := gauge(t, reg, "onceflow_breaker_open", "llm"); open != 1 {
		t.Fatalf("onceflow_breaker_open{llm} = %v while open", open)
	}
	// The window lasts a few seconds: many ClaimIdles and probes.
	atTrip := model.requests.Load()
	time.Sleep(4 * time.Second)
	during := model.requests.Load() - atTrip
	if n := dead(); n != 0 {
		t.Fatalf("%d jobs dead-lettered during the 503 window", n)
	}
	// Without the breaker every job's deliveries would call (2 attempts every 300ms
	// each); with it, one probe per 500ms, and the calls in flight when it opened.
	if limit := int64(2*jobs + 2*int((4*time.Second)/probe)); during > limit {
		t.Errorf("%d model requests in the 4s after the breaker opened, want at most %d (probes)", during, limit)
	}
	model.down.Store(false)
	testenv.WaitFor(t, 60*time.Second, "every job after the window", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM job_completions WHERE job_id = ANY($1)`, ids).Scan(&n)
		return err == nil && n == jobs && pendingOf(ctx, rdb, keys) == 0
	})
	var completions, effects int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM job_completions WHERE job_id = ANY($1)`, ids).Scan(&completions); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE topic = 'email.order'`).Scan(&effects); err != nil {
		t.Fatal(err)
	}
	if completions != jobs || effects != jobs || dead() != 0 || llmb.Err() != nil {
		t.Fatalf("after the window: %d completions, %d effects, %d dead letters, breaker %v; want %d, %d, 0, closed",
			completions, effects, dead(), llmb.Err(), jobs, jobs)
	}
	t.Logf("%d runs, %d model requests (%d answered 503; %d in the 4s after the trip), %v in all",
		entries.Load(), model.requests.Load(), model.s503.Load(), during, time.Since(start).Round(time.Millisecond))
}

// The model's breaker is shared by the processes of a deployment: when one process's
// opens (a 503 window it noticed), another's opens too, and a process started during
// the window (a rolling restart) starts with it open and takes no job that would spend
// an attempt on the outage. A probe that closes the first process's breaker clears the
// key.
func TestModelBreakerIsSharedAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(fs)
	t.Cleanup(func() { fs.Close(); srv.Close() })
	var runs atomic.Int64
	newProcess := func() *onceflow.Client {
		ws := onceflow.NewWorkers()
		onceflow.AddWorker(ws, onceflow.WorkFunc[outageArgs](func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
			runs.Add(1)
			if _, err := j.Complete(ctx, "summarise", prompt("order "+j.Args.Order)); err != nil {
				return err
			}
			return j.Commit(ctx, func(*onceflow.Commit) error { return nil })
		}))
		c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
			HealthInterval: 100 * time.Millisecond, QuotaProbe: time.Minute,
			Model: openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"})})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	a, b := newProcess(), newProcess()
	runClient(t, a)
	runClient(t, b)
	breakerOf(t, a, "llm").Trip(errors.New("openai: HTTP 503 Service Unavailable"), time.Minute)
	testenv.WaitFor(t, 10*time.Second, "the other process's breaker to open", func() bool { return breakerOf(t, b, "llm").Err() != nil })
	var oe *breaker.OpenError
	if err := breakerOf(t, b, "llm").Err(); !errors.As(err, &oe) || !strings.Contains(oe.Reason, "503") || time.Until(oe.NextProbe) < 30*time.Second {
		t.Fatalf("the other process's breaker: %v, want open until the first's next probe, naming its cause", err)
	}
	// A process started now has its breaker open before its workers read: no model call
	// goes out, and a job that a read already under way delivered (one of the first two
	// processes' reads can be blocked on the stream when its breaker opens) is handed
	// back without spending an attempt.
	c := newProcess()
	if _, err := c.Enqueue(ctx, outageArgs{Order: "during"}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	time.Sleep(500 * time.Millisecond)
	if err := breakerOf(t, c, "llm").Err(); err == nil {
		t.Fatal("a process started during the outage has a closed model breaker")
	}
	if st := fs.Stats(); st.Requests != 0 {
		t.Fatalf("%d model requests while every process's model breaker was open (%d runs)", st.Requests, runs.Load())
	}
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	if n := rdb.XLen(ctx, keys.Dead()).Val(); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	if rdb.Exists(ctx, prefix+":breaker:llm").Val() != 1 {
		t.Fatal("no fleet key while the first process's breaker is open")
	}
}

// modelFailureEnv is a client whose model (the production OpenAI client against model)
// fails with 503s, with a breaker that never opens in the test's time, MaxDeliveries 2
// and fast retries: what a failing call spends shows in dead letters at once.
func modelFailureEnv(t *testing.T, model *unavailableModel) (c *onceflow.Client, dead func() int64, done func(ids []string) int) {
	t.Helper()
	pool, _ := testenv.Postgres(t)
	rdb, prefix := testenv.Redis(t)
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	model.next = fs
	srv := httptest.NewServer(model)
	t.Cleanup(func() { fs.Close(); srv.Close() })
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[outageArgs](func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
		if strings.HasPrefix(j.Args.Order, "two steps") { // an outline first, then the summary
			if _, err := j.Complete(ctx, "outline", prompt("outline of order "+j.Args.Order)); err != nil {
				return err
			}
		}
		st, err := j.Complete(ctx, "summarise", prompt("order "+j.Args.Order))
		if err != nil {
			return err
		}
		return j.Commit(ctx, func(c *onceflow.Commit) error { c.Result(st.Response.Content); return nil })
	}))
	policy := fastRetry
	policy.MaxAttempts = 2
	c, err = onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		BreakerThreshold: 1000, Model: openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"}),
		ModelRetry: policy, JobBudget: 2 * time.Second,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: 2, ClaimIdle: 300 * time.Millisecond,
			RetryBase: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	dead = func() int64 { return rdb.XLen(context.Background(), keys.Dead()).Val() }
	done = func(ids []string) int {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM job_completions WHERE job_id = ANY($1)`, ids).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	return c, dead, done
}

// An outage of the provider that the breaker has not yet recognised (its threshold not
// reached: on a fleet, each process counts its own run) dead-letters no job: a failure
// that continues a run of failing calls is the provider's, and hands the job back
// without spending a delivery.
func TestModelFailuresOfManyJobsSpendNoDelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	model := &unavailableModel{}
	c, dead, done := modelFailureEnv(t, model)
	model.down.Store(true)
	const jobs = 6
	var ids []string
	for i := range jobs {
		res, err := c.Enqueue(ctx, outageArgs{Order: fmt.Sprint("o-", i)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.JobID)
	}
	runClient(t, c)
	// Every job meets the outage several times: with MaxDeliveries 2, each failure that
	// spent a delivery would dead-letter jobs.
	testenv.WaitFor(t, 30*time.Second, "three failing requests per job", func() bool { return model.s503.Load() >= 3*2*jobs || dead() > 0 })
	if n := dead(); n != 0 {
		t.Fatalf("%d jobs dead-lettered by an outage of the provider", n)
	}
	model.down.Store(false)
	testenv.WaitFor(t, 30*time.Second, "every job after the outage", func() bool { return done(ids) == jobs })
	if n := dead(); n != 0 {
		t.Fatalf("%d jobs dead-lettered by an outage of the provider", n)
	}
}

// A job whose first model step was answered just before the provider went down replays
// that step from the ledger on every later delivery. A replay reaches no provider: it
// neither ends the run of failing calls nor closes the breaker, so the job spends no
// delivery on the outage however often it is delivered, and is done once the provider
// is back.
func TestModelOutageAfterARecordedStepSpendsNoDelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	model := &unavailableModel{downAfter: "outline of order two steps"}
	c, dead, done := modelFailureEnv(t, model)
	res, err := c.Enqueue(ctx, outageArgs{Order: "two steps"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	// Each delivery replays the outline and fails the summary twice (two attempts): with
	// MaxDeliveries 2, a second delivery that spent one would dead-letter the job.
	testenv.WaitFor(t, 30*time.Second, "four deliveries meeting the outage", func() bool { return model.s503.Load() >= 4*2 || dead() > 0 })
	if n := dead(); n != 0 {
		t.Fatalf("the job was dead-lettered by an outage of the provider (%d failing requests)", model.s503.Load())
	}
	model.down.Store(false)
	testenv.WaitFor(t, 30*time.Second, "the job after the outage", func() bool { return done([]string{res.JobID}) == 1 })
	if n := dead(); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
}

// A job whose own input makes the provider fail, while other jobs' calls work, spends
// a delivery per failure (each comes after another call's success) and is dead-lettered
// after MaxDeliveries; the other jobs are done.
func TestJobWhoseOwnModelCallsFailIsDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	model := &unavailableModel{poison: "order poison"}
	c, dead, done := modelFailureEnv(t, model)
	if _, err := c.Enqueue(ctx, outageArgs{Order: "poison"}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	// Traffic that works, between the poison job's failures.
	var ids []string
	testenv.WaitFor(t, 30*time.Second, "the poison job's dead letter", func() bool {
		res, err := c.Enqueue(ctx, outageArgs{Order: fmt.Sprint("fine-", len(ids))}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.JobID)
		return dead() == 1
	})
	testenv.WaitFor(t, 30*time.Second, "the other jobs", func() bool { return done(ids) == len(ids) })
	if n := dead(); n != 1 {
		t.Fatalf("%d dead letters, want the poison job's only", n)
	}
}
