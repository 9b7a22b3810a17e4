package onceflow_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/queue"
)

// outageArgs are the arguments of a job that commits one row of its own and one effect.
type outageArgs struct {
	Order string `json:"order"`
}

func (outageArgs) Kind() string { return "outage.order" }

// PostgreSQL is down while a job tries to commit, for longer than its queue's
// MaxDeliveries × ClaimIdle: every delivery meets the outage, is handed back without
// spending a delivery, and once PostgreSQL is back the job commits once. It is not
// dead-lettered. (Before outages were told apart from failing statements, the third
// delivery dead-lettered it.)
func TestPostgresOutageDuringCommitSpendsNoDelivery(t *testing.T) {
	t.Parallel()
	for name, commit := range map[string]func(ctx context.Context, j *onceflow.Job[outageArgs]) error{
		"Commit": func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
			return j.Commit(ctx, func(c *onceflow.Commit) error {
				c.Exec(`INSERT INTO orders (job_id, order_id) VALUES ($1, $2)`, j.ID, j.Args.Order)
				c.Emit("email.order", "order:"+j.ID, j.Args)
				return nil
			})
		},
		"CommitTx": func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
			return j.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
				var n int
				if err := tx.QueryRow(ctx, `SELECT count(*) FROM orders WHERE order_id = $1`, j.Args.Order).Scan(&n); err != nil {
					return err
				}
				c.Exec(`INSERT INTO orders (job_id, order_id) VALUES ($1, $2)`, j.ID, j.Args.Order)
				c.Emit("email.order", "order:"+j.ID, j.Args)
				return nil
			})
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			pg := testenv.PrivatePostgres(t)
			url := testenv.PostgresURLOf(pg) + "&connect_timeout=1"
			if _, err := migrations.Up(ctx, url, testenv.Logger(t)); err != nil {
				t.Fatal(err)
			}
			pool, err := onceflow.NewPostgres(ctx, url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			if _, err := pool.Exec(ctx, `CREATE TABLE orders (job_id text PRIMARY KEY, order_id text NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			rdb, prefix := testenv.Redis(t)

			var runs atomic.Int64
			ws := onceflow.NewWorkers()
			onceflow.AddWorker(ws, onceflow.WorkFunc[outageArgs](func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
				runs.Add(1)
				return commit(ctx, j)
			}))
			const maxDeliveries, claimIdle = 2, 300 * time.Millisecond
			c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
				Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: maxDeliveries, ClaimIdle: claimIdle}}})
			if err != nil {
				t.Fatal(err)
			}
			keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
			dead := func() int64 {
				n, err := rdb.XLen(ctx, keys.Dead()).Result()
				if err != nil {
					t.Fatal(err)
				}
				return n
			}

			pg.Stop()
			res, err := c.Enqueue(ctx, outageArgs{Order: "o-1"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			runClient(t, c)
			// More deliveries than MaxDeliveries, each handed back after meeting the
			// outage (or, on the broken code, the dead letter that ends them).
			const outageRuns = 3 * maxDeliveries
			testenv.WaitFor(t, 90*time.Second, "deliveries during the outage", func() bool {
				return runs.Load() >= outageRuns || dead() > 0
			})
			if n := dead(); n != 0 {
				t.Fatalf("the job was dead-lettered during the outage after %d runs", runs.Load())
			}
			during := runs.Load()
			pg.Start()

			count := func(sql string, args ...any) int {
				t.Helper()
				var n int
				if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			testenv.WaitFor(t, 90*time.Second, "the job's commit after the outage", func() bool {
				var n int
				err := pool.QueryRow(ctx, `SELECT count(*) FROM job_completions WHERE job_id = $1`, res.JobID).Scan(&n)
				return err == nil && n == 1 && pendingOf(ctx, rdb, keys) == 0
			})
			completions := count(`SELECT count(*) FROM job_completions WHERE job_id = $1`, res.JobID)
			rows := count(`SELECT count(*) FROM orders WHERE job_id = $1`, res.JobID)
			effects := count(`SELECT count(*) FROM outbox WHERE dedupe_key = $1`, "order:"+res.JobID)
			if completions != 1 || rows != 1 || effects != 1 || dead() != 0 {
				t.Fatalf("after the outage: %d completions, %d rows, %d effects, %d dead letters; want 1, 1, 1, 0",
					completions, rows, effects, dead())
			}
			t.Logf("%d runs during the outage, %d in all", during, runs.Load())
		})
	}
}

// pendingOf returns the unacknowledged entries of keys' stream (-1 on error).
func pendingOf(ctx context.Context, rdb *redis.Client, keys queue.Keys) int64 {
	p, err := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Result()
	if err != nil {
		return -1
	}
	return p.Count
}
