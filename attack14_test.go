package onceflow_test

// Attack tests on issue 14's work, from the onceflow package's side. Each fails on the
// code it was written against, for the defect its comment names.

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

type attackArgs struct {
	Mode string `json:"mode"`
}

func (attackArgs) Kind() string { return "attack14.job" }

// FINDING (operator, audit during a backlog): Audit's invariant 2 reports "stream
// entries still pending although their attempt began longer ago than MaxRunTime + 2 x
// ClaimIdle", but queue.OldPending measures the age of the entry id, that is when the
// job was ADDED to the stream, not when its attempt began. A job that waited in a
// backlog longer than MaxRunTime + 2 x ClaimIdle (19m by default: an outage's backlog)
// is reported as a violation the moment a worker starts a healthy run of it.
//
// Expected: a run that began recently (well within MaxRunTime) is no violation, however
// long the job waited before it.
func TestAttack14AuditDoesNotFlagAHealthyRunOfABackloggedJob(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var started atomic.Bool
	release := make(chan struct{})
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[attackArgs](func(ctx context.Context, _ *onceflow.Job[attackArgs]) error {
		started.Store(true)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t), Workers: ws,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxRunTime: 5 * time.Second, ClaimIdle: 500 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, attackArgs{}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(6500 * time.Millisecond) // the backlog: longer than MaxRunTime + 2 x ClaimIdle (6s)
	runClient(t, c)
	defer close(release)
	testenv.WaitFor(t, 10*time.Second, "the run", started.Load)
	time.Sleep(200 * time.Millisecond) // the run is 200ms old, MaxRunTime is 5s
	r, err := c.Audit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range r.Violations {
		if strings.Contains(v, "MaxRunTime") {
			t.Errorf("audit reports a run that began 200ms ago: %s", v)
		}
	}
}

// FINDING (operator, PostgreSQL down when a spent job's completion must be checked): a
// job with MaxDeliveries 1 whose handler fails (without touching PostgreSQL) spends its
// budget; the client's handler is asked whether it completed, cannot tell (PostgreSQL is
// down), and the worker hands the job back, re-added with the attempts it had before the
// failure. So the job is not spent any more: the Worker runs it again during the
// outage, and again after every hand-back (about 150 runs in 5s with the default
// breakers: the PostgreSQL breaker opens only after 5 failing health checks 2s apart,
// and the completion check's own errors do not count toward it; once it closes again
// the job runs once more anyway). docs/queue.md says a spent job
// whose completion is unknown is handed back "rather than bury it on a guess", not that
// it gets a new budget.
//
// Expected: exactly MaxDeliveries runs; the completion question is repeated, the run is
// not; once PostgreSQL answers (no completion) the job is dead-lettered.
func TestAttack14SpentJobIsNotRerunWhilePostgresIsDown(t *testing.T) {
	t.Parallel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	rdb, prefix := testenv.Redis(t)
	var runs atomic.Int64
	var failing atomic.Bool
	failing.Store(true)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[attackArgs](func(context.Context, *onceflow.Job[attackArgs]) error {
		if runs.Add(1) == 1 {
			pg.Stop() // the store goes down while the run fails
		}
		return errors.New("boom")
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: 1, ClaimIdle: time.Hour, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, attackArgs{}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 20*time.Second, "the first run", func() bool { return runs.Load() >= 1 })
	time.Sleep(5 * time.Second) // PostgreSQL stays down
	during := runs.Load()
	pg.Start()
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	testenv.WaitFor(t, 60*time.Second, "the dead letter", func() bool { return rdb.XLen(ctx, keys.Dead()).Val() == 1 })
	if n := runs.Load(); n != 1 {
		t.Errorf("the job ran %d times (%d during a 5s PostgreSQL outage), want 1: MaxDeliveries is 1", n, during)
	}
}

// FINDING (new user reading the docs): two texts still describe the budget before
// issue 14. docs/coming-from-river-asynq.md's design notes say "A delivery budget rather
// than an attempt count with backoff: the queue's MaxDeliveries and ClaimIdle bound how
// often and how soon a job runs again", while the queue now counts failed attempts and
// waits a full-jitter backoff (RetryBase, RetryMax), not ClaimIdle. Job.Delivery's doc
// comment (job.go) says it "counts the deliveries of this job's stream entry", while it
// is the attempt number across entries: 1 + the attempts spent (a retry is a new entry;
// a snooze keeps the number), as the same doc's table says.
//
// Expected: neither text contradicts docs/queue.md "Attempts and retries".
func TestAttack14DocsDescribeTheAttemptBudget(t *testing.T) {
	t.Parallel()
	for file, stale := range map[string]string{
		"docs/coming-from-river-asynq.md": "`MaxDeliveries` and `ClaimIdle` bound how often and how soon a job runs again",
		"job.go":                          "Delivery counts the deliveries of this job's stream entry",
	} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.Join(strings.Fields(strings.ReplaceAll(string(b), "//", "")), " "), stale) {
			t.Errorf("%s still says %q", file, stale)
		}
	}
}
