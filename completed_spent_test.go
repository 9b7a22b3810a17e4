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

type spentArgs struct {
	Order string `json:"order"`
}

func (spentArgs) Kind() string { return "spent.order" }

// The reproduction: a job whose delivery number MaxDeliveries committed its
// rows and its effect, then its worker died before the XACK (the count set with XCLAIM
// RETRYCOUNT). The next claim does not dead-letter it: the client's handler finds its
// completion record, the job is acknowledged, its status is done, and audit holds.
func TestCommittedJobWithASpentBudgetIsNotDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE spent_orders (job_id text PRIMARY KEY, order_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[spentArgs](func(ctx context.Context, j *onceflow.Job[spentArgs]) error {
		runs.Add(1)
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO spent_orders (job_id, order_id) VALUES ($1, $2)`, j.ID, j.Args.Order)
			c.Emit("email.order", "order:"+j.ID, j.Args)
			return nil
		})
	}))
	const maxDeliveries = 3
	cfg := onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: maxDeliveries, ClaimIdle: 200 * time.Millisecond}}}
	c, err := onceflow.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.Enqueue(ctx, spentArgs{Order: "o-1"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	if err := queue.CreateGroup(ctx, rdb, keys, queue.DefaultGroup); err != nil {
		t.Fatal(err)
	}
	// Delivery number MaxDeliveries to a worker that commits and dies before the XACK.
	read, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: queue.DefaultGroup, Consumer: "dead", Streams: []string{keys.Stream(), ">"}, Count: 1}).Result()
	if err != nil {
		t.Fatal(err)
	}
	entry := read[0].Messages[0]
	msg, err := queue.ParseMessage(entry.Values)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Inspector().Handler(onceflow.DefaultQueue).Handle(ctx, &queue.Job{Message: msg, ID: entry.ID, Deliveries: maxDeliveries}); err != nil {
		t.Fatalf("the committing run: %v", err)
	}
	if err := rdb.Do(ctx, "XCLAIM", keys.Stream(), queue.DefaultGroup, "dead", 0, entry.ID, "IDLE", 3_600_000, "RETRYCOUNT", maxDeliveries, "JUSTID").Err(); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 15*time.Second, "the entry to be settled", func() bool {
		p, err := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Result()
		return err == nil && p.Count == 0
	})
	if d, _, err := queue.ListDead(ctx, rdb, keys, "", 10); err != nil || len(d) != 0 {
		t.Fatalf("dead letters %+v %v: a committed job was dead-lettered", d, err)
	}
	st, err := c.JobState(ctx, "acme", res.JobID)
	if err != nil || st.Status != onceflow.StatusDone {
		t.Errorf("JobState = %+v %v, want done", st, err)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the worker ran %d times, want 1 (the committing run)", n)
	}
	var rows, emails int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM spent_orders`).Scan(&rows)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE topic = 'email.order'`).Scan(&emails)
	if rows != 1 || emails != 1 {
		t.Errorf("%d rows and %d emails, want 1 each", rows, emails)
	}
	rep, err := c.Audit(ctx)
	if err != nil || !rep.OK() {
		t.Errorf("audit %+v %v, want OK", rep, err)
	}
}
