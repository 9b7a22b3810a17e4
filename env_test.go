package onceflow_test

// The tests' environment: the job kinds they share, Clients on a test's own Redis key
// prefix (testenv.Redis) and PostgreSQL schema (testenv.Postgres), and readers of what a
// Client wrote (stream entries, HTTP answers, metrics).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// sortArgs is a job kind of the default queue.
type sortArgs struct {
	Strings []string `json:"strings"`
}

func (sortArgs) Kind() string { return "sort" }

// emailArgs is a job kind of its own queue, "mail".
type emailArgs struct {
	To string `json:"to"`
}

func (emailArgs) Kind() string { return "email.send" }

// EnqueueOpts sends every email job to its own queue.
func (emailArgs) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "mail"} }

// undeclaredArgs is a job kind no worker knows.
type undeclaredArgs struct{}

func (undeclaredArgs) Kind() string { return "nobody.runs.this" }

// refundArgs are the arguments of a job that refunds an order: a row of the user's own
// (refunds), a payment effect and an email effect, committed once.
type refundArgs struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
}

func (refundArgs) Kind() string { return "refund.issue" }

// refundWorker commits the refund row, its two effects and a result with Job.Commit.
func refundWorker(runs *atomic.Int64) onceflow.WorkFunc[refundArgs] {
	return func(ctx context.Context, j *onceflow.Job[refundArgs]) error {
		runs.Add(1)
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO refunds (job_id, order_id, amount_cents) VALUES ($1, $2, $3)`, j.ID, j.Args.OrderID, j.Args.AmountCents)
			c.Emit("payments.refund", "refund:"+j.ID, j.Args)
			c.Emit("email.reply", "reply:"+j.ID, map[string]string{"to": "customer@example.com"})
			c.Result(map[string]int{"refunded_cents": j.Args.AmountCents})
			return nil
		})
	}
}

// refundWorkers returns Workers with refundWorker.
func refundWorkers(runs *atomic.Int64) *onceflow.Workers {
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, refundWorker(runs))
	return ws
}

// outageArgs are the arguments of a job that commits one row of its own and one effect.
type outageArgs struct {
	Order string `json:"order"`
}

func (outageArgs) Kind() string { return "outage.order" }

// ticketArgs are the body of a route's request.
type ticketArgs struct {
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

func (ticketArgs) Kind() string { return "ticket" }

// recorder collects what workers saw.
type recorder struct {
	mu   sync.Mutex
	seen []string
}

func (r *recorder) add(s string) {
	r.mu.Lock()
	r.seen = append(r.seen, s)
	r.mu.Unlock()
}

func (r *recorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}

// newClient returns a Client on rdb and prefix without PostgreSQL.
func newClient(t *testing.T, rdb *redis.Client, prefix string, ws *onceflow.Workers, queues map[string]onceflow.QueueConfig) *onceflow.Client {
	t.Helper()
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Queues: queues, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// runClient runs c until the test ends, and fails the test if Run fails.
func runClient(t *testing.T, c *onceflow.Client) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// contains reports whether ss holds s.
func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// containsPrefix reports whether an element of ss starts with p.
func containsPrefix(ss []string, p string) bool {
	for _, x := range ss {
		if strings.HasPrefix(x, p) {
			return true
		}
	}
	return false
}

// dbEnv is one test's Redis prefix and PostgreSQL schema, with the user's refunds table.
type dbEnv struct {
	t      *testing.T
	pool   *pgxpool.Pool
	dsn    string
	rdb    *redis.Client
	prefix string
}

// newDBEnv returns a dbEnv with its refunds table.
func newDBEnv(t *testing.T) *dbEnv {
	t.Helper()
	pool, dsn := testenv.Postgres(t)
	rdb, prefix := testenv.Redis(t)
	e := &dbEnv{t: t, pool: pool, dsn: dsn, rdb: rdb, prefix: prefix}
	e.exec(`CREATE TABLE refunds (job_id text PRIMARY KEY, order_id text NOT NULL, amount_cents integer NOT NULL CHECK (amount_cents > 0))`)
	return e
}

func (e *dbEnv) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatal(err)
	}
}

func (e *dbEnv) count(sql string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// effects returns the completions, refund rows and outbox effects (EnqueueTx's rows
// aside) of job id.
func (e *dbEnv) effects(id string) (completions, refunds, outboxRows int) {
	e.t.Helper()
	return e.count(`SELECT count(*) FROM job_completions WHERE job_id = $1`, id),
		e.count(`SELECT count(*) FROM refunds WHERE job_id = $1`, id),
		e.count(`SELECT count(*) FROM outbox WHERE dedupe_key LIKE '%:' || $1 AND topic <> $2`, id, onceflow.TopicEnqueue)
}

// client returns a Client on the env's Redis and cfg.DB (the env's pool when nil).
func (e *dbEnv) client(cfg onceflow.Config) *onceflow.Client {
	e.t.Helper()
	cfg.Redis, cfg.Prefix, cfg.Logger = e.rdb, e.prefix, testenv.Logger(e.t)
	if cfg.DB == nil {
		cfg.DB = e.pool
	}
	c, err := onceflow.NewClient(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// stream returns the job ids in the default queue's stream, in order.
func (e *dbEnv) stream() []string {
	e.t.Helper()
	entries, err := e.rdb.XRange(context.Background(), queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}.Stream(), "-", "+").Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		e.t.Fatal(err)
	}
	var ids []string
	for _, en := range entries {
		ids = append(ids, en.Values["job_id"].(string))
	}
	return ids
}

// added returns how many entries were ever added to the default queue's stream
// (XINFO STREAM entries-added), which the workers' trimming of acknowledged entries
// does not lower, unlike the stream's length.
func (e *dbEnv) added() int64 {
	e.t.Helper()
	info, err := e.rdb.XInfoStream(context.Background(), queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}.Stream()).Result()
	if err != nil {
		if err.Error() == "ERR no such key" {
			return 0
		}
		e.t.Fatal(err)
	}
	return info.EntriesAdded
}

// onlyJob fails the test unless every entry still in the stream (trimming may have
// removed acknowledged ones) is the job id.
func (e *dbEnv) onlyJob(id string) {
	e.t.Helper()
	for _, got := range e.stream() {
		if got != id {
			e.t.Fatalf("stream holds job %s, want only %s", got, id)
		}
	}
}

// pending returns the default queue's unacknowledged entries.
func (e *dbEnv) pending() int64 {
	e.t.Helper()
	p, err := e.rdb.XPending(context.Background(), queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}.Stream(), queue.DefaultGroup).Result()
	if err != nil {
		return -1
	}
	return p.Count
}

// enqueueInTx runs EnqueueTx with the user's own write in one transaction and commits
// it, or rolls it back.
func (e *dbEnv) enqueueInTx(c *onceflow.Client, args refundArgs, opts *onceflow.EnqueueOpts, commit bool) *onceflow.EnqueueResult {
	e.t.Helper()
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1) ON CONFLICT DO NOTHING`, args.OrderID); err != nil {
		e.t.Fatal(err)
	}
	res, err := c.EnqueueTx(ctx, tx, args, opts)
	if err != nil {
		e.t.Fatal(err)
	}
	if commit {
		if err := tx.Commit(ctx); err != nil {
			e.t.Fatal(err)
		}
	}
	return res
}

