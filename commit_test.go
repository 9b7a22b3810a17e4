package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// refundArgs are the arguments of a job that refunds an order: a row of the user's own
// (refunds), a payment effect and an email effect, committed once.
type refundArgs struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
}

func (refundArgs) Kind() string { return "refund.issue" }

const testTraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

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

// dbEnv is one test's Redis prefix and PostgreSQL schema, with the user's refunds table.
type dbEnv struct {
	t      *testing.T
	pool   *pgxpool.Pool
	dsn    string
	rdb    *redis.Client
	prefix string
}

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

// deliver runs one delivery of a refund job straight through the client's handler.
func deliver(c *onceflow.Client, id string, args refundArgs, delivery int64) error {
	payload, _ := json.Marshal(args)
	return c.Inspector().Handler(onceflow.DefaultQueue).Handle(context.Background(), &queue.Job{
		Message: queue.Message{JobID: id, Kind: refundArgs{}.Kind(), Tenant: "acme", Payload: payload,
			EnqueuedAt: time.Now(), TraceParent: testTraceParent},
		ID: fmt.Sprintf("%d-0", delivery), Deliveries: delivery,
	})
}

func refundWorkers(runs *atomic.Int64) *onceflow.Workers {
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, refundWorker(runs))
	return ws
}

// flights counts the client's sends on the wire: a write after a read (or the first
// write) starts a new round trip. It sees what pgx's tracer does not: the Parse/Sync
// of a batch's statements new to a connection and pgx's deallocations.
type flights struct {
	mu      sync.Mutex
	n       int
	writing bool
}

func (f *flights) wrote() {
	f.mu.Lock()
	if !f.writing {
		f.n++
		f.writing = true
	}
	f.mu.Unlock()
}

func (f *flights) reading() {
	f.mu.Lock()
	f.writing = false
	f.mu.Unlock()
}

func (f *flights) take() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.n
	f.n = 0
	return n
}

type flightConn struct {
	net.Conn
	f *flights
}

func (c *flightConn) Write(b []byte) (int, error) { c.f.wrote(); return c.Conn.Write(b) }

// Read marks the end of a send when bytes come back, not when Read is called: pgx may
// be blocked in a Read (its background reader) before it writes, and a mark made then
// would leave the write after it uncounted.
func (c *flightConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.f.reading()
	}
	return n, err
}

// countedPool returns a one-connection pool on dsn whose round trips are counted by a
// pgx tracer and on the wire, and that never pings before handing out its connection.
func countedPool(t *testing.T, dsn string) (*pgxpool.Pool, *roundtrip.Counter, *flights) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var counter roundtrip.Counter
	wire := &flights{}
	cfg.MaxConns = 1
	cfg.ConnConfig.Tracer = &counter
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &flightConn{Conn: conn, f: wire}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	return pool, &counter, wire
}

