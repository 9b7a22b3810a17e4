package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/queue"
)

// A job goes queued, running, done in JobState, whether it finished with a Commit (done,
// with its result and completion time) or without one (done once acknowledged, with
// neither), and a done job names its queue as a queued one does.
func TestJobStateFollowsAJobToDone(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	release := make(chan struct{})
	var started atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, _ *onceflow.Job[sortArgs]) error {
		started.Add(1)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil // no Commit
	}))
	var runs atomic.Int64
	onceflow.AddWorker(ws, refundWorker(&runs))
	c := e.client(onceflow.Config{Workers: ws, Queues: map[string]onceflow.QueueConfig{"default": {}, "payments": {}}})
	ctx := context.Background()
	plain, err := c.Enqueue(ctx, sortArgs{Strings: []string{"a"}}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	committed, err := c.Enqueue(ctx, refundArgs{OrderID: "o-9", AmountCents: 300}, &onceflow.EnqueueOpts{Tenant: "acme", Queue: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	state := func(id string) *onceflow.JobState {
		t.Helper()
		st, err := c.JobState(ctx, "acme", id)
		if err != nil {
			t.Fatalf("JobState %s: %v", id, err)
		}
		return st
	}
	trips := &roundtrip.Counter{}
	e.rdb.AddHook(trips)
	if st := state(plain.JobID); st.Status != onceflow.StatusQueued || st.Queue != "default" {
		t.Fatalf("before any worker: %+v, want queued on default", st)
	}
	// The job index, then the entry's pending record and the group's last delivered id
	// in one pipeline (queue.EntryState): two Redis round trips for a job on the first
	// queue looked in.
	if n := trips.Redis(); n != 2 {
		t.Fatalf("JobState of a queued job cost %d Redis round trips, want 2", n)
	}
	if st := state(committed.JobID); st.Status != onceflow.StatusQueued || st.Queue != "payments" {
		t.Fatalf("before any worker: %+v, want queued on payments", st)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "the plain job to start", func() bool { return started.Load() == 1 })
	if st := state(plain.JobID); st.Status != onceflow.StatusRunning {
		t.Fatalf("while its worker holds it: %+v, want running", st)
	}
	close(release)
	testenv.WaitFor(t, 10*time.Second, "both jobs done", func() bool {
		return state(plain.JobID).Status == onceflow.StatusDone && state(committed.JobID).Status == onceflow.StatusDone
	})
	if st := state(plain.JobID); st.Queue != "default" || st.Result != nil || !st.CompletedAt.IsZero() {
		t.Fatalf("done without a Commit: %+v, want queue default, no result, no completion time", st)
	}
	st := state(committed.JobID)
	if st.Queue != "payments" || st.Kind != "refund.issue" || string(st.Result) != `{"refunded_cents": 300}` || st.CompletedAt.IsZero() {
		t.Fatalf("done with a Commit: %+v, want queue payments, its kind, result and completion time", st)
	}
	if _, err := c.JobState(ctx, "globex", plain.JobID); err != onceflow.ErrJobNotFound {
		t.Fatalf("another tenant: %v, want ErrJobNotFound", err)
	}
}

// An enqueue-only Client (no Workers, the API half of a split deployment) finds a job
// it enqueued to a queue it does not run (a kind whose arguments name their queue,
// JobArgsWithOpts): JobState looks in the queue the job went to, so StateHandler never
// tells the job's own tenant 404 for a job it has just accepted.
func TestJobStateFindsAJobOnAQueueTheClientDoesNotRun(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	ctx := context.Background()
	res, err := c.Enqueue(ctx, emailArgs{To: "ann@example.com"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	if n := rdb.XLen(ctx, c.Inspector().QueueKeys(res.Queue).Stream()).Val(); res.Queue != "mail" || n != 1 {
		t.Fatalf("enqueued to %q (%d entries), want mail", res.Queue, n)
	}
	st, err := c.JobState(ctx, "acme", res.JobID)
	if err != nil || st.Status != onceflow.StatusQueued || st.Queue != "mail" {
		t.Fatalf("JobState of the job the client just enqueued to %q: %+v, %v; want queued on mail", res.Queue, st, err)
	}
}

// JobState finds a job in any partition the queue recorded, as its own tenant's only.
func TestJobStateAcrossPartitions(t *testing.T) {
	t.Parallel()
	// The same explicit job id held by two tenants in two partitions (N changed between
	// them): each tenant's JobState finds its own job, and a third tenant finds none.
	t.Run("keeps tenants apart", func(t *testing.T) {
		t.Parallel()
		e := newDBEnv(t)
		ctx := context.Background()
		var id string
		for i := range 1000 {
			id = fmt.Sprintf("twin-%d", i)
			if queue.PartitionOf(id, 3) != 0 {
				break
			}
		}
		one := e.client(onceflow.Config{})
		if _, err := one.Enqueue(ctx, sortArgs{Strings: []string{"a"}}, &onceflow.EnqueueOpts{Tenant: "acme", JobID: id}); err != nil {
			t.Fatal(err)
		}
		three := e.client(onceflow.Config{QueueDefaults: onceflow.QueueConfig{Partitions: 3}})
		if _, err := three.Enqueue(ctx, sortArgs{Strings: []string{"b"}}, &onceflow.EnqueueOpts{Tenant: "globex", JobID: id}); err != nil && !errors.Is(err, onceflow.ErrJobIDTaken) {
			t.Fatal(err)
		}
		for _, c := range []*onceflow.Client{one, three} {
			for _, tenant := range []string{"acme", "globex"} {
				st, err := c.JobState(ctx, tenant, id)
				if err != nil {
					if tenant == "globex" && errors.Is(err, onceflow.ErrJobNotFound) {
						continue // refused at enqueue
					}
					t.Fatalf("JobState(%s): %v", tenant, err)
				}
				if st.Tenant != tenant {
					t.Fatalf("JobState(%s) gave %s's job", tenant, st.Tenant)
				}
			}
			if _, err := c.JobState(ctx, "initech", id); !errors.Is(err, onceflow.ErrJobNotFound) {
				t.Fatalf("a third tenant: %v, want ErrJobNotFound", err)
			}
		}
	})
	// An operator lowers the record by hand as docs/queue.md tells (HSET P:partitions Q N)
	// and mistypes it ("2 "): JobState of an unknown id answers ErrJobNotFound (404), not an
	// error (a 503 to the API's caller).
	t.Run("a malformed partitions record is no job", func(t *testing.T) {
		t.Parallel()
		e := newDBEnv(t)
		ctx := context.Background()
		c := e.client(onceflow.Config{QueueDefaults: onceflow.QueueConfig{Partitions: 2}})
		if err := e.rdb.HSet(ctx, queue.PartitionsKey(e.prefix), onceflow.DefaultQueue, "2 ").Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.JobState(ctx, "acme", "no-such-job"); !errors.Is(err, onceflow.ErrJobNotFound) {
			t.Fatalf("JobState of an unknown id with a malformed partitions record: %v; want ErrJobNotFound", err)
		}
	})
}

// entryStateGate holds JobState's second read (the entry's pending record and its
// group, one pipeline) until before returns: the place where a delivery settled
// between JobState's two reads.
type entryStateGate struct {
	armed  atomic.Bool
	before func()
}

func (g *entryStateGate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *entryStateGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}

func (g *entryStateGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && cmds[0].Name() == "xpending" && g.armed.CompareAndSwap(true, false) {
			g.before()
		}
		return next(ctx, cmds)
	}
}

// A job whose delivery is settled as waiting (here a Snooze; a retry or a limiter's wait
// is the same script) between JobState's read of its index and its read of the entry is
// not reported done: the entry the index named is acknowledged by then, and only a
// second read of the index tells a finished job from one that waits.
func TestJobStateOfADeliverySettledBetweenItsReadsIsNotDone(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	release := make(chan struct{})
	var started atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, _ *onceflow.Job[sortArgs]) error {
		if started.Add(1) > 1 {
			return nil
		}
		select {
		case <-release:
			return onceflow.Snooze(time.Hour)
		case <-ctx.Done():
			return ctx.Err()
		}
	}))
	worker := e.client(onceflow.Config{Workers: ws})
	ctx := context.Background()
	res, err := worker.Enqueue(ctx, sortArgs{Strings: []string{"b", "a"}}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, worker)
	testenv.WaitFor(t, 10*time.Second, "the job to start", func() bool { return started.Load() == 1 })

	// JobState through a Redis client of its own, whose entry read waits until the
	// worker has settled the delivery.
	opts := *e.rdb.Options()
	opts.MaxRetries = -1
	own := redis.NewClient(&opts)
	t.Cleanup(func() { _ = own.Close() })
	keys := queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}
	gate := &entryStateGate{before: func() {
		close(release)
		testenv.WaitFor(t, 10*time.Second, "the delivery to be settled", func() bool {
			state, _ := e.rdb.HGet(ctx, keys.Job(res.JobID), "state").Result()
			return state == queue.StateScheduled
		})
	}}
	gate.armed.Store(true)
	own.AddHook(gate)
	reader, err := onceflow.NewClient(onceflow.Config{Redis: own, DB: e.pool, Prefix: e.prefix, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	st, err := reader.JobState(ctx, "acme", res.JobID)
	if err != nil {
		t.Fatal(err)
	}
	if gate.armed.Load() {
		t.Fatal("JobState never read the entry: the test did not reach the race it is about")
	}
	if st.Status != onceflow.StatusQueued || st.RunAt.Before(time.Now().Add(50*time.Minute)) {
		t.Fatalf("a snoozed job read while it was settled: %+v, want queued, running in an hour", st)
	}
	if started.Load() != 1 {
		t.Fatalf("%d runs, want 1", started.Load())
	}
}

// StateHandler answers "503 with Retry-After when a store does not answer" within a
// bound like Route's (RouteConfig.Timeout), even with PostgreSQL hung (paused, as a hung
// host or a partition looks), on which pgx would wait for ever on an established
// connection: a poll of a job's state never holds a goroutine, a server connection and
// one of the pool's connections (which the workers' commits share) until the client
// gives up.
func TestStateHandlerAnswersWhilePostgresHangs(t *testing.T) {
	t.Parallel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "")
	rdb, prefix := testenv.Redis(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	tenant := func(*http.Request) (string, error) { return "acme", nil }
	mux := http.NewServeMux()
	mux.Handle("GET /v1/jobs/{job_id}", onceflow.StateHandler(c, tenant))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	hc := &http.Client{Timeout: 30 * time.Second}
	get := func() (int, error) {
		resp, err := hc.Get(srv.URL + "/v1/jobs/job-1")
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if code, err := get(); err != nil || code != http.StatusNotFound {
		t.Fatalf("before the hang: %d %v, want 404", code, err)
	}
	resume := pg.Pause()
	code, err := get()
	resume()
	if err != nil || code != http.StatusServiceUnavailable {
		t.Fatalf("GET of a job's state while PostgreSQL hangs: %d %v; want 503 with Retry-After long before the client's 30s", code, err)
	}
}
