package ledger_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// writeCounter is a pgx tracer counting the ledger's in-flight inserts and answers by
// how they reach PostgreSQL: sent alone, or in a batch (one implicit transaction).
type writeCounter struct {
	alone, batches, batched atomic.Int64
}

func ledgerWrite(sql string) bool {
	return strings.Contains(sql, "INSERT INTO llm_calls")
}

func (c *writeCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if ledgerWrite(d.SQL) {
		c.alone.Add(1)
	}
	return ctx
}

// requireShared fails t when no group carried more than one of the writes counted: a
// test of what grouped writes do then proved nothing.
func (c *writeCounter) requireShared(t *testing.T) {
	t.Helper()
	if c.batched.Load() <= c.batches.Load() {
		t.Fatalf("no group carried more than one write (%d groups, %d writes): the test proves nothing", c.batches.Load(), c.batched.Load())
	}
}

func (c *writeCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *writeCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	n := 0
	for _, q := range d.Batch.QueuedQueries {
		if ledgerWrite(q.SQL) {
			n++
		}
	}
	if n > 0 {
		c.batches.Add(1)
		c.batched.Add(int64(n))
	}
	return ctx
}

func (c *writeCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *writeCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// countedLedger returns a ledger over a pool whose ledger writes w counts.
func countedLedger(t *testing.T, cfg ledger.Config) (*ledger.Ledger, *pgxpool.Pool, *writeCounter) {
	t.Helper()
	w := &writeCounter{}
	l, pool := tracedLedger(t, cfg, w)
	return l, pool, w
}

// callInProgress begins a call of l that stays in progress, so that every group of l
// lingers for others to join and concurrent calls share groups.
func callInProgress(t *testing.T, l *ledger.Ledger) {
	t.Helper()
	if _, _, err := l.Begin(ctxT(t), callOf("job-in-progress/s", request("x"))); err != nil {
		t.Fatal(err)
	}
}

// together runs f(i) for i in [0, n) on n goroutines released at once.
func together(n int, f func(i int)) {
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	ready.Add(n)
	done.Add(n)
	for i := range n {
		go func() {
			defer done.Done()
			ready.Done()
			<-start
			f(i)
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()
}

func TestConcurrentCallsShareGroupTransactions(t *testing.T) {
	t.Parallel()
	l, _, w := countedLedger(t, ledger.Config{})
	ctx := ctxT(t)
	const n = 48
	atts := make([]*ledger.Attempt, n)
	errs := make([]error, n)
	together(n, func(i int) {
		atts[i], _, errs[i] = l.Begin(ctx, callOf("job-"+string(rune('a'+i%26))+string(rune('a'+i/26))+"/s", request("x")))
	})
	for i, err := range errs {
		if err != nil || atts[i] == nil {
			t.Fatalf("Begin %d: %v", i, err)
		}
		if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateInFlight || r.Attempt != 1 {
			t.Fatalf("row %d after Begin: %s, attempt %d", i, r.State, r.Attempt)
		}
	}
	inserts := w.alone.Load() + w.batches.Load()
	if w.alone.Load()+w.batched.Load() != n || inserts >= n/2 {
		t.Fatalf("%d in-flight rows went in %d transactions (%d alone, %d batches of %d rows): want them to share transactions",
			n, inserts, w.alone.Load(), w.batches.Load(), w.batched.Load())
	}

	w.alone.Store(0)
	w.batches.Store(0)
	w.batched.Store(0)
	together(n, func(i int) {
		_, ours, err := atts[i].Succeed(ctx, ledger.ResultOf(&llm.Response{ID: atts[i].Key(), Content: "answer"}))
		if err == nil && !ours {
			err = errors.New("not ours")
		}
		errs[i] = err
	})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Succeed %d: %v", i, err)
		}
		if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateSucceeded {
			t.Fatalf("row %d after Succeed: %s", i, r.State)
		}
	}
	if answers := w.alone.Load() + w.batches.Load(); answers >= n/2 {
		t.Fatalf("%d answers went in %d transactions: want them to share transactions", n, answers)
	}
}

func TestOneFailingWriteOfAGroupFailsOnlyItsCall(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	// The longest linger, and a call in progress so that every group lingers: the call
	// whose row cannot be written shares a group with the others.
	l, _, w := countedLedger(t, ledger.Config{Registerer: reg, GroupLinger: ledger.MaxGroupLinger})
	ctx := ctxT(t)
	callInProgress(t, l)
	// The calls start together, but on a loaded machine the one that cannot be written
	// may still be taken alone: up to three rounds, until it shared a group.
	const n = 16
	for round := 0; round < 3 && counterValue(t, reg, "onceflow_llm_ledger_group_failures_total", nil) == 0; round++ {
		errs := make([]error, n)
		atts := make([]*ledger.Attempt, n)
		together(n, func(i int) {
			c := callOf(fmt.Sprintf("job-%d-%c/s", round, 'a'+i), request("x"))
			if i == 7 {
				c.Work = "job-\x00/s" // PostgreSQL's text holds no NUL: this row cannot be written
			}
			atts[i], _, errs[i] = l.Begin(ctx, c)
		})
		for i, err := range errs {
			switch {
			case i == 7 && !errors.Is(err, ledger.ErrUnavailable):
				t.Fatalf("the call whose row cannot be written: %v, want its own database error", err)
			case i != 7 && (err != nil || atts[i] == nil):
				t.Fatalf("Begin %d, grouped with a call whose row cannot be written: %v", i, err)
			case i != 7:
				if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateInFlight {
					t.Fatalf("row %d: %s", i, r.State)
				}
			}
		}
	}
	if w.batches.Load() == 0 {
		t.Fatal("no group transaction was tried: the test proves nothing")
	}
	if got := counterValue(t, reg, "onceflow_llm_ledger_group_failures_total", nil); got < 1 {
		t.Fatalf("group failures counted: %v, want at least 1 (the call that cannot be written never shared a group in three rounds)", got)
	}
}

func TestGroupCommitOffWritesEveryCallAlone(t *testing.T) {
	t.Parallel()
	l, _, w := countedLedger(t, ledger.Config{GroupLinger: -1})
	ctx := ctxT(t)
	const n = 16
	together(n, func(i int) {
		att, _, err := l.Begin(ctx, callOf("job-"+string(rune('a'+i))+"/s", request("x")))
		if err == nil {
			_, _, err = att.Succeed(ctx, ledger.ResultOf(&llm.Response{Content: "answer"}))
		}
		if err != nil {
			t.Error(err)
		}
	})
	if w.batches.Load() != 0 || w.alone.Load() != 2*n {
		t.Fatalf("group commit off: %d batches, %d writes alone; want 0 and %d", w.batches.Load(), w.alone.Load(), 2*n)
	}
}

func TestGroupLingerIsBounded(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	if _, err := ledger.New(pool, ledger.Config{GroupLinger: ledger.MaxGroupLinger + 1}); err == nil {
		t.Fatal("a GroupLinger above MaxGroupLinger was accepted")
	}
	if _, err := ledger.New(pool, ledger.Config{GroupMax: -1}); err == nil {
		t.Fatal("a negative GroupMax was accepted")
	}
}

// holdRow gives key's row to a transaction that stays open until release: an attempt
// recording its answer with SucceedTx inside the caller's transaction, whose commit
// comes later (docs/providers.md, "Tool calls"). A write of that key waits for it.
func holdRow(t *testing.T, l *ledger.Ledger, pool *pgxpool.Pool, c ledger.Call) (release func()) {
	t.Helper()
	ctx := ctxT(t)
	att, _, err := l.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := att.SucceedTx(ctx, tx, ledger.ResultOf(&llm.Response{Content: "held"})); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Commit(context.Background()) }) }
	t.Cleanup(release)
	return release
}