// Job.Commit writes the completion, the user's row, two effects and the result in one
// round trip and one transaction (every row carries the same xmin), with the job's
// traceparent on the effects; JobState then reads the result.
func TestCommitIsOneRoundTripAndOneTransaction(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	pool, counter, wire := countedPool(t, e.dsn)
	var runs atomic.Int64
	c := e.client(onceflow.Config{DB: pool, Workers: refundWorkers(&runs)})
	wire.take()
	counter.Reset()

	if err := deliver(c, "order-1-refund", refundArgs{OrderID: "order-1", AmountCents: 500}, 1); err != nil {
		t.Fatal(err)
	}
	first, firstTraced := wire.take(), counter.Postgres()
	counter.Reset()
	if err := deliver(c, "order-2-refund", refundArgs{OrderID: "order-2", AmountCents: 700}, 1); err != nil {
		t.Fatal(err)
	}
	steady, steadyTraced := wire.take(), counter.Postgres()
	t.Logf("round trips of Commit (completion + 1 statement + 2 effects): first on a connection %d on the wire (%d traced), then %d (%d traced)",
		first, firstTraced, steady, steadyTraced)
	if steady != 1 || steadyTraced != 1 {
		t.Fatalf("Commit took %d round trips on the wire (%d traced), want 1", steady, steadyTraced)
	}
	if c, r, o := e.effects("order-2-refund"); c != 1 || r != 1 || o != 2 {
		t.Fatalf("completions %d, refunds %d, outbox rows %d; want 1, 1, 2", c, r, o)
	}
	if n := e.count(`SELECT count(DISTINCT xmin::text) FROM (
			SELECT xmin FROM job_completions WHERE job_id = 'order-2-refund'
			UNION ALL SELECT xmin FROM refunds WHERE job_id = 'order-2-refund'
			UNION ALL SELECT xmin FROM outbox WHERE dedupe_key LIKE '%:order-2-refund') rows`); n != 1 {
		t.Fatalf("the job's rows were written by %d transactions, want 1", n)
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE dedupe_key LIKE '%:order-2-refund' AND traceparent = $1`, testTraceParent); n != 2 {
		t.Fatalf("%d effects carry the job's traceparent, want 2", n)
	}
	st, err := c.JobState(context.Background(), "acme", "order-2-refund")
	if err != nil || st.Status != onceflow.StatusDone || string(st.Result) != `{"refunded_cents": 700}` || st.Kind != "refund.issue" {
		t.Fatalf("JobState %+v %v", st, err)
	}

	// A redelivery loses: three round trips (the batch; pgx deallocating the failed
	// batch's statements, which it does before the next statement on the connection;
	// the read that the completion is this job's, not another tenant's with the same
	// id), acknowledged, nothing written. pgx then re-prepares the failed batch's
	// statements on that connection once.
	wire.take()
	if err := deliver(c, "order-2-refund", refundArgs{OrderID: "order-2", AmountCents: 700}, 2); err != nil {
		t.Fatalf("redelivery: %v, want acknowledged", err)
	}
	lost := wire.take()
	if err := deliver(c, "order-3-refund", refundArgs{OrderID: "order-3", AmountCents: 900}, 1); err != nil {
		t.Fatal(err)
	}
	t.Logf("a redelivery that loses: %d round trip(s); the next Commit on that connection: %d", lost, wire.take())
	if lost != 3 {
		t.Fatalf("a losing Commit took %d round trips, want 3", lost)
	}
	if c, r, o := e.effects("order-2-refund"); c != 1 || r != 1 || o != 2 || runs.Load() != 4 {
		t.Fatalf("after the redelivery: completions %d, refunds %d, outbox rows %d, runs %d", c, r, o, runs.Load())
	}
}

// Two (here eight) deliveries of one job commit at the same moment: one completion,
// one refund row, one set of effects, and every delivery is acknowledged.
func TestConcurrentDeliveriesCommitOnce(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	var runs atomic.Int64
	release := make(chan struct{})
	ws := onceflow.NewWorkers()
	inner := refundWorker(&runs)
	onceflow.AddWorker(ws, onceflow.WorkFunc[refundArgs](func(ctx context.Context, j *onceflow.Job[refundArgs]) error {
		<-release // every delivery reaches Commit together
		return inner(ctx, j)
	}))
	c := e.client(onceflow.Config{Workers: ws})
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = deliver(c, "race-1", refundArgs{OrderID: "o-1", AmountCents: 100}, int64(i+1)) })
	}
	close(release)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("delivery %d: %v, want acknowledged", i+1, err)
		}
	}
	if c, r, o := e.effects("race-1"); c != 1 || r != 1 || o != 2 || runs.Load() != n {
		t.Fatalf("completions %d, refunds %d, outbox rows %d, runs %d; want 1, 1, 2, %d", c, r, o, runs.Load(), n)
	}
}

// A failing statement of the user's aborts the whole commit: no completion, no row, no
// effect; the error is transient (the job runs again) and carries PostgreSQL's.
func TestCommitStatementErrorWritesNothing(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	var runs atomic.Int64
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs)})
	err := deliver(c, "bad-amount", refundArgs{OrderID: "o-2", AmountCents: -5}, 1) // the CHECK fails
	var pgErr *pgconn.PgError
	if err == nil || onceflow.IsPermanent(err) || !errors.As(err, &pgErr) || pgErr.Code != "23514" {
		t.Fatalf("err %v, want a transient error wrapping the check violation", err)
	}
	if !strings.Contains(err.Error(), "statement 1 (Exec)") {
		t.Errorf("error %q does not say which statement failed", err)
	}
	if c, r, o := e.effects("bad-amount"); c != 0 || r != 0 || o != 0 {
		t.Fatalf("completions %d, refunds %d, outbox rows %d after a failed statement; want none", c, r, o)
	}
}

// An effect whose dedupe key exists without the job's completion: something wrote it
// outside the job's commit. Retrying cannot fix that; the job fails permanently, naming
// the key, and nothing of the commit is written.
func TestDuplicateEffectWithoutCompletionIsPermanent(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	e.exec(`INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('email.reply', 'reply:orphan-1', '{}')`)
	var runs atomic.Int64
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs)})
	err := deliver(c, "orphan-1", refundArgs{OrderID: "o-3", AmountCents: 100}, 1)
	if !onceflow.IsPermanent(err) || !errors.Is(err, pgoutbox.ErrDuplicate) || !strings.Contains(err.Error(), "reply:orphan-1") {
		t.Fatalf("err %v, want permanent, ErrDuplicate, naming reply:orphan-1", err)
	}
	if c, r, o := e.effects("orphan-1"); c != 0 || r != 0 || o != 1 {
		t.Fatalf("completions %d, refunds %d, outbox rows %d; want 0, 0 and the orphan", c, r, o)
	}
}

type commitFn = func(j *onceflow.Job[refundArgs], c *onceflow.Commit)

// Mistakes with the Commit are permanent and write nothing; so is a Client without DB.
func TestCommitMistakesArePermanent(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	for name, fn := range map[string]commitFn{
		"invalid topic":  func(j *onceflow.Job[refundArgs], c *onceflow.Commit) { c.Emit("email reply", "k:"+j.ID, 1) },
		"reserved topic": func(j *onceflow.Job[refundArgs], c *onceflow.Commit) { c.Emit("onceflow.enqueue", "k:"+j.ID, 1) },
		"empty key":      func(_ *onceflow.Job[refundArgs], c *onceflow.Commit) { c.Emit("email.reply", "", 1) },
		"key twice": func(j *onceflow.Job[refundArgs], c *onceflow.Commit) {
			c.Emit("email.reply", "k:"+j.ID, 1)
			c.Emit("email.other", "k:"+j.ID, 2)
		},
		"payload": func(j *onceflow.Job[refundArgs], c *onceflow.Commit) {
			c.Emit("email.reply", "k:"+j.ID, make(chan int))
		},
		"raw payload": func(j *onceflow.Job[refundArgs], c *onceflow.Commit) {
			c.Emit("email.reply", "k:"+j.ID, json.RawMessage(`{`))
		},
		"result":    func(_ *onceflow.Job[refundArgs], c *onceflow.Commit) { c.Result(func() {}) },
		"empty sql": func(_ *onceflow.Job[refundArgs], c *onceflow.Commit) { c.Exec("  ") },
	} {
		ws := onceflow.NewWorkers()
		onceflow.AddWorker(ws, onceflow.WorkFunc[refundArgs](func(ctx context.Context, j *onceflow.Job[refundArgs]) error {
			return j.Commit(ctx, func(c *onceflow.Commit) error { fn(j, c); return nil })
		}))
		id := "mistake-" + strings.ReplaceAll(name, " ", "-")
		if err := deliver(e.client(onceflow.Config{Workers: ws}), id, refundArgs{}, 1); !onceflow.IsPermanent(err) {
			t.Errorf("%s: %v, want permanent", name, err)
		}
		if c, _, o := e.effects(id); c != 0 || o != 0 {
			t.Errorf("%s: %d completions, %d effects written", name, c, o)
		}
	}
	noDB, err := onceflow.NewClient(onceflow.Config{Redis: e.rdb, Prefix: e.prefix, Workers: refundWorkers(new(atomic.Int64))})
	if err != nil {
		t.Fatal(err)
	}
	if err := deliver(noDB, "no-db", refundArgs{OrderID: "o", AmountCents: 1}, 1); !onceflow.IsPermanent(err) || !strings.Contains(err.Error(), "Config.DB") {
		t.Fatalf("without DB: %v", err)
	}
}

// The worker's own error comes back as it is, and nothing is written.
func TestCommitReturnsTheWorkersError(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	mine := errors.New("inventory service down")
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[refundArgs](func(ctx context.Context, j *onceflow.Job[refundArgs]) error {
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email.reply", "reply:"+j.ID, 1)
			return onceflow.RetryAfter(time.Second, mine)
		})
	}))
	err := deliver(e.client(onceflow.Config{Workers: ws}), "mine-1", refundArgs{}, 1)
	var de interface{ RetryAfter() (time.Duration, bool) }
	if !errors.Is(err, mine) || !errors.As(err, &de) {
		t.Fatalf("err %v, want the worker's RetryAfter error", err)
	}
	if c, _, o := e.effects("mine-1"); c != 0 || o != 0 {
		t.Fatalf("%d completions, %d effects", c, o)
	}
}

// ledgerWorker reads and updates the user's balance inside the transaction with
// CommitTx, then emits the refund.
func ledgerWorker(calls *atomic.Int64, hold <-chan struct{}) onceflow.WorkFunc[refundArgs] {
	return func(ctx context.Context, j *onceflow.Job[refundArgs]) error {
		return j.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
			calls.Add(1)
			if hold != nil {
				<-hold
			}
			var balance int
			if err := tx.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 'acme' FOR UPDATE`).Scan(&balance); err != nil {
				return err
			}
			if balance < j.Args.AmountCents {
				return onceflow.Permanent(fmt.Errorf("balance %d below %d", balance, j.Args.AmountCents))
			}
			c.Exec(`UPDATE accounts SET balance = balance - $1 WHERE id = 'acme'`, j.Args.AmountCents)
			c.Exec(`INSERT INTO refunds (job_id, order_id, amount_cents) VALUES ($1, $2, $3)`, j.ID, j.Args.OrderID, j.Args.AmountCents)
			c.Emit("payments.refund", "refund:"+j.ID, j.Args)
			c.Result(map[string]int{"balance": balance - j.Args.AmountCents})
			return nil
		})
	}
}

