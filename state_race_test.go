package onceflow_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

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
// second read of the index tells a finished job from one that waits. This failed 1 in
// about 100 runs of TestRateLimitedCallSpendsNoAttempt before JobState read the index
// again.
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
