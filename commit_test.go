package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

const testTraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// deliver runs one delivery of a refund job straight through the client's handler.
func deliver(c *onceflow.Client, id string, args refundArgs, delivery int64) error {
	payload, _ := json.Marshal(args)
	return c.Inspector().Handler(onceflow.DefaultQueue).Handle(context.Background(), &queue.Job{
		Message: queue.Message{JobID: id, Kind: refundArgs{}.Kind(), Tenant: "acme", Payload: payload,
			EnqueuedAt: time.Now(), TraceParent: testTraceParent},
		ID: fmt.Sprintf("%d-0", delivery), Deliveries: delivery,
	})
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

// After the first job's index expired, another tenant's (or kind's) job with the same
// id is enqueued, but its Commit finds the first job's completion record: it fails
// permanently with ErrJobIDTaken (so it is dead-lettered with the reason) instead of
// being taken as done, and writes nothing; the reason names neither the other tenant
// nor its kind. A redelivery of the first job is still done.
func TestCommitOfAnIDCompletedByAnotherJobIsRefused(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, refundWorker(&runs))
	onceflow.AddWorker(ws, onceflow.WorkFunc[refundTxArgs](func(ctx context.Context, j *onceflow.Job[refundTxArgs]) error {
		return j.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
			c.Exec(`INSERT INTO refunds (job_id, order_id, amount_cents) VALUES ($1, $2, $3)`, j.ID+"/tx", j.Args.OrderID, j.Args.AmountCents)
			return nil
		})
	}))
	c := e.client(onceflow.Config{Workers: ws})
	h := c.Inspector().Handler(onceflow.DefaultQueue)
	run := func(kind, tenant string, args any, entry string) error {
		payload, _ := json.Marshal(args)
		return h.Handle(context.Background(), &queue.Job{
			Message: queue.Message{JobID: "order-1", Kind: kind, Tenant: tenant, Payload: payload, EnqueuedAt: time.Now()},
			ID:      entry, Deliveries: 1,
		})
	}
	args := refundArgs{OrderID: "o-1", AmountCents: 100}
	if err := run(args.Kind(), "acme", args, "1-0"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, kind, tenant string
		args               any
	}{
		{"Commit, another tenant", args.Kind(), "globex", refundArgs{OrderID: "o-2", AmountCents: 5}},
		{"Commit, no tenant", args.Kind(), "", refundArgs{OrderID: "o-2", AmountCents: 5}},
		{"CommitTx, another kind", refundTxArgs{}.Kind(), "acme", refundTxArgs{OrderID: "o-3", AmountCents: 7}},
	} {
		err := run(tc.kind, tc.tenant, tc.args, "2-0")
		if !errors.Is(err, onceflow.ErrJobIDTaken) || !onceflow.IsPermanent(err) {
			t.Fatalf("%s: %v, want a permanent ErrJobIDTaken", tc.name, err)
		}
		if msg := err.Error(); containsAny(msg, "acme", "refund.issue") {
			t.Fatalf("%s: the reason %q names the other job's tenant or kind", tc.name, msg)
		}
	}
	if err := run(args.Kind(), "acme", args, "3-0"); err != nil {
		t.Fatalf("a redelivery of acme's own job: %v, want done", err)
	}
	if n := e.count(`SELECT count(*) FROM refunds`); n != 1 || runs.Load() != 4 {
		t.Fatalf("%d refunds after %d runs, want acme's one", n, runs.Load())
	}
	if c, _, o := e.effects("order-1"); c != 1 || o != 2 {
		t.Fatalf("completions %d, effects %d; want acme's 1 and 2", c, o)
	}
}

// refundTxArgs is a second kind committing with CommitTx.
type refundTxArgs struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
}

func (refundTxArgs) Kind() string { return "refund.tx" }

// containsAny reports whether s contains any of subs.
func containsAny(s string, subs ...string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// Job.Commit writes on its effects the traceparent of the Work call's context
// (Config.TraceParent) when it has one, else the one the job was enqueued with.
func TestCommitTraceParentPrefersTheWorkContext(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	const workSpan = "00-11111111111111111111111111111111-2222222222222222-01"
	type spanKey struct{}
	var runs atomic.Int64
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs),
		TraceParent: func(ctx context.Context) string { s, _ := ctx.Value(spanKey{}).(string); return s },
		Middleware: []onceflow.Middleware{func(next onceflow.JobFunc) onceflow.JobFunc {
			return func(ctx context.Context, info *onceflow.JobInfo) error {
				if info.ID == "traced" {
					ctx = context.WithValue(ctx, spanKey{}, workSpan)
				}
				return next(ctx, info)
			}
		}}})
	for _, id := range []string{"traced", "untraced"} {
		if err := deliver(c, id, refundArgs{OrderID: id, AmountCents: 100}, 1); err != nil {
			t.Fatal(err)
		}
	}
	for id, want := range map[string]string{"traced": workSpan, "untraced": testTraceParent} {
		if n := e.count(`SELECT count(*) FROM outbox WHERE dedupe_key LIKE '%:' || $1 AND traceparent = $2`, id, want); n != 2 {
			t.Errorf("job %s: %d effects carry traceparent %s, want 2", id, n, want)
		}
	}
}