// waitForLockWait waits until a statement of the test's PostgreSQL waits for a lock.
func waitForLockWait(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, "a ledger write waiting for a row lock", func() bool {
		var n int
		err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO llm_calls%'`).Scan(&n)
		return err == nil && n > 0
	})
}

// A call's Begin does not wait for another call's row: a key whose row another
// transaction holds (its caller's SucceedTx, not committed yet) delays the Begins of
// that key only, as it did before group commit; the calls that arrive meanwhile are
// written at once.
func TestBeginDoesNotWaitForAnotherCallsRowLock(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{WriteTimeout: 5 * time.Second, Wait: -1})
	ctx := ctxT(t)
	held := callOf("job-held/s", request("x"))
	release := holdRow(t, l, pool, held)
	go func() { _, _, _ = l.Begin(ctx, held) }() // a redelivery of the held call
	waitForLockWait(t, pool)

	start := time.Now()
	att, _, err := l.Begin(ctx, callOf("job-other/s", request("y")))
	took := time.Since(start)
	release()
	if err != nil || att == nil {
		t.Fatalf("Begin of another key while one key's row is held: %v", err)
	}
	if took > 3*time.Second {
		t.Fatalf("Begin of another key took %v while one key's row was held (WriteTimeout 5s): it waited for that key's write", took)
	}
}

