package onceflow_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// NewClient refuses a Redis client with go-redis's default options (ErrRedisOptions).
func TestNewClientChecksRedisOptions(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	if _, err := onceflow.NewClient(onceflow.Config{Redis: rdb}); !errors.Is(err, onceflow.ErrRedisOptions) {
		t.Fatalf("default go-redis options: %v, want ErrRedisOptions", err)
	}
}

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

// Without Config.Queues, a client works the default queue and the queue each
// registered kind names (emailArgs's "mail"): a worker registered for a kind is a worker
// its jobs reach, and JobState finds them.
func TestWorkerOfAKindWithItsOwnQueueRunsItsJobs(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(context.Context, *onceflow.Job[emailArgs]) error {
		runs.Add(1)
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	res, err := c.Enqueue(ctx, emailArgs{To: "ann@example.com"}, &onceflow.EnqueueOpts{Tenant: "demo"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.JobState(ctx, "demo", res.JobID); err != nil {
		t.Errorf("JobState of the job just enqueued to %q: %v (the client's queues: %v)", res.Queue, err, c.Inspector().Queues())
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "the job on the kind's own queue to run", func() bool { return runs.Load() > 0 })
	if runs.Load() != 1 {
		t.Errorf("the job on queue %q ran %d times, want 1 (the client works %v)", res.Queue, runs.Load(), c.Inspector().Queues())
	}
}

// A queue name shaped like a partition ("default:1") is refused at every entry point the
// Client has, so it cannot alias partition 1 of "default".
func TestQueueNameLikeAPartitionIsRefused(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	if _, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: onceflow.NewWorkers(),
		Queues: map[string]onceflow.QueueConfig{"default:1": {}}}); err == nil {
		t.Fatal("a QueueConfig named default:1 was accepted")
	}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, QueueDefaults: onceflow.QueueConfig{Partitions: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"x"}}, &onceflow.EnqueueOpts{Queue: "default:1"}); err == nil {
		t.Fatal("Enqueue to queue default:1 was accepted")
	}
	if n, _ := rdb.Exists(ctx, prefix+":{default:1}:stream", prefix+":{default:1:1}:stream").Result(); n != 0 {
		t.Fatal("a stream was written for queue default:1")
	}
}

// RunWorkers works only the queues it is given, and sends no effect; RunRelay sends
// them.
func TestRunWorkersAndRunRelaySeparately(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	rec := &recorder{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, j *onceflow.Job[sortArgs]) error {
		rec.add("sort")
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("test.sorted", "sorted:"+j.ID, j.Args)
			return nil
		})
	}))
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(context.Context, *onceflow.Job[emailArgs]) error {
		rec.add("email")
		return nil
	}))
	sent := &recorder{}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Workers: ws,
		Queues:  map[string]onceflow.QueueConfig{"default": {}, "mail": {}},
		Senders: map[string]outbox.Sender{"test.": outbox.SenderFunc(func(_ context.Context, m outbox.Message) error { sent.add(m.DedupeKey); return nil })},
		Logger:  testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := c.RunWorkers(ctx, "default", "nope"); !errors.Is(err, onceflow.ErrUnknownQueue) {
		t.Fatalf("RunWorkers of an unknown queue: %v, want ErrUnknownQueue", err)
	}
	res, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b", "a"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, emailArgs{To: "x@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	wctx, stopWorkers := context.WithCancel(ctx)
	wdone := make(chan error, 1)
	go func() { wdone <- c.RunWorkers(wctx, "default") }()
	waitDone(c, "", res.JobID)
	time.Sleep(300 * time.Millisecond) // a relay, if RunWorkers ran one, would have sent by now
	stopWorkers()
	if err := <-wdone; err != nil {
		t.Fatalf("RunWorkers: %v", err)
	}
	if got := strings.Join(rec.all(), ","); got != "sort" {
		t.Fatalf("RunWorkers(default) ran %q, want only the sort job (mail is not its queue)", got)
	}
	if n := len(sent.all()); n != 0 {
		t.Fatalf("RunWorkers sent %d effects, want 0 (the relay is RunRelay's)", n)
	}
	rctx, stopRelay := context.WithCancel(ctx)
	rdone := make(chan error, 1)
	go func() { rdone <- c.RunRelay(rctx) }()
	testenv.WaitFor(t, 10*time.Second, "the effect sent", func() bool { return len(sent.all()) == 1 })
	stopRelay()
	if err := <-rdone; err != nil {
		t.Fatalf("RunRelay: %v", err)
	}
	if got := sent.all(); got[0] != "sorted:"+res.JobID {
		t.Fatalf("relay sent %q", got)
	}
}

func TestRunRelayNeedsDB(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	if err := c.RunRelay(context.Background()); err == nil || !strings.Contains(err.Error(), "Config.DB") {
		t.Fatalf("RunRelay without DB: %v", err)
	}
}

// QueueDefaults.Partitions holds for every queue, also those the Client only enqueues
// to (Config.QueueDefaults, QueueConfig.Partitions: 1 to queue.MaxPartitions), so
// NewClient refuses one out of range even when every queue it works sets its own:
// otherwise an enqueue to another queue would go to partition 0 (negative) or fail
// only then (above the maximum).
func TestNewClientRefusesQueueDefaultsPartitionsOutOfRange(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	for _, n := range []int{-1, queue.MaxPartitions + 1, 100000} {
		_, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix,
			Queues:        map[string]onceflow.QueueConfig{"worked": {Partitions: 2}},
			QueueDefaults: onceflow.QueueConfig{Partitions: n}})
		if err == nil || !strings.Contains(err.Error(), "Partitions") {
			t.Errorf("QueueDefaults.Partitions %d: NewClient returned %v, want an error naming Partitions", n, err)
		}
	}
}