// CommitTx: concurrent deliveries wait at the completion record; the winner's fn runs,
// the losers' never does, and all are acknowledged. The result, the user's rows and the
// effect commit together.
func TestCommitTxRunsTheWinnersFnOnly(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	e.exec(`CREATE TABLE accounts (id text PRIMARY KEY, balance integer NOT NULL); INSERT INTO accounts VALUES ('acme', 1000)`)
	var calls atomic.Int64
	hold := make(chan struct{})
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, ledgerWorker(&calls, hold))
	c := e.client(onceflow.Config{Workers: ws})
	const n = 4
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = deliver(c, "tx-1", refundArgs{OrderID: "o-9", AmountCents: 300}, int64(i+1)) })
	}
	testenv.WaitFor(t, 10*time.Second, "the winner inside fn", func() bool { return calls.Load() == 1 })
	close(hold)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("delivery %d: %v", i+1, err)
		}
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times, want once", calls.Load())
	}
	if c, r, o := e.effects("tx-1"); c != 1 || r != 1 || o != 1 || e.count(`SELECT balance FROM accounts`) != 700 {
		t.Fatalf("completions %d, refunds %d, outbox %d, balance %d", c, r, o, e.count(`SELECT balance FROM accounts`))
	}
	st, err := c.JobState(context.Background(), "acme", "tx-1")
	if err != nil || string(st.Result) != `{"balance": 700}` {
		t.Fatalf("JobState %+v %v", st, err)
	}

	// fn's error rolls everything back, the completion record included.
	e.exec(`UPDATE accounts SET balance = 100`)
	err = deliver(c, "tx-2", refundArgs{OrderID: "o-10", AmountCents: 300}, 1)
	if !onceflow.IsPermanent(err) || !strings.Contains(err.Error(), "balance 100") {
		t.Fatalf("err %v", err)
	}
	if c, r, o := e.effects("tx-2"); c != 0 || r != 0 || o != 0 {
		t.Fatalf("after fn failed: completions %d, refunds %d, outbox %d", c, r, o)
	}

	// A duplicate effect in CommitTx is permanent too, and rolls back.
	e.exec(`UPDATE accounts SET balance = 1000; INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('payments.refund', 'refund:tx-3', '{}')`)
	err = deliver(c, "tx-3", refundArgs{OrderID: "o-11", AmountCents: 300}, 1)
	if !onceflow.IsPermanent(err) || !errors.Is(err, pgoutbox.ErrDuplicate) || !strings.Contains(err.Error(), "refund:tx-3") {
		t.Fatalf("err %v", err)
	}
	if c, r, _ := e.effects("tx-3"); c != 0 || r != 0 || e.count(`SELECT balance FROM accounts`) != 1000 {
		t.Fatalf("after the duplicate: completions %d, refunds %d", c, r)
	}
}

// CommitTx's round trips: BEGIN with the completion record, fn's own, the batch of
// statements and effects, COMMIT.
func TestCommitTxRoundTrips(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	e.exec(`CREATE TABLE accounts (id text PRIMARY KEY, balance integer NOT NULL); INSERT INTO accounts VALUES ('acme', 1000)`)
	pool, counter, wire := countedPool(t, e.dsn)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, ledgerWorker(new(atomic.Int64), nil))
	c := e.client(onceflow.Config{DB: pool, Workers: ws})
	if err := deliver(c, "rt-1", refundArgs{OrderID: "o", AmountCents: 1}, 1); err != nil { // prepares
		t.Fatal(err)
	}
	wire.take()
	counter.Reset()
	if err := deliver(c, "rt-2", refundArgs{OrderID: "o", AmountCents: 1}, 1); err != nil {
		t.Fatal(err)
	}
	got, traced := wire.take(), counter.Postgres()
	t.Logf("CommitTx with one read in fn: %d round trips on the wire (%d traced)", got, traced)
	if got != 4 {
		t.Fatalf("CommitTx took %d round trips, want 4 (begin+completion, fn's read, batch, commit)", got)
	}
}
