package onceflow_test

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// On a clean system Audit says what it read and finds nothing; a dead letter of a
// completed job and an effect no sender ever took are violations.
func TestAuditChecksEveryKindAndQueue(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, j *onceflow.Job[sortArgs]) error {
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("nobody.sends", "sorted:"+j.ID, j.Args) // no sender in this process
			return nil
		})
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Workers: ws,
		Queues: map[string]onceflow.QueueConfig{"default": {}, "mail": {MaxDeliveries: 1, ClaimIdle: 300 * time.Millisecond}}, AuditMaxAge: time.Hour, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := c.Audit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"queue default", "queue mail", "job_completions", "outbox"} {
		if !slices.Contains(r.Checked, want) {
			t.Errorf("Checked %q lacks %q", r.Checked, want)
		}
	}
	if !r.OK() || r.Counts["job_completions"] != 0 {
		t.Fatalf("clean system: %+v", r)
	}

	// One job done with its effect waiting; one of an unknown kind dead-lettered.
	done, err := c.Enqueue(ctx, sortArgs{Strings: []string{"a"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dead, err := c.Enqueue(ctx, undeclaredArgs{}, &onceflow.EnqueueOpts{Queue: "mail"})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	waitDone(c, "", done.JobID)
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool {
		st, err := c.JobState(ctx, "", dead.JobID)
		return err == nil && st.Status == onceflow.StatusFailed
	})
	r, err = c.Audit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK() || r.Counts["job_completions"] != 1 || r.Counts["job_completions sort"] != 1 ||
		r.Counts["queue mail dead"] != 1 || r.Counts["outbox unsent"] != 1 {
		t.Fatalf("one job done, one dead letter, young effect: %+v", r)
	}

	// Plant: the dead-lettered job has a completion record; the effect is two hours old.
	if _, err := pool.Exec(ctx, `INSERT INTO job_completions (job_id, kind) VALUES ($1, 'nobody.runs.this')`, dead.JobID); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox SET created_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	r, err = c.Audit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Violations) != 2 || r.OK() {
		t.Fatalf("want 2 violations, got %q", r.Violations)
	}
	all := strings.Join(r.Violations, "\n")
	if !strings.Contains(all, "queue mail: dead letters of completed jobs") || !strings.Contains(all, dead.JobID) ||
		!strings.Contains(all, "nobody.sends sorted:"+done.JobID+" (unsent)") {
		t.Fatalf("violations:\n%s", all)
	}
}

// Without a DB, Audit reads only the queues, and says so.
func TestAuditWithoutDBChecksOnlyQueues(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	r, err := c.Audit(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(r.Checked, []string{"queue default"}) {
		t.Fatalf("Checked %q, want only the queue", r.Checked)
	}
}

func TestNewClientRefusesNegativeAuditMaxAge(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	_, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, AuditMaxAge: -time.Second})
	if err == nil || !strings.Contains(err.Error(), "AuditMaxAge") {
		t.Fatalf("negative AuditMaxAge: %v", err)
	}
}

// A run that has held its entry for longer than any run may take, its lease kept fresh
// by renewals (a worker whose runs are unbounded, MaxRunTime negative, while its queue's
// settings say 100ms), never looks idle; Audit reports it by its start.
func TestAuditReportsRunsHeldLongerThanMaxRunTime(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxRunTime: 100 * time.Millisecond, ClaimIdle: 150 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	release := make(chan struct{})
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, MaxRunTime: -1, ClaimIdle: 150 * time.Millisecond,
		RenewInterval: 30 * time.Millisecond, Logger: testenv.Logger(t),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { <-release; return nil })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = w.Run(wctx); close(done) }()
	t.Cleanup(func() { close(release); stop(); <-done })
	m := queue.Message{JobID: "audit-long-1", Kind: "k", Tenant: "acme", Payload: []byte(`{}`)}
	if _, err := queue.Enqueue(ctx, rdb, keys, m); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the run holds its entry, renewed, well past 100ms + 2 x 150ms
	r, err := c.Audit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Violations) != 1 || !strings.Contains(r.Violations[0], "MaxRunTime") {
		t.Fatalf("violations %q, want one naming the run held past MaxRunTime", r.Violations)
	}
	if stale, err := queue.StalePending(ctx, rdb, keys, queue.DefaultGroup, 300*time.Millisecond, 10); err != nil || len(stale) != 0 {
		t.Fatalf("StalePending = %v %v: the renewed entry should not look idle (that is the point)", stale, err)
	}
}

// Audit's MaxRunTime check measures a run from when its attempt began, not from when its
// job was added to the stream: a job that waited in a backlog longer than MaxRunTime +
// 2 x ClaimIdle (an outage's backlog) is no violation the moment a worker starts a
// healthy run of it.
func TestAuditDoesNotFlagAHealthyRunOfABackloggedJob(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var started atomic.Bool
	release := make(chan struct{})
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, _ *onceflow.Job[sortArgs]) error {
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
	if _, err := c.Enqueue(ctx, sortArgs{}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
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
