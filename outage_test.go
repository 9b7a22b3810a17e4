package onceflow_test

import (
	"context"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// outageArgs are the arguments of a job that commits one row of its own and one effect.
type outageArgs struct {
	Order string `json:"order"`
}

func (outageArgs) Kind() string { return "outage.order" }

// PostgreSQL is down while a job tries to commit (or, first, to call the model through
// the llm_calls ledger), for longer than its queue's MaxDeliveries × ClaimIdle: every
// delivery meets the outage, is handed back without spending a delivery, and once
// PostgreSQL is back the job commits once (and calls the model once). It is not
// dead-lettered. (Before outages were told apart from failing statements, the third
// delivery dead-lettered it.)
func TestPostgresOutageDuringCommitSpendsNoDelivery(t *testing.T) {
	t.Parallel()
	for name, commit := range map[string]func(ctx context.Context, j *onceflow.Job[outageArgs]) error{
		"Complete then Commit": func(ctx context.Context, j *onceflow.Job[outageArgs]) error {
			st, err := j.Complete(ctx, "summarise", prompt("order "+j.Args.Order))
			if err != nil {
				return err
			}
			return j.Commit(ctx, func(c *onceflow.Commit) error {
				c.Exec(`INSERT INTO orders (job_id, order_id) VALUES ($1, $2)`, j.ID, st.Response.Content)
				c.Emit("email.order", "order:"+j.ID, j.Args)
				return nil
			})
		},
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
			pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
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
			// BreakerThreshold: this test is about each delivery that meets the outage; the
			// breaker that stops the deliveries is TestPostgresBreakerHoldsTheWorkersBack's.
			cfg := onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t), BreakerThreshold: 1000,
				Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: maxDeliveries, ClaimIdle: claimIdle}}}
			// The model, used by one case: fake-llm through the OpenAI adapter. A delivery
			// retries the ledger within its budget (2s) before it hands the job back.
			fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(fs)
			t.Cleanup(func() { fs.Close(); srv.Close() })
			cfg.Model = openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"})
			cfg.ModelRetry, cfg.JobBudget = fastRetry, 2*time.Second
			c, err := onceflow.NewClient(cfg)
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
			wantCalls := int64(0)
			if strings.HasPrefix(name, "Complete") {
				wantCalls = 1 // the ledger's row is written before the call: none during the outage
			}
			if got := fs.Stats().Requests; got != wantCalls {
				t.Errorf("%d model calls, want %d", got, wantCalls)
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

// Redis is down when EnqueueTx's transaction commits, for longer than the relay's
// MaxAttempts sends: every send of the outbox row fails, as Unavailable, without
// counting an attempt, and once Redis is back the relay enqueues the job, which runs
// once. The row is sent, never exhausted. (Before Redis outages were told apart, the
// row was exhausted after MaxAttempts sends and the committed job never ran.)
func TestRedisOutageNeverExhaustsEnqueueTx(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := onceflow.NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	pool, _ := testenv.Postgres(t)
	e := &dbEnv{t: t, pool: pool, rdb: rdb, prefix: testenv.Prefix(t)}
	e.exec(`CREATE TABLE orders (id text PRIMARY KEY)`)
	e.exec(`CREATE TABLE refunds (job_id text PRIMARY KEY, order_id text NOT NULL, amount_cents integer NOT NULL)`)
	var runs atomic.Int64
	reg := prometheus.NewRegistry()
	const maxAttempts = 2
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs), Registerer: reg, Relay: outbox.Config{
		MaxAttempts: maxAttempts, BackoffBase: 20 * time.Millisecond, BackoffCap: 100 * time.Millisecond,
		PollInterval: 20 * time.Millisecond,
	}})
	runClient(t, c)

	srv.Stop()
	res := e.enqueueInTx(c, refundArgs{OrderID: "o-outage", AmountCents: 100}, nil, true)
	// More failed sends than MaxAttempts (or, on the broken code, the exhaustion that
	// ends them).
	failures := func() float64 {
		return metricValue(t, reg, "onceflow_outbox_send_failures_total", nil)
	}
	testenv.WaitFor(t, 90*time.Second, "failed sends during the outage", func() bool {
		return failures() >= 3*maxAttempts || e.count(`SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`) > 0
	})
	if n := e.count(`SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`); n != 0 {
		t.Fatalf("the enqueue row was exhausted during the outage, after %v failed sends", failures())
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND attempts = 0 AND sent_at IS NULL`, onceflow.TopicEnqueue); n != 1 {
		t.Fatal("during the outage: want the enqueue row unsent with no attempt counted")
	}
	during := failures()
	srv.Start()

	// The relay marks the enqueue row sent after the enqueue: the job may run and commit
	// in between, so the wait covers the mark too.
	testenv.WaitFor(t, 90*time.Second, "the job's commit after the outage, and its enqueue row marked sent", func() bool {
		n, _, _ := e.effects(res.JobID)
		return n == 1 && e.pending() == 0 &&
			e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL`, onceflow.TopicEnqueue) == 1
	})
	if got := metricValue(t, reg, "onceflow_outbox_send_failures_total", map[string]string{"class": "unavailable"}); got < during {
		t.Errorf("send_failures_total{class=unavailable} %v, want the %v failures of the outage", got, during)
	}
	completions, refunds, effects := e.effects(res.JobID)
	sent := e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL AND exhausted_at IS NULL`, onceflow.TopicEnqueue)
	if completions != 1 || refunds != 1 || effects != 2 || sent != 1 || runs.Load() != 1 || e.added() != 1 {
		t.Fatalf("after the outage: %d completions, %d refunds, %d effects, %d enqueue rows sent, %d runs, %d entries added; want 1, 1, 2, 1, 1, 1",
			completions, refunds, effects, sent, runs.Load(), e.added())
	}
	t.Logf("%v failed sends during the outage", during)
}
