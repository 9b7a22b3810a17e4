package ledger_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
)

// An owner cannot renew its lease while PostgreSQL is down, so after an outage longer
// than the lease every lease in the table has run out, the live owners' too. The lease
// therefore also counts from PostgreSQL's start: for one lease after a restart no row
// is taken over (a live owner renews meanwhile), and Progress calls such a row live, as
// Begin judges it. Here the owner is gone (its renewal stopped with its context), so
// the row is taken over once that lease passed.
func TestLeaseCountsFromPostgresStart(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	pg, open := crashablePostgres(t, "")
	ctx := ctxT(t)
	cfg := ledger.Config{Lease: lease, Wait: -1, Logger: testenv.Logger(t)}
	l, _ := ledger.New(open(), cfg)
	call := ledger.Call{Key: "restart-grace", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
	octx, stopOwner := context.WithCancel(ctx)
	att, _, err := l.Begin(octx, call)
	if err != nil || att == nil {
		t.Fatalf("begin: %v %v", att, err)
	}
	stopOwner() // the owner's renewal ends with its context: it is gone
	time.Sleep(lease + 500*time.Millisecond)
	if p, err := l.Progress(ctx, call.Key, 0); err != nil || p == nil || p.Live {
		t.Fatalf("control: the lease of a gone owner ran out and PostgreSQL did not restart, the row should not be live: %+v %v", p, err)
	}

	pg.Stop()
	pg.Start()
	back := time.Now()
	l, _ = ledger.New(open(), cfg)
	p, err := l.Progress(ctx, call.Key, 0)
	if err != nil || p == nil || !p.Live {
		t.Fatalf("right after a restart the row should be live for a lease: %+v %v", p, err)
	}
	_, _, err = l.Begin(ctx, call)
	if !errors.Is(err, ledger.ErrInFlight) {
		if time.Since(back) < lease {
			t.Fatalf("a Begin right after the restart (%v after it) took over a row whose owner had no chance to renew: %v", time.Since(back), err)
		}
		t.Skipf("the Begin came %v after the restart, past the lease: %v", time.Since(back), err)
	}

	time.Sleep(time.Until(back.Add(lease + 300*time.Millisecond)))
	att, rec, err := l.Begin(ctx, call)
	if err != nil || rec != nil || att == nil || att.Number() != 2 {
		t.Fatalf("a lease after the restart the gone owner's row should be taken over (attempt 2): %v %v %v", att, rec, err)
	}
	if _, _, err := att.Succeed(ctx, ledger.Result{Response: []byte(`{}`), Raw: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
}

// A partial write that fails (PostgreSQL unavailable) keeps its text: the next write
// carries it with what came after, so the row's partial is never missing a piece of
// the output after an outage.
func TestPartialBufferKeepsWhatAFailedWriteHeld(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	l, _ := newLedger(t, ledger.Config{Wait: -1, StreamFlushBytes: 1 << 20, StreamFlushInterval: time.Hour})
	call := ledger.Call{Key: "partial-outage", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
	att := announcedAttempt(ctx, t, l, call)
	buf := att.PartialBuffer()
	if err := buf.Add(ctx, "data: one\n\n"); err != nil {
		t.Fatal(err)
	}
	if err := buf.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := buf.Add(ctx, "data: two\n\n"); err != nil {
		t.Fatal(err)
	}
	down, cancel := context.WithCancel(ctx)
	cancel() // a write that cannot reach PostgreSQL
	if err := buf.Flush(down); err == nil {
		t.Fatal("a flush on a cancelled context should fail")
	}
	if err := buf.Add(ctx, "data: three\n\n"); err != nil {
		t.Fatal(err)
	}
	if err := buf.Flush(ctx); err != nil {
		t.Fatalf("the flush after the failed one: %v", err)
	}
	if r := mustGet(t, l, call.Key); r.Partial != "data: one\n\ndata: two\n\ndata: three\n\n" {
		t.Fatalf("partial after a failed write = %q: the failed write's text must come with the next", r.Partial)
	}
}

// A partial write that PostgreSQL does not answer (here: the row locked by another
// transaction, as a hung server would hold it) fails within WriteTimeout, so the
// stream feeding the buffer is not held for the call's whole deadline, and the text is
// written once the row is free.
func TestPartialBufferWriteIsBoundedByWriteTimeout(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	const writeTimeout = 300 * time.Millisecond
	l, pool := newLedger(t, ledger.Config{Wait: -1, WriteTimeout: writeTimeout, StreamFlushBytes: 1 << 20, StreamFlushInterval: time.Hour})
	call := ledger.Call{Key: "partial-hung", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
	att := announcedAttempt(ctx, t, l, call)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // before the attempt's Fail at cleanup, which waits for the lock
	if _, err := tx.Exec(ctx, `SELECT 1 FROM llm_calls WHERE idem_key = $1 FOR UPDATE`, call.Key); err != nil {
		t.Fatal(err)
	}
	buf := att.PartialBuffer()
	if err := buf.Add(ctx, "data: one\n\n"); err != nil {
		t.Fatal(err)
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second) // longer: only WriteTimeout can end this write sooner
	start := time.Now()
	err = buf.Flush(fctx)
	took := time.Since(start)
	cancel()
	if err == nil || took > 10*writeTimeout {
		t.Fatalf("a write on a locked row: %v after %v; want an error within about %v", err, took, writeTimeout)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := buf.Flush(ctx); err != nil {
		t.Fatalf("the flush once the row is free: %v", err)
	}
	if r := mustGet(t, l, call.Key); r.Partial != "data: one\n\n" {
		t.Fatalf("partial = %q", r.Partial)
	}
}

// announcedAttempt begins call on l and announces its stream, as the gateway does before
// its first partial write; the attempt fails at cleanup.
func announcedAttempt(ctx context.Context, t *testing.T, l *ledger.Ledger, call ledger.Call) *ledger.Attempt {
	t.Helper()
	att, _, err := l.Begin(ctx, call)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = att.Fail(ctx, errors.New("test over"), false) })
	if ok, err := att.Announce(ctx, []byte(`{"status":200}`)); !ok || err != nil {
		t.Fatalf("announce: %v %v", ok, err)
	}
	return att
}
