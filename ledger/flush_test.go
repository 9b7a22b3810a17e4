package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// TestDeferredAnswerIsDurableOnceALaterCommitFlushedIt crashes PostgreSQL (kill -9,
// wal_writer_delay 10s so that nothing but a commit flushes the WAL) after three
// answers recorded under DeferFlush: one followed by a durable commit of another row
// (the job's Commit), one by Flush, one by nothing. The first two survive; the third
// is lost, and its row is back in_flight as the durable Begin left it: the next
// attempt takes it over after the lease, counted as ambiguous.
func TestDeferredAnswerIsDurableOnceALaterCommitFlushedIt(t *testing.T) {
	t.Parallel()
	pg, open := crashablePostgres(t, "")
	ctx := ctxT(t)
	pool := open()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (job text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	cfg := ledger.Config{Lease: time.Minute, Wait: -1, Clock: clock, Logger: testenv.Logger(t)}
	l, err := ledger.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	answer := func(name string) (ledger.Call, *ledger.Deferred) {
		c := callOf(name+"/summarise", request("job "+name))
		att, _, err := l.Begin(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		var d ledger.Deferred
		if _, ours, err := att.Succeed(ledger.DeferFlush(ctx, &d), ledger.ResultOf(&llm.Response{Content: "answer " + name})); err != nil || !ours {
			t.Fatalf("answer %s: %v %v", name, ours, err)
		}
		if !d.Pending() {
			t.Fatalf("answer %s recorded under DeferFlush is not pending", name)
		}
		return c, &d
	}
	committed, _ := answer("committed")
	if _, err := pool.Exec(ctx, `INSERT INTO effects VALUES ('committed')`); err != nil { // the job's Commit
		t.Fatal(err)
	}
	flushed, d := answer("flushed")
	if err := l.Flush(ctx, d); err != nil || d.Pending() {
		t.Fatalf("Flush: %v, pending after it: %v", err, d.Pending())
	}
	lost, _ := answer("lost")

	pg.Kill()
	pg.Start()
	pool = open()
	if l, err = ledger.New(pool, cfg); err != nil {
		t.Fatal(err)
	}
	for _, c := range []ledger.Call{committed, flushed} {
		if r := mustGet(t, l, c.Key); r.State != ledger.StateSucceeded {
			t.Errorf("%s after the crash: %s, want succeeded (flushed by a later durable commit)", c.Work, r.State)
		}
	}
	r := mustGet(t, l, lost.Key)
	if r.State != ledger.StateInFlight || r.Owner == "" {
		t.Fatalf("%s after the crash: %s owned by %q; want the durable in-flight row (with wal_writer_delay 10s the unflushed answer is lost)", lost.Work, r.State, r.Owner)
	}
	if _, _, err := l.Begin(ctx, lost); !errors.Is(err, ledger.ErrInFlight) {
		t.Fatalf("Begin of the lost answer's call within the lease: %v, want ErrInFlight", err)
	}
	clock.Advance(2 * time.Minute)
	att, rec, err := l.Begin(ctx, lost)
	if err != nil || rec != nil || att == nil || att.Number() != 2 || att.Ambiguous() != 1 {
		t.Fatalf("Begin after the lease: attempt %v, record %v, %v; want attempt 2 taking over, 1 ambiguous", att, rec, err)
	}
}

func TestFlushWithoutPendingAnswersWritesNothing(t *testing.T) {
	t.Parallel()
	var rt roundtrip.Counter
	l, _ := tracedLedger(t, ledger.Config{}, &rt)
	var d ledger.Deferred
	if err := l.Flush(ctxT(t), &d); err != nil {
		t.Fatal(err)
	}
	if err := l.Flush(ctxT(t), nil); err != nil {
		t.Fatal(err)
	}
	if n := rt.Postgres(); n != 0 {
		t.Fatalf("Flush with nothing pending made %d round trips, want none", n)
	}
	// The same Flush with an answer pending writes once: the count above can see it.
	att, _, err := l.Begin(ctxT(t), callOf("job-1/s", request("x")))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := att.Succeed(ledger.DeferFlush(ctxT(t), &d), ledger.ResultOf(&llm.Response{Content: "a"})); err != nil {
		t.Fatal(err)
	}
	rt.Reset()
	if err := l.Flush(ctxT(t), &d); err != nil || rt.Postgres() == 0 || d.Pending() {
		t.Fatalf("Flush with an answer pending: %v, %d round trips, pending after: %v; want a write and nothing pending", err, rt.Postgres(), d.Pending())
	}
}

func TestAnswerOnATransactionIgnoresDeferFlush(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{})
	ctx := ctxT(t)
	att, _, err := l.Begin(ctx, callOf("job-1/s", request("x")))
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var d ledger.Deferred
	if _, _, err := att.SucceedTx(ledger.DeferFlush(ctx, &d), tx, ledger.ResultOf(&llm.Response{Content: "a"})); err != nil {
		t.Fatal(err)
	}
	var setting string
	if err := tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&setting); err != nil || setting != "on" {
		t.Fatalf("synchronous_commit in the caller's transaction after SucceedTx: %q %v, want on", setting, err)
	}
	if d.Pending() {
		t.Fatal("an answer in the caller's transaction was counted as deferred")
	}
}

