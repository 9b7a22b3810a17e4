package onceflow_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// Config.Registerer reaches the worker of every queue a Client runs: the queue metrics
// of both queues move on the user's registry, by queue, and count what happened (one
// delivery and one ack each, one permanent dead letter).
func TestRegistererGetsEveryQueuesMetrics(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	reg := prometheus.NewRegistry()
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil }))
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(_ context.Context, j *onceflow.Job[emailArgs]) error {
		if j.Args.To == "" {
			return onceflow.Permanent(errors.New("no address"))
		}
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t), Registerer: reg,
		Queues: map[string]onceflow.QueueConfig{"default": {}, "mail": {StatsInterval: 50 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, a := range []onceflow.JobArgs{sortArgs{}, emailArgs{To: "a@example.com"}, emailArgs{}} {
		if _, err := c.Enqueue(ctx, a, nil); err != nil {
			t.Fatal(err)
		}
	}
	runClient(t, c)
	value := func(name string, labels map[string]string) float64 { return metricValue(t, reg, name, labels) }
	testenv.WaitFor(t, 10*time.Second, "three acknowledged or dead-lettered jobs", func() bool {
		return value("onceflow_queue_acks_total", map[string]string{"queue": "default"}) == 1 &&
			value("onceflow_queue_acks_total", map[string]string{"queue": "mail"}) == 1 &&
			value("onceflow_queue_dead_lettered_total", map[string]string{"queue": "mail", "reason": "permanent"}) == 1
	})
	for q, want := range map[string]float64{"default": 1, "mail": 2} {
		if got := value("onceflow_queue_deliveries_total", map[string]string{"queue": q}); got != want {
			t.Errorf("deliveries on %s: %v, want %v", q, got, want)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "the sampled dead-letter gauge", func() bool {
		return value("onceflow_queue_dead_letters", map[string]string{"queue": "mail"}) == 1
	})
	if n, err := testutil.GatherAndCount(reg, "onceflow_queue_in_flight"); err != nil || n != 2 {
		t.Errorf("in-flight gauges: %d (%v), want one per queue", n, err)
	}
}

// metricValue returns the sum of the series of name on reg whose labels include labels,
// or -1 when there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum, found := 0.0, false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue metrics
				}
			}
			switch {
			case m.Counter != nil:
				sum, found = sum+m.Counter.GetValue(), true
			case m.Gauge != nil:
				sum, found = sum+m.Gauge.GetValue(), true
			}
		}
	}
	if !found {
		return -1
	}
	return sum
}

// The model of Config.Model is counted on Config.Registerer: a 429 then an answer in
// one delivery is two attempts at the provider (llmmetrics: one "ok"), one retry after
// the server's Retry-After, one ledger begin; the breaker's gauge is there too.
func TestModelCallsAreCountedOnTheRegisterer(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	// Without the limiter, so that the 429 is retried in-process and counted as a retry
	// (with it, the 429 pauses the model and the job waits: see limits_test.go).
	e := newModelEnv(t, fakeserver.Config{}, onceflow.Config{Registerer: reg, NoLimits: true}, func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
		_, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
		return err
	})
	e.fake.Script(fakeserver.Fault{Kind: fakeserver.Fault429, Header: http.Header{"Retry-After-Ms": {"50"}}})
	e.enqueue("Where is my parcel?")
	e.start()
	if runs := e.waitRuns(1); runs[0].err != nil {
		t.Fatalf("runs %+v, want one that succeeded", runs)
	}
	if n := e.calls(); n != 2 {
		t.Fatalf("model requests %d, want 2", n)
	}
	value := func(name string, labels map[string]string) float64 { return metricValue(t, reg, name, labels) }
	if got := value("onceflow_llm_calls_total", map[string]string{"provider": "openai"}); got != 2 {
		t.Errorf("onceflow_llm_calls_total = %v, want 2", got)
	}
	if got := value("onceflow_llm_calls_total", map[string]string{"provider": "openai", "outcome": "ok"}); got != 1 {
		t.Errorf("onceflow_llm_calls_total{outcome=ok} = %v, want 1", got)
	}
	if got := value("onceflow_llm_retries_total", map[string]string{"source": "retry_after"}); got != 1 {
		t.Errorf("onceflow_llm_retries_total{source=retry_after} = %v, want 1", got)
	}
	if got := value("onceflow_llm_ledger_begins_total", map[string]string{"provider": "openai", "outcome": "new"}); got != 1 {
		t.Errorf("onceflow_llm_ledger_begins_total{outcome=new} = %v, want 1", got)
	}
	if got := value("onceflow_breaker_open", nil); got != 0 {
		t.Errorf("onceflow_breaker_open = %v, want 0 (exported, closed)", got)
	}
}