// pendingOf returns the unacknowledged entries of keys' stream (-1 on error).
func pendingOf(ctx context.Context, rdb *redis.Client, keys queue.Keys) int64 {
	p, err := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Result()
	if err != nil {
		return -1
	}
	return p.Count
}

// bearerTenants authenticates test requests: the tenant comes from the API key.
func bearerTenants(keys map[string]string) func(*http.Request) (string, error) {
	return func(r *http.Request) (string, error) {
		if t, ok := keys[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]; ok {
			return t, nil
		}
		return "", idempotency.ErrUnauthenticated
	}
}

// answer is an HTTP response read whole.
type answer struct {
	code   int
	header http.Header
	body   string
}

// postJSON posts body with an API key and an Idempotency-Key (each left out when empty).
func postJSON(t *testing.T, url, apiKey, key, contentType, body string) answer {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", contentType)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// fastRetry retries at once, with attempts long enough for a loaded machine.
var fastRetry = retry.Policy{Base: 10 * time.Millisecond, Cap: 50 * time.Millisecond, PerCallTimeout: 5 * time.Second, MinAttempt: 50 * time.Millisecond}

// prompt returns a request of one user message.
func prompt(text string) *llm.Request {
	return &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise for the support team:\n" + text}}}
}

// metricValue returns the sum of the series of name on reg whose labels include labels,
// or -1 when there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum, found := 0.0, false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue metrics
				}
			}
			switch {
			case m.Counter != nil:
				sum, found = sum+m.Counter.GetValue(), true
			case m.Gauge != nil:
				sum, found = sum+m.Gauge.GetValue(), true
			}
		}
	}
	if !found {
		return -1
	}
	return sum
}