// PostgreSQL is down while a job tries to commit (or, first, to call the model through
// the llm_calls ledger), for longer than its queue's MaxDeliveries × ClaimIdle: every
// delivery meets the outage, is handed back without spending a delivery, and once
// PostgreSQL is back the job commits once (and calls the model once). It is not
// dead-lettered.
func TestPostgresOutageDuringCommitSpendsNoDelivery(t *testing.T) {
	testenv.Long(t) // a PostgreSQL of its own stopped and started again, three times
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

// CommitTx commits the job's effects only with its model step's answer recorded: when
// the ledger cannot write the held answer first, CommitTx fails (the job is delivered
// again) rather than committing effects that rest on an answer a worker's crash before
// the end of the delivery loses.
func TestCommitTxCommitsOnlyWithTheStepsAnswerRecorded(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	refuse := refuseAnswers(t, pool)
	after := make(chan answerOutcome, 1)
	e := newModelEnv(t, fakeserver.Config{}, onceflow.Config{DB: pool}, func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
		st, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
		if err != nil {
			return err
		}
		if j.Delivery > 1 {
			return j.Commit(ctx, nil)
		}
		refuse(true) // the answer's write fails now; the transaction below does not touch it
		err = j.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
			c.Emit("support.reply", "reply:"+j.ID, map[string]string{"text": st.Response.Content})
			return nil
		})
		refuse(false)
		after <- answerOutcome{err: err, state: answerState(t, pool, st.Key)}
		return err
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	if o := awaitOutcome(t, after, 30*time.Second, "CommitTx"); o.err == nil && o.state != "succeeded" {
		t.Fatalf("CommitTx committed the job and its effect while its step's answer reads %q: a worker killed now loses the answer its effect carries", o.state)
	}
}

// A Commit whose statement fails after the step's answer in its batch rolls the answer
// back with it; the answer stays held and the end of the delivery records it, so the
// next delivery replays it without a second model call.
func TestCommitAfterAFailedStatementStillRecordsTheAnswer(t *testing.T) {
	t.Parallel()
	var contents sync.Map
	e := newModelEnv(t, fakeserver.Config{}, onceflow.Config{}, func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
		st, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
		if err != nil {
			return err
		}
		contents.Store(j.Delivery, st.Response.Content)
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			if j.Delivery == 1 {
				c.Exec(`INSERT INTO no_such_table VALUES (1)`)
			}
			return nil
		})
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	runs := e.waitRuns(2)
	if runs[0].err == nil || runs[1].err != nil {
		t.Fatalf("runs %+v: want a failed Commit, then one that commits", runs)
	}
	a, _ := contents.Load(1)
	b, _ := contents.Load(2)
	if n := e.calls(); n != 1 || a != b {
		t.Fatalf("%d model calls, answers %q / %q: want 1 call, the answer of the failed Commit replayed", n, a, b)
	}
}