// Client.Enqueue and Route count onceflow_queue_enqueued_total by queue, new jobs only:
// a replayed key adds nothing and counts nothing.
func TestEnqueueCountsEnqueuedJobs(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	reg := prometheus.NewRegistry()
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 2 { // the second is a replay
		if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b", "a"}}, &onceflow.EnqueueOpts{Key: "sort-1"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Enqueue(ctx, emailArgs{To: "a@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	h, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{Tenant: bearerTenants(map[string]string{"k": "acme"})})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	for range 2 { // the second is a replay
		if a := postJSON(t, srv.URL+"/v1/tickets", "k", "ticket-key-0000001", "application/json", `{"subject":"s","body":"b"}`); a.code != http.StatusAccepted {
			t.Fatalf("POST: %d %s", a.code, a.body)
		}
	}
	for q, want := range map[string]float64{onceflow.DefaultQueue: 2, "mail": 1} {
		if got := metricValue(t, reg, "onceflow_queue_enqueued_total", map[string]string{"queue": q}); got != want {
			t.Errorf("onceflow_queue_enqueued_total{queue=%q} = %v, want %v", q, got, want)
		}
		n, err := rdb.XLen(ctx, queue.Keys{Prefix: prefix, Queue: q}.Stream()).Result()
		if err != nil || float64(n) != want {
			t.Errorf("stream %s holds %d entries (%v), want %v", q, n, err, want)
		}
	}
}

// The relay Run runs exports its metrics on Config.Registerer: one effect sent counts
// one in onceflow_outbox_sent_total.
func TestRelayMetricsOnTheRegisterer(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	reg := prometheus.NewRegistry()
	rec := &keyRecorder{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(ctx context.Context, j *onceflow.Job[emailArgs]) error {
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email.reply", "reply:"+j.ID, j.Args)
			return nil
		})
	}))
	c := e.client(onceflow.Config{Workers: ws, Registerer: reg, Senders: map[string]outbox.Sender{"email.": rec},
		Queues: map[string]onceflow.QueueConfig{"mail": {}},
		Relay:  outbox.Config{PollInterval: 20 * time.Millisecond}})
	if _, err := c.Enqueue(context.Background(), emailArgs{To: "a@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "the email sent and counted", func() bool {
		return len(rec.sent()) == 1 && metricValue(t, reg, "onceflow_outbox_sent_total", nil) == 1
	})
}

// A Middleware sees the delivery's stream entry id (JobInfo.EntryID), the id XRANGE
// shows, distinct for two entries of one job id.
func TestJobInfoCarriesTheStreamEntryID(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var mu sync.Mutex
	seen := map[string]string{} // entry id -> job id
	record := func(next onceflow.JobFunc) onceflow.JobFunc {
		return func(ctx context.Context, info *onceflow.JobInfo) error {
			mu.Lock()
			seen[info.EntryID] = info.ID
			mu.Unlock()
			return next(ctx, info)
		}
	}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil }))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t), Middleware: []onceflow.Middleware{record}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 2 { // two entries of one job id
		if _, err := c.Enqueue(ctx, sortArgs{}, &onceflow.EnqueueOpts{JobID: "job-1"}); err != nil {
			t.Fatal(err)
		}
	}
	// Read the entries before the workers run: they trim acknowledged ones.
	entries, err := rdb.XRange(ctx, queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}.Stream(), "-", "+").Result()
	if err != nil || len(entries) != 2 {
		t.Fatalf("stream entries %v (%v), want 2", entries, err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "two deliveries", func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) >= 2 })
	mu.Lock()
	defer mu.Unlock()
	for _, en := range entries {
		if seen[en.ID] != "job-1" {
			t.Errorf("entry %s: middleware saw %v, want job-1 under that entry id", en.ID, seen)
		}
	}
}

// Job.Commit writes on its effects the traceparent of the Work call's context
// (Config.TraceParent) when it has one, else the one the job was enqueued with.
func TestCommitTraceParentPrefersTheWorkContext(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	const workSpan = "00-11111111111111111111111111111111-2222222222222222-01"
	type spanKey struct{}
	var runs atomic.Int64
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs),
		TraceParent: func(ctx context.Context) string { s, _ := ctx.Value(spanKey{}).(string); return s },
		Middleware: []onceflow.Middleware{func(next onceflow.JobFunc) onceflow.JobFunc {
			return func(ctx context.Context, info *onceflow.JobInfo) error {
				if info.ID == "traced" {
					ctx = context.WithValue(ctx, spanKey{}, workSpan)
				}
				return next(ctx, info)
			}
		}}})
	for _, id := range []string{"traced", "untraced"} {
		if err := deliver(c, id, refundArgs{OrderID: id, AmountCents: 100}, 1); err != nil {
			t.Fatal(err)
		}
	}
	for id, want := range map[string]string{"traced": workSpan, "untraced": testTraceParent} {
		if n := e.count(`SELECT count(*) FROM outbox WHERE dedupe_key LIKE '%:' || $1 AND traceparent = $2`, id, want); n != 2 {
			t.Errorf("job %s: %d effects carry traceparent %s, want 2", id, n, want)
		}
	}
}
