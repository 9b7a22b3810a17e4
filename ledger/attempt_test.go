package ledger_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

func TestFirstRecordedResponseWins(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l, _ := newLedger(t, ledger.Config{Lease: time.Second, Wait: -1, Clock: clock})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	stallCtx, stall := context.WithCancel(ctx)
	slow, _, err := l.Begin(stallCtx, c)
	if err != nil {
		t.Fatal(err)
	}
	stall()
	clock.Advance(2 * time.Second)
	fast, _, err := l.Begin(ctx, c)
	if err != nil || fast == nil {
		t.Fatalf("take-over: %v", err)
	}
	// The stalled attempt was alive after all: its answer arrives first.
	rec, ours, err := slow.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "slow", Content: "A"}))
	if err != nil || !ours || rec == nil {
		t.Fatalf("slow Succeed: %v %v", ours, err)
	}
	rec, ours, err = fast.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "fast", Content: "B"}))
	if err != nil || ours {
		t.Fatalf("fast Succeed: ours %v, %v; want the slow attempt's record", ours, err)
	}
	if resp, _ := rec.LLMResponse(); resp.ID != "slow" {
		t.Fatalf("fast attempt got %+v, want the recorded (slow) response", resp)
	}
}

func TestAmbiguousFailureKeepsTheRowInFlight(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	l, _ := newLedger(t, ledger.Config{Registerer: reg, Wait: -1})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	att, _, err := l.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	timeout := &retry.AttemptTimeoutError{Limit: time.Second, Err: context.DeadlineExceeded}
	if !ledger.IsAmbiguous(timeout) {
		t.Fatal("a per-call timeout is not ambiguous")
	}
	if err := att.Fail(ctx, timeout, true); err != nil {
		t.Fatal(err)
	}
	row := mustGet(t, l, c.Key)
	if row.State != ledger.StateInFlight || row.Attempt != 2 || row.Ambiguous != 1 || row.Owner != "" || !strings.Contains(row.Error, "timed out") {
		t.Fatalf("row after an ambiguous failure: %+v", row)
	}
	// The next attempt claims it at once (no lease to wait out), as attempt 2.
	next, _, err := l.Begin(ctx, c)
	if err != nil || next.Number() != 2 || next.Ambiguous() != 1 {
		t.Fatalf("retry: %v %v", next, err)
	}
	if v := counterValue(t, reg, "onceflow_llm_ledger_ambiguous_total", map[string]string{"provider": "openai"}); v != 1 {
		t.Errorf("ambiguous_total = %v", v)
	}
}

func TestClearFailureMarksTheRowFailed(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{Wait: -1})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	att, _, _ := l.Begin(ctx, c)
	apiErr := &llm.APIError{Provider: "openai", StatusCode: 429, Type: "requests", Code: "rate_limit_exceeded"}
	if ledger.IsAmbiguous(apiErr) {
		t.Fatal("a 429 is ambiguous")
	}
	if err := att.Fail(ctx, apiErr, false); err != nil {
		t.Fatal(err)
	}
	row := mustGet(t, l, c.Key)
	if row.State != ledger.StateFailed || row.Attempt != 2 || row.Ambiguous != 0 || !strings.Contains(row.Error, "429") {
		t.Fatalf("row: %+v", row)
	}
	next, _, err := l.Begin(ctx, c)
	if err != nil || next.Number() != 2 {
		t.Fatalf("retry after a clear failure: %v %v", next, err)
	}
	if mustGet(t, l, c.Key).State != ledger.StateInFlight {
		t.Fatal("claimed row not in_flight")
	}
}