// sortRuns counts the runs of each sort job, by job id.
type sortRuns struct {
	mu   sync.Mutex
	runs map[string]int
}

// countingSortWorkers returns Workers whose sort worker counts its runs in the sortRuns
// it returns.
func countingSortWorkers() (*onceflow.Workers, *sortRuns) {
	r := &sortRuns{runs: map[string]int{}}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		r.mu.Lock()
		r.runs[j.ID]++
		r.mu.Unlock()
		return nil
	}))
	return ws, r
}

// ran returns how many times job id ran.
func (r *sortRuns) ran(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[id]
}

// jobs returns how many distinct jobs ran.
func (r *sortRuns) jobs() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.runs)
}

// onceEach fails the test unless each job of ids ran exactly once.
func (r *sortRuns) onceEach(t *testing.T, ids []string) {
	t.Helper()
	for _, id := range ids {
		if n := r.ran(id); n != 1 {
			t.Fatalf("job %s ran %d times, want 1", id, n)
		}
	}
}

// waitAllDone waits until JobState says each job of ids, of tenant, is done.
func waitAllDone(t *testing.T, c *onceflow.Client, timeout time.Duration, tenant string, ids []string) {
	t.Helper()
	testenv.WaitFor(t, timeout, fmt.Sprintf("%d jobs done", len(ids)), func() bool {
		for _, id := range ids {
			if st, err := c.JobState(context.Background(), tenant, id); err != nil || st.Status != onceflow.StatusDone {
				return false
			}
		}
		return true
	})
}

// newStepEnvOn is newStepEnv on a given Redis (a private one a test can stop).
func newStepEnvOn(t *testing.T, rdb *redis.Client, model llm.Client, work func(ctx context.Context, j *onceflow.Job[orderArgs]) error) *stepEnv {
	t.Helper()
	return newStepEnvWith(t, rdb, testenv.Prefix(t), model, work)
}

// newStepEnvWith is newStepEnv on rdb under prefix.
func newStepEnvWith(t *testing.T, rdb *redis.Client, prefix string, model llm.Client, work func(ctx context.Context, j *onceflow.Job[orderArgs]) error) *stepEnv {
	t.Helper()
	pool, _ := testenv.Postgres(t)
	e := &stepEnv{t: t, rdb: rdb, prefix: prefix, pool: pool, runs: &runLog{}}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[orderArgs](func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		err := work(ctx, j)
		e.runs.add(run{delivery: j.Delivery, err: err, at: time.Now()})
		return err
	}))
	cfg := onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t), Model: model, ModelRetry: fastRetry,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: 300 * time.Millisecond, RetryBase: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond}}}
	var err error
	if e.client, err = onceflow.NewClient(cfg); err != nil {
		t.Fatal(err)
	}
	return e
}

// runTolerant runs c until the test ends, ignoring Run's error (a test stops Redis).
func runTolerant(t *testing.T, c *onceflow.Client) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

func privateRedisClient(t *testing.T) (*testenv.Server, *redis.Client) {
	t.Helper()
	srv := testenv.PrivateRedis(t)
	rdb, err := onceflow.NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	return srv, rdb
}