// One call whose row is held by another transaction fails (at worst) that call alone:
// the calls grouped with it are written, each on its own, within their own bound, not
// failed by the time their group spent waiting for the held row.
func TestCallsGroupedWithAHeldRowAreWritten(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{WriteTimeout: 3 * time.Second, Wait: -1}) // room for setup on a loaded machine (-race)
	ctx := ctxT(t)
	first, second := callOf("job-first/s", request("x")), callOf("job-second/s", request("x"))
	releaseFirst := holdRow(t, l, pool, first)
	releaseSecond := holdRow(t, l, pool, second)
	defer releaseSecond()

	// The redelivery of first holds the statement's group in flight; second's and the
	// innocent calls queue behind it and go in the next group together.
	go func() { _, _, _ = l.Begin(ctx, first) }()
	waitForLockWait(t, pool)
	go func() { _, _, _ = l.Begin(ctx, second) }()
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, errs[i] = l.Begin(ctx, callOf(fmt.Sprintf("job-innocent-%d/s", i), request("y")))
		}()
	}
	time.Sleep(200 * time.Millisecond) // let them queue
	releaseFirst()
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Begin %d, grouped with a call whose row another transaction held: %v", i, err)
		}
	}
}

// Begin returns when its ctx ends (with ctx's error), however long the write it
// waits for takes: its caller's deadline bounds it, as documented, not WriteTimeout.
func TestBeginReturnsWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{WriteTimeout: 5 * time.Second, Wait: -1})
	held := callOf("job-held/s", request("x"))
	release := holdRow(t, l, pool, held)
	defer release()

	ctx, cancel := context.WithTimeout(ctxT(t), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err := l.Begin(ctx, held)
	if took := time.Since(start); took > 3*time.Second { // WriteTimeout is 5s
		t.Fatalf("Begin under a 300ms deadline returned after %v (%v): it waited for WriteTimeout, not its ctx", took, err)
	}
	if err == nil {
		t.Fatal("Begin whose deadline passed while its write waited: no error")
	}
}

// A Begin whose ctx has already ended writes nothing and returns ctx's error: no
// in-flight row for a caller that went away.
func TestBeginUnderAnEndedContextWritesNothing(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{})
	ctx, cancel := context.WithCancel(ctxT(t))
	cancel()
	c := callOf("job-gone/s", request("x"))
	att, _, err := l.Begin(ctx, c)
	if err == nil || att != nil {
		t.Fatalf("Begin under a cancelled ctx: attempt %v, err %v; want ctx's error", att != nil, err)
	}
	if _, err := l.Get(ctxT(t), c.Key); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("the row of a Begin under a cancelled ctx: %v, want none", err)
	}
}

