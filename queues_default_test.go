package onceflow_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

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
	deadline := time.Now().Add(10 * time.Second)
	for runs.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if runs.Load() != 1 {
		t.Errorf("the job on queue %q ran %d times in 10s, want 1: the client has its kind's worker but works only %v", res.Queue, runs.Load(), c.Inspector().Queues())
	}
}
