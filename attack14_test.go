package onceflow_test

// Attack tests on issue 14's work, from the onceflow package's side. Each fails on the
// code it was written against, for the defect its comment names.

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
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