func TestSucceedTxCommitsWithTheEffectOrNotAtAll(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{Wait: -1})
	ctx := ctxT(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (key text PRIMARY KEY, body text)`); err != nil {
		t.Fatal(err)
	}
	c := callOf("job-1/s", request("x"))
	att, _, _ := l.Begin(ctx, c)
	resp := &llm.Response{ID: "r", Content: "effect body"}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := att.SucceedTx(ctx, tx, ledger.ResultOf(resp)); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, c.Key, resp.Content); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(ctx) // the downstream write failed: neither commits
	if r := mustGet(t, l, c.Key); r.State != ledger.StateInFlight {
		t.Fatalf("after rollback the row is %s", r.State)
	}
	if err := att.Fail(ctx, errors.New("transaction rolled back"), false); err != nil {
		t.Fatal(err)
	}

	att, _, err = l.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	tx, _ = pool.Begin(ctx)
	rec, ours, err := att.SucceedTx(ctx, tx, ledger.ResultOf(resp))
	if err != nil || !ours {
		t.Fatal(err)
	}
	got, _ := rec.LLMResponse()
	if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, c.Key, got.Content); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&n)
	if r := mustGet(t, l, c.Key); r.State != ledger.StateSucceeded || n != 1 || r.Attempt != 2 {
		t.Fatalf("after commit: %s, attempt %d, %d effects", r.State, r.Attempt, n)
	}
}

// A row that succeeds near the end of its retention gets a new
// expires_at (now + Retention), so a purge right after keeps it: the recorded response
// is what a redelivery of its job replays. A succeeding row's expiry is never shortened.
func TestSucceedRefreshesExpiresAt(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l, pool := newLedger(t, ledger.Config{Retention: time.Hour, Lease: 10 * time.Minute, Clock: clock, Wait: -1})
	ctx := ctxT(t)
	late := callOf("job-late/s", request("x"))
	att, _, err := l.Begin(ctx, late)
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(59 * time.Minute) // a slow call, or a retry late in the window
	if _, _, err := att.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "r"})); err != nil {
		t.Fatal(err)
	}
	if got, want := mustGet(t, l, late.Key).ExpiresAt, clock.Now().Add(time.Hour); !got.Equal(want) {
		t.Errorf("expires_at %v after a success at %v, want now + Retention = %v", got, clock.Now(), want)
	}
	clock.Advance(2 * time.Minute) // past the first attempt's expiry
	if n, err := l.Purge(ctx); err != nil || n != 0 {
		t.Fatalf("purged %d rows (%v) right after a late success, want 0", n, err)
	}
	if r := mustGet(t, l, late.Key); r == nil || r.State != "succeeded" {
		t.Fatalf("row after the purge: %+v, want the succeeded row", r)
	}

	// An expiry further out than now + Retention (set by an operator, or by a longer
	// retention earlier) is kept.
	far := callOf("job-far/s", request("y"))
	att, _, err = l.Begin(ctx, far)
	if err != nil {
		t.Fatal(err)
	}
	farAway := clock.Now().Add(48 * time.Hour)
	if _, err := pool.Exec(ctx, `UPDATE llm_calls SET expires_at = $1 WHERE idem_key = $2`, farAway, far.Key); err != nil {
		t.Fatal(err)
	}
	if _, _, err := att.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "r2"})); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, l, far.Key).ExpiresAt; !got.Equal(farAway) {
		t.Errorf("expires_at %v after success, want the later %v kept", got, farAway)
	}
}

func TestLiveOwnerRenewsItsLease(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	// A 300ms lease renews every 100ms of real time, each renewal extending it from the
	// (manual) clock's now.
	l, _ := newLedger(t, ledger.Config{Lease: 300 * time.Millisecond, Wait: -1, Clock: clock})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	ownerCtx, ownerGone := context.WithCancel(ctx)
	defer ownerGone()
	if _, _, err := l.Begin(ownerCtx, c); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Hour) // without renewal the lease is long gone
	testenv.WaitFor(t, 20*time.Second, "the live owner to renew its lease", func() bool {
		return mustGet(t, l, c.Key).LeaseUntil.After(clock.Now())
	})
	if _, _, err := l.Begin(ctx, c); !errors.Is(err, ledger.ErrInFlight) {
		t.Fatalf("a renewed lease was taken over: %v", err)
	}
	ownerGone() // the owner stops renewing
	time.Sleep(300 * time.Millisecond)
	clock.Advance(time.Second)
	att, _, err := l.Begin(ctx, c)
	if err != nil || att.Number() != 2 || att.Ambiguous() != 1 {
		t.Fatalf("take-over after the owner stopped: %v %v", att, err)
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
	const writeTimeout = 2 * time.Second // also the setup Begin's bound: 300ms failed it under -race on a loaded machine
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
	// The lock is held far longer than WriteTimeout; only WriteTimeout can end this write
	// before the minute is out (the bound leaves a loaded machine a wide margin).
	fctx, cancel := context.WithTimeout(ctx, time.Minute)
	start := time.Now()
	err = buf.Flush(fctx)
	took := time.Since(start)
	cancel()
	if err == nil || took > 30*time.Second {
		t.Fatalf("a write on a locked row: %v after %v; want an error after about %v", err, took, writeTimeout)
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