// A Commit that queued the step's held answer, while another goroutine of the Worker
// records that same answer first (an Enqueue beside the Commit), commits: the answer
// recorded is the Commit's own, not another attempt's, so it is no SupersededError.
func TestCommitBesideAnEnqueueThatRecordsTheSameAnswerCommits(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, `LOCK TABLE job_completions IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var unlocked atomic.Bool
	first := make(chan error, 1)
	e := newParentEnv(t, pool, func(ctx context.Context, e *modelEnv, j *onceflow.Job[supportArgs], st *onceflow.Step) error {
		committed := make(chan error, 1)
		go func() {
			committed <- j.Commit(ctx, func(c *onceflow.Commit) error { c.Result(st.Response.Content); return nil })
		}()
		time.Sleep(300 * time.Millisecond) // the Commit's batch waits on the completion record
		if _, err := e.client.Enqueue(ctx, supportArgs{Text: "child:" + st.Response.Content}, &onceflow.EnqueueOpts{Key: "child-of-" + j.ID}); err != nil {
			return err
		}
		if unlocked.CompareAndSwap(false, true) {
			_ = lock.Rollback(context.Background())
		}
		err = <-committed
		select {
		case first <- err:
		default:
		}
		return err
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	select {
	case err := <-first:
		if err != nil {
			t.Fatalf("the Commit beside an Enqueue recording its own answer: %v; want it committed", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the Worker did not commit")
	}
}

// supersede records another attempt's answer on the row of the step's key, in tx.
func supersede(ctx context.Context, tx interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, key string) error {
	_, err := tx.Exec(ctx, `UPDATE llm_calls SET state = 'succeeded', attempt = attempt + 1, owner = NULL, lease_until = NULL,
	response = '{"content": "another attempt''s answer"}', response_raw = 'other' WHERE idem_key = $1`, key)
	return err
}

// sideEffectsTable creates the table side_effects (answer text) on pool, where the jobs
// of a test write what they acted on, and returns a count of its rows.
func sideEffectsTable(t *testing.T, pool *pgxpool.Pool) func() int {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE side_effects (answer text)`); err != nil {
		t.Fatal(err)
	}
	return func() int {
		t.Helper()
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM side_effects`).Scan(&n); err != nil {
			t.Fatalf("count side_effects: %v", err)
		}
		return n
	}
}

// A Commit beside an Enqueue of the same delivery that is recording the step's held
// answer, and finds another attempt's answer recorded first, commits nothing: the job
// acted on an answer that is not the recorded one.
func TestCommitBesideAnEnqueueThatFindsTheAnswerSupersededCommitsNothing(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	sideEffects := sideEffectsTable(t, pool)
	first := make(chan error, 1)
	e := newParentEnv(t, pool, func(ctx context.Context, e *modelEnv, j *onceflow.Job[supportArgs], st *onceflow.Step) error {
		if j.Delivery > 1 {
			return nil
		}
		other, err := pool.Begin(ctx) // another attempt records its answer; its commit waits
		if err != nil {
			return err
		}
		if err := supersede(ctx, other, st.Key); err != nil {
			_ = other.Rollback(ctx)
			return err
		}
		enqueued := make(chan error, 1)
		go func() {
			_, err := e.client.Enqueue(ctx, supportArgs{Text: "child:" + st.Response.Content}, &onceflow.EnqueueOpts{Key: "child-of-" + j.ID})
			enqueued <- err
		}()
		testenv.WaitFor(t, 10*time.Second, "the Enqueue recording the answer", func() bool {
			var n int
			_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO llm_calls%'`).Scan(&n)
			return n > 0
		})
		released := make(chan struct{})
		go func() {
			defer close(released)
			time.Sleep(300 * time.Millisecond)
			_ = other.Commit(context.Background())
		}()
		err = j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO side_effects VALUES ($1)`, st.Response.Content)
			return nil
		})
		<-released
		<-enqueued
		first <- err
		return err
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	err := awaitOutcome(t, first, 30*time.Second, "its Commit")
	if n := sideEffects(); n != 0 {
		t.Fatalf("the Commit beside the superseded answer: %v; its rows committed: %d, want 0", err, n)
	}
	if err == nil {
		t.Fatal("the Commit beside the superseded answer returned nil")
	}
}

// Once the delivery learned that another attempt's answer was recorded before its
// own (an Enqueue's RecordHeld said so), nothing the delivery writes commits after
// it: a CommitTx, another Enqueue.
func TestAnAnswerFoundSupersededStopsTheDeliverysLaterCommitTxAndEnqueue(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	sideEffects := sideEffectsTable(t, pool)
	type outcome struct{ enqueue, again, commit error }
	first := make(chan outcome, 1)
	e := newParentEnv(t, pool, func(ctx context.Context, e *modelEnv, j *onceflow.Job[supportArgs], st *onceflow.Step) error {
		if j.Delivery > 1 {
			return nil
		}
		if err := supersede(ctx, pool, st.Key); err != nil {
			return err
		}
		var o outcome
		// A best-effort notification whose error the Worker only logs.
		_, o.enqueue = e.client.Enqueue(ctx, supportArgs{Text: "child:1"}, &onceflow.EnqueueOpts{Key: "child-1-of-" + j.ID})
		_, o.again = e.client.Enqueue(ctx, supportArgs{Text: "child:2"}, &onceflow.EnqueueOpts{Key: "child-2-of-" + j.ID})
		o.commit = j.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
			c.Exec(`INSERT INTO side_effects VALUES ($1)`, st.Response.Content)
			return nil
		})
		first <- o
		return o.commit
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	o := awaitOutcome(t, first, 30*time.Second, "its CommitTx")
	if o.enqueue == nil {
		t.Fatal("the first Enqueue after the superseded answer returned nil")
	}
	if n := sideEffects(); n != 0 {
		t.Errorf("CommitTx after the superseded answer: %v; its rows committed: %d, want 0", o.commit, n)
	}
	if o.again == nil {
		t.Error("a second Enqueue after the superseded answer returned nil; want the SupersededError")
	}
}