// An answer recorded under DeferFlush is pending until a durable commit flushed it,
// also when its group transaction committed as its connection dropped and the answer
// was found recorded afterwards (ours): Flush, or the caller's Commit, is what makes it
// durable, and a delivery flushes only what is pending.
func TestDeferredAnswerFoundAfterALostConnectionIsPending(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool, armed, _ := cutPool(t)
	l, err := ledger.New(pool, ledger.Config{GroupLinger: ledger.MaxGroupLinger, Wait: -1, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	other, _, err := l.Begin(ctx, callOf("job-other/s", request("x"))) // makes groups wait for each other's writes
	if err != nil {
		t.Fatal(err)
	}
	defer other.Fail(ctx, nil, false)
	const n = 8
	atts := make([]*ledger.Attempt, n)
	for i := range n {
		if atts[i], _, err = l.Begin(ctx, callOf(fmt.Sprintf("job-%d/s", i), request("x"))); err != nil {
			t.Fatal(err)
		}
	}
	ds := make([]ledger.Deferred, n)
	ours := make([]bool, n)
	errs := make([]error, n)
	armed.Store(true)
	together(n, func(i int) {
		_, ours[i], errs[i] = atts[i].Succeed(ledger.DeferFlush(ctx, &ds[i]), ledger.ResultOf(&llm.Response{Content: fmt.Sprintf("answer %d", i)}))
	})
	if armed.Load() {
		t.Fatal("no group transaction was cut: the test proves nothing")
	}
	for i := range n {
		if errs[i] != nil || !ours[i] {
			t.Fatalf("answer %d: ours %v, %v", i, ours[i], errs[i])
		}
		if !ds[i].Pending() {
			t.Errorf("answer %d, recorded without a flush by a group that committed as its connection dropped: not pending", i)
		}
	}
}

// DeferFlush with a nil Deferred makes answers durable again under a context that
// deferred them: the answer commits waiting for its flush, and nothing is pending.
func TestDeferFlushOfNilMakesTheAnswerDurableAgain(t *testing.T) {
	t.Parallel()
	commits := &roundtrip.Commits{}
	l, _ := tracedLedger(t, ledger.Config{}, commits)
	var d ledger.Deferred
	deferred := ledger.DeferFlush(ctxT(t), &d)
	for _, c := range []struct {
		name             string
		ctx              context.Context
		durable, relaxed int64
	}{{"deferred", deferred, 0, 1}, {"deferred, then nil", ledger.DeferFlush(deferred, nil), 1, 0}} {
		att, _, err := l.Begin(ctxT(t), callOf("job-"+c.name+"/s", request("x")))
		if err != nil {
			t.Fatal(err)
		}
		d.Flushed()
		commits.Reset()
		if _, _, err := att.Succeed(c.ctx, ledger.ResultOf(&llm.Response{Content: "a"})); err != nil {
			t.Fatal(err)
		}
		if commits.Durable() != c.durable || commits.Relaxed() != c.relaxed || d.Pending() != (c.relaxed == 1) {
			t.Fatalf("%s: %d durable and %d relaxed commits, pending %v; want %d and %d", c.name, commits.Durable(), commits.Relaxed(), d.Pending(), c.durable, c.relaxed)
		}
	}
}

// FlushedSince clears the answers recorded before the mark, and keeps one recorded
// after it pending: a durable commit begun at the mark may not cover it.
func TestFlushedSinceKeepsAnAnswerRecordedAfterTheMark(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{})
	ctx := ctxT(t)
	var d ledger.Deferred
	answer := func(work string) {
		t.Helper()
		att, _, err := l.Begin(ctx, callOf(work, request(work)))
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := att.Succeed(ledger.DeferFlush(ctx, &d), ledger.ResultOf(&llm.Response{Content: work})); err != nil {
			t.Fatal(err)
		}
	}
	answer("job-1/a")
	mark := d.Mark()
	d.FlushedSince(mark)
	if d.Pending() {
		t.Fatal("an answer recorded before the mark is still pending after FlushedSince")
	}
	answer("job-1/b")
	mark = d.Mark()
	answer("job-1/c") // recorded after the mark: the commit may have missed it
	d.FlushedSince(mark)
	if !d.Pending() {
		t.Fatal("an answer recorded after the mark was counted flushed")
	}
}
