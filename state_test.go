package onceflow_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
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
