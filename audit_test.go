package onceflow_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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

// An entry whose attempt began long ago but whose lease is kept fresh (a hung run that
// still renews) never looks idle; Audit reports it by its age.
func TestAuditReportsEntriesPendingSinceLongAgo(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	ctx := context.Background()
	keys := c.QueueKeys(onceflow.DefaultQueue)
	if err := queue.CreateGroup(ctx, rdb, keys, queue.DefaultGroup); err != nil {
		t.Fatal(err)
	}
	// An entry added an hour ago (its id says so), delivered just now: pending, not idle.
	old := strconv.FormatInt(time.Now().Add(-time.Hour).UnixMilli(), 10) + "-0"
	m := queue.Message{JobID: "audit-old-1", Kind: "k", Tenant: "acme", Payload: []byte(`{}`), EnqueuedAt: time.Now().Add(-time.Hour)}
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), ID: old, Values: m.Values()}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: queue.DefaultGroup, Consumer: "hung", Streams: []string{keys.Stream(), ">"}, Count: 1}).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := c.Audit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Violations) != 1 || !strings.Contains(r.Violations[0], old) || !strings.Contains(r.Violations[0], "MaxRunTime") {
		t.Fatalf("violations %q, want one naming the hour-old entry %s", r.Violations, old)
	}
}
