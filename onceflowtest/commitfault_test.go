package onceflowtest_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// refundJob is a job with a recorded step (the refund) and an effect (the reply).
type refundJob struct {
	Order string `json:"order"`
}

func (refundJob) Kind() string { return "refund" }

// refundWorkers counts how often the refund ran and how often the job tried to commit.
func refundWorkers(refunds, attempts *atomic.Int64) *onceflow.Workers {
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[refundJob](func(ctx context.Context, job *onceflow.Job[refundJob]) error {
		id, err := onceflow.Do(ctx, job, "refund", func(ctx context.Context) (int64, error) { return refunds.Add(1), nil })
		if err != nil {
			return err
		}
		attempts.Add(1)
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("replies", "reply:"+job.ID, map[string]any{"order": job.Args.Order, "refund": id})
			return nil
		})
	}))
	return workers
}

var fastRetry = map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Second, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond}}

// The job's first commit fails and nothing of it is written; the next delivery replays
// the recorded refund and commits once: one refund, one reply. Other jobs' commits go
// through the first time.
func TestFailFirstCommitFailsOnlyThatJobsFirstCommit(t *testing.T) {
	t.Parallel()
	var refunds, attempts atomic.Int64
	sink := onceflowtest.NewSink(t)
	env := onceflowtest.New(t, onceflow.Config{Workers: refundWorkers(&refunds, &attempts), Queues: fastRetry,
		Senders: map[string]outbox.Sender{"replies": sink.Sender(t, nil)}})
	failing := onceflow.JobID(onceflow.EnqueueScope("", "refund", "order-A-1"))
	fault := onceflowtest.FailFirstCommit(t, env.DB, failing)
	ctx := context.Background()
	other, err := env.Client.Enqueue(ctx, refundJob{Order: "B-2"}, &onceflow.EnqueueOpts{Key: "order-B-2"})
	if err != nil {
		t.Fatal(err)
	}
	env.Start()
	onceflowtest.WaitFor(t, 20*time.Second, "the other job done", func() bool { return onceflowtest.Completions(t, env.DB, "refund") == 1 })
	if n := fault.Commits(t); n != 0 {
		t.Fatalf("the fault counted %d commits of another job (%s)", n, other.JobID)
	}
	res, err := env.Client.Enqueue(ctx, refundJob{Order: "A-1"}, &onceflow.EnqueueOpts{Key: "order-A-1"})
	if err != nil {
		t.Fatal(err)
	}
	if res.JobID != failing {
		t.Fatalf("job id %s, want %s", res.JobID, failing)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "both replies", func() bool { return sink.Total() == 2 })
	if n := fault.Commits(t); n != 2 {
		t.Fatalf("%d commits of the job, want the failed one and the next", n)
	}
	if r, a := refunds.Load(), attempts.Load(); r != 2 || a != 3 {
		t.Fatalf("%d refunds, %d commit attempts; want 2 (one per job) and 3 (one failed)", r, a)
	}
	if n := env.OutboxRows("replies"); n != 2 {
		t.Fatalf("%d replies in the outbox, want 2", n)
	}
	if n := onceflowtest.Completions(t, env.DB, "refund"); n != 2 {
		t.Fatalf("%d completions, want 2", n)
	}
}

// A job id with a quote in it is matched as it is, not read as SQL.
func TestFailFirstCommitTakesAnyJobID(t *testing.T) {
	t.Parallel()
	db, _ := onceflowtest.Postgres(t)
	const id = `it's "odd"; DROP TABLE job_completions; --`
	fault := onceflowtest.FailFirstCommit(t, db, id)
	ctx := context.Background()
	insert := `INSERT INTO job_completions (job_id, kind) VALUES ($1, 'k')`
	if _, err := db.Exec(ctx, insert, id); err == nil {
		t.Fatal("the first insert of the job's completion went through")
	}
	if _, err := db.Exec(ctx, insert, id); err != nil {
		t.Fatalf("the second: %v", err)
	}
	if n := fault.Commits(t); n != 2 {
		t.Fatalf("%d commits counted, want 2", n)
	}
}