// While PostgreSQL hangs, every Begin returns its error within about WriteTimeout,
// however many calls queued behind one another's groups (not GroupMax at a time, one
// WriteTimeout per group); and once PostgreSQL answers again the ledger writes.
func TestBeginsFailWithinWriteTimeoutWhilePostgresHangs(t *testing.T) {
	t.Parallel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	l, err := ledger.New(pool, ledger.Config{WriteTimeout: time.Second, GroupMax: 4, Wait: -1, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	if _, _, err := l.Begin(ctx, callOf("job-warm/s", request("x"))); err != nil { // a connection to hang on
		t.Fatal(err)
	}
	resume := pg.Pause()
	const n = 16
	took := make([]time.Duration, n)
	errs := make([]error, n)
	together(n, func(i int) {
		start := time.Now()
		_, _, errs[i] = l.Begin(ctx, callOf(fmt.Sprintf("job-hung-%d/s", i), request("x")))
		took[i] = time.Since(start)
	})
	resume()
	for i := range n {
		if errs[i] == nil {
			t.Errorf("Begin %d while PostgreSQL hung: no error", i)
		}
		// One WriteTimeout per group of 4 would end the last group at 4s.
		if took[i] > 3*time.Second {
			t.Errorf("Begin %d while PostgreSQL hung returned after %v; want about WriteTimeout (1s)", i, took[i])
		}
	}
	// Once PostgreSQL answers again the ledger writes: each Begin is tried as a caller
	// would (a failure within WriteTimeout is an error to retry), since the resumed
	// server first works off what queued while it hung.
	together(n, func(i int) {
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, _, errs[i] = l.Begin(ctx, callOf(fmt.Sprintf("job-after-%d/s", i), request("x")))
			if errs[i] == nil || time.Now().After(deadline) {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	for i, err := range errs {
		if err != nil {
			t.Errorf("Begin %d after PostgreSQL answered again: %v", i, err)
		}
	}
}

// cutAfterCommit is a connection to PostgreSQL that, once armed, lets the next
// pipeline of two or more statements (a group transaction) reach PostgreSQL whole and
// then drops the connection before its answer is read: the group committed, and its
// callers see a lost connection.
type cutAfterCommit struct {
	net.Conn
	armed *atomic.Bool
	buf   []byte
	start bool // the startup message was passed
	execs int
	cut   atomic.Bool // set by Write, read by pgx's background reader
}

func (c *cutAfterCommit) Write(p []byte) (int, error) {
	c.buf = append(c.buf, p...)
	for {
		if !c.start {
			if len(c.buf) < 4 {
				break
			}
			n := int(binary.BigEndian.Uint32(c.buf))
			if len(c.buf) < n {
				break
			}
			c.buf, c.start = c.buf[n:], true
			continue
		}
		if len(c.buf) < 5 {
			break
		}
		n := 1 + int(binary.BigEndian.Uint32(c.buf[1:]))
		if len(c.buf) < n {
			break
		}
		switch c.buf[0] {
		case 'E':
			c.execs++
		case 'S':
			if c.execs >= 2 && c.armed.CompareAndSwap(true, false) {
				c.cut.Store(true)
			}
			c.execs = 0
		}
		c.buf = c.buf[n:]
	}
	return c.Conn.Write(p)
}

func (c *cutAfterCommit) Read(p []byte) (int, error) {
	if c.cut.Load() {
		time.Sleep(300 * time.Millisecond) // PostgreSQL runs the group and commits it
		c.Conn.Close()
		return 0, io.ErrUnexpectedEOF
	}
	return c.Conn.Read(p)
}

// cutPool returns a pool on a test schema whose connections are cutAfterCommit, the
// switch that arms them, and a plain pool on the same schema (for checks no cut may
// reach).
func cutPool(t *testing.T) (*pgxpool.Pool, *atomic.Bool, *pgxpool.Pool) {
	t.Helper()
	plain, dsn := testenv.Postgres(t)
	pcfg, err := connect.PostgresConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	armed := &atomic.Bool{}
	dialer := &net.Dialer{}
	pcfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &cutAfterCommit{Conn: c, armed: armed}, nil
	}
	pool, err := pgxpool.NewWithConfig(ctxT(t), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, armed, plain
}

// A group transaction that committed as its connection dropped leaves each call its own
// outcome: every Begin of the group gets its attempt (found by its owner token), every
// answer of the group is its own (ours), none waits for a lease or counts as ambiguous.
func TestGroupCommittedAsItsConnectionDroppedGivesEachCallItsOwnRow(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool, armed, plain := cutPool(t)
	reg := prometheus.NewRegistry()
	l, err := ledger.New(pool, ledger.Config{GroupLinger: ledger.MaxGroupLinger, Wait: -1, Registerer: reg, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	// A call in progress makes every group's first write wait for the others.
	other, _, err := l.Begin(ctx, callOf("job-other/s", request("x")))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Fail(ctx, nil, false)

	const n = 8
	atts := make([]*ledger.Attempt, n)
	errs := make([]error, n)
	armed.Store(true)
	together(n, func(i int) {
		atts[i], _, errs[i] = l.Begin(ctx, callOf(fmt.Sprintf("job-%d/s", i), request("x")))
	})
	if armed.Load() {
		t.Fatal("no group transaction was cut: the test proves nothing")
	}
	for i := range n {
		if errs[i] != nil || atts[i] == nil {
			t.Fatalf("Begin %d, whose group committed as its connection dropped: %v", i, errs[i])
		}
		if atts[i].Number() != 1 || atts[i].Ambiguous() != 0 {
			t.Fatalf("Begin %d: attempt %d, %d ambiguous; want 1 and 0", i, atts[i].Number(), atts[i].Ambiguous())
		}
	}

	armed.Store(true)
	ours := make([]bool, n)
	together(n, func(i int) {
		_, ours[i], errs[i] = atts[i].Succeed(ctx, ledger.ResultOf(&llm.Response{Content: fmt.Sprintf("answer %d", i)}))
	})
	if armed.Load() {
		t.Fatal("no answers' group transaction was cut: the test proves nothing")
	}
	check, err := ledger.New(plain, ledger.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if errs[i] != nil || !ours[i] {
			t.Fatalf("Succeed %d, whose group committed as its connection dropped: ours %v, %v; want its own answer", i, ours[i], errs[i])
		}
		if r := mustGet(t, check, atts[i].Key()); r.State != ledger.StateSucceeded {
			t.Fatalf("row %d: %s", i, r.State)
		}
	}
	// A cut group is counted as failed; a write that found itself alone (a group of one,
	// when make test's load spreads the eight out) runs as a plain statement and is not.
	if got := counterValue(t, reg, "onceflow_llm_ledger_group_failures_total", nil); got < 1 {
		t.Fatalf("group failures counted: %v, want at least 1 (the groups cut)", got)
	}
}

// onceflow_llm_ledger_group_writes counts every transaction of in-flight rows and
// answers by its writes (docs/operations.md: "writes ... per group transaction"), one
// of one write included: its mean is the sharing group commit achieves.
func TestGroupWritesCountsAWriteAloneAsAGroupOfOne(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	l, _ := newLedger(t, ledger.Config{Registerer: reg})
	ctx := ctxT(t)
	att, _, err := l.Begin(ctx, callOf("job-alone/s", request("x")))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := att.Succeed(ctx, ledger.ResultOf(&llm.Response{Content: "a"})); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var count uint64
	for _, f := range families {
		if f.GetName() == "onceflow_llm_ledger_group_writes" {
			count = f.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	if count != 2 {
		t.Fatalf("onceflow_llm_ledger_group_writes observed %d transactions for a call alone (its in-flight row, its answer), want 2", count)
	}
}

// Concurrent Begins of one key, grouped with each other and with calls of other keys:
// exactly one of them gets the attempt, the others find it live, and the other keys'
// calls all get theirs.
func TestConcurrentBeginsOfOneKeyGiveItsRowToOneWhileOthersAreGrouped(t *testing.T) {
	t.Parallel()
	l, _, w := countedLedger(t, ledger.Config{GroupLinger: ledger.MaxGroupLinger, Wait: 300 * time.Millisecond})
	ctx := ctxT(t)
	callInProgress(t, l)
	const n = 16
	for round := range 3 {
		atts := make([]*ledger.Attempt, n)
		errs := make([]error, n)
		together(n, func(i int) {
			work := fmt.Sprintf("job-%d-same/s", round)
			if i%2 == 1 {
				work = fmt.Sprintf("job-%d-%c/s", round, 'a'+i)
			}
			atts[i], _, errs[i] = l.Begin(ctx, callOf(work, request("x")))
		})
		owners := 0
		for i := 0; i < n; i += 2 {
			switch {
			case atts[i] != nil:
				owners++
			case !errors.Is(errs[i], ledger.ErrInFlight):
				t.Fatalf("round %d: Begin %d of the shared key: %v, want an attempt or ErrInFlight", round, i, errs[i])
			}
		}
		if owners != 1 {
			t.Fatalf("round %d: %d of %d concurrent Begins of one key got an attempt, want 1", round, owners, n/2)
		}
		for i := 1; i < n; i += 2 {
			if errs[i] != nil || atts[i] == nil {
				t.Fatalf("round %d: Begin %d of its own key: %v", round, i, errs[i])
			}
		}
	}
	w.requireShared(t)
}

// An answer that finds another attempt's answer recorded, in a group with answers that
// record theirs, gets that other answer (ours false) and fails none of the others.
func TestAnAnswerSupersededInAGroupGetsTheRecordedOneAndTheOthersCommit(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	l, pool, w := countedLedger(t, ledger.Config{Registerer: reg, GroupLinger: ledger.MaxGroupLinger})
	ctx := ctxT(t)
	callInProgress(t, l)
	const n = 12
	atts := make([]*ledger.Attempt, n)
	for i := range n {
		var err error
		if atts[i], _, err = l.Begin(ctx, callOf(fmt.Sprintf("job-%c/s", 'a'+i), request("x"))); err != nil || atts[i] == nil {
			t.Fatalf("Begin %d: %v", i, err)
		}
	}
	// Another attempt's answer for the call of atts[5], recorded before this attempt's.
	if _, err := pool.Exec(ctx, `UPDATE llm_calls SET state = 'succeeded', response = '{"id":"other"}', owner = NULL, lease_until = NULL
		WHERE idem_key = $1`, atts[5].Key()); err != nil {
		t.Fatal(err)
	}
	w.batches.Store(0)
	w.batched.Store(0)
	recs := make([]*ledger.Record, n)
	ours := make([]bool, n)
	errs := make([]error, n)
	together(n, func(i int) {
		recs[i], ours[i], errs[i] = atts[i].Succeed(ctx, ledger.ResultOf(&llm.Response{ID: fmt.Sprint("mine-", i), Content: "answer"}))
	})
	for i := range n {
		switch {
		case errs[i] != nil:
			t.Fatalf("Succeed %d: %v", i, errs[i])
		case i == 5 && (ours[i] || !strings.Contains(string(recs[i].Response), `"other"`)):
			t.Fatalf("the superseded answer: ours %v, record %s; want the other attempt's", ours[i], recs[i].Response)
		case i != 5 && !ours[i]:
			t.Fatalf("Succeed %d: not ours beside a superseded answer", i)
		case i != 5:
			if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateSucceeded {
				t.Fatalf("row %d: %s", i, r.State)
			}
		}
	}
	w.requireShared(t)
	if got := counterValue(t, reg, "onceflow_llm_ledger_group_failures_total", nil); got != 0 {
		t.Fatalf("%v groups failed and were written again call by call: the superseded answer should fail no group", got)
	}
}

// Behind PgBouncer in transaction mode the URL carries default_query_exec_mode=exec
// (docs/operations.md, "PostgreSQL settings"): pgx then prepares nothing and encodes
// every argument from its Go type alone. A group's writes still commit as one group,
// not fail every time and be written again call by call.
func TestGroupsCommitUnderTheExecQueryMode(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	w := &writeCounter{}
	pool, err := connect.Postgres(ctxT(t), dsn+"&default_query_exec_mode=exec", w)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	reg := prometheus.NewRegistry()
	l := ledgerOn(t, pool, ledger.Config{Registerer: reg, GroupLinger: ledger.MaxGroupLinger})
	ctx := ctxT(t)
	callInProgress(t, l)
	const n = 12
	atts := make([]*ledger.Attempt, n)
	errs := make([]error, n)
	together(n, func(i int) {
		atts[i], _, errs[i] = l.Begin(ctx, callOf(fmt.Sprintf("job-%c/s", 'a'+i), request("x")))
	})
	for i, err := range errs {
		if err != nil || atts[i] == nil {
			t.Fatalf("Begin %d: %v", i, err)
		}
	}
	together(n, func(i int) {
		_, _, errs[i] = atts[i].Succeed(ctx, ledger.ResultOf(&llm.Response{ID: fmt.Sprint("mine-", i), Content: "answer"}))
	})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Succeed %d: %v", i, err)
		}
	}
	w.requireShared(t)
	if got := counterValue(t, reg, "onceflow_llm_ledger_group_failures_total", nil); got != 0 {
		t.Fatalf("%v of %d groups failed and were written again call by call under default_query_exec_mode=exec", got, w.batches.Load())
	}
}
