package ledger_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"net"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/http2"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

func TestKeyIsDerivedFromTheWorkAndTheRequest(t *testing.T) {
	t.Parallel()
	base := func() *llm.Request {
		return &llm.Request{Model: "gpt-4.1-mini", Temperature: llm.Float(0.2), MaxTokens: 100,
			Messages: []llm.Message{{Role: llm.RoleUser, Content: "refund order A-17"},
				{Role: llm.RoleAssistant, ToolCalls: []llm.ToolCall{{ID: "c1", Name: "refund", Arguments: `{"order":"A-17","amount":10}`}}}},
			Tools: []llm.Tool{{Name: "refund", Parameters: []byte(`{"type":"object","properties":{"order":{"type":"string"}}}`)}}}
	}
	work := ledger.Work("job-1", "refund")
	key := ledger.Key(work, base())
	if !strings.HasPrefix(key, "llm-") || len(key) != 68 {
		t.Fatalf("key %q", key)
	}
	same := base()
	same.IdempotencyKey = "attempt-7" // the attempt never enters the key
	same.Tools[0].Parameters = []byte("{ \"properties\": {\"order\": {\"type\": \"string\"}}, \"type\": \"object\" }")
	same.Messages[1].ToolCalls[0].Arguments = `{"amount":10.0,"order":"A-17"}`
	if ledger.Key(work, same) != key {
		t.Error("re-encoded JSON inside the request, or the IdempotencyKey, changed the key")
	}
	for name, change := range map[string]func(r *llm.Request){
		"model":       func(r *llm.Request) { r.Model = "gpt-4.1" },
		"message":     func(r *llm.Request) { r.Messages[0].Content += "!" },
		"role":        func(r *llm.Request) { r.Messages[0].Role = llm.RoleSystem },
		"temperature": func(r *llm.Request) { r.Temperature = llm.Float(0.3) },
		"no temp":     func(r *llm.Request) { r.Temperature = nil },
		"max tokens":  func(r *llm.Request) { r.MaxTokens = 101 },
		"tool":        func(r *llm.Request) { r.Tools[0].Name = "charge" },
		"tool args":   func(r *llm.Request) { r.Messages[1].ToolCalls[0].Arguments = `{"order":"A-18","amount":10}` },
	} {
		r := base()
		change(r)
		if ledger.Key(work, r) == key {
			t.Errorf("changing the %s kept the key", name)
		}
	}
	if ledger.Key(ledger.Work("job-2", "refund"), base()) == key || ledger.Key(ledger.Work("job-1", "refund2"), base()) == key {
		t.Error("another job or step has the same key")
	}
	if ledger.Work("a/b", "c") == ledger.Work("b", "c/a") || ledger.Work("x", "a/b") == ledger.Work("b/x", "a") {
		t.Error("Work is ambiguous")
	}
}

func TestInsertedBeforeTheCallAndReplayedAfter(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{})
	ctx := ctxT(t)
	req := request("hello")
	c := callOf("job-1/summarise", req)
	att, rec, err := l.Begin(ctx, c)
	if err != nil || rec != nil || att == nil {
		t.Fatalf("Begin: %v %v %v", att, rec, err)
	}
	row := mustGet(t, l, c.Key)
	if row.State != ledger.StateInFlight || row.Attempt != 1 || row.Owner == "" || !row.LeaseUntil.After(time.Now().Add(-time.Minute)) ||
		row.Work != c.Work || row.RequestHash != c.RequestHash || row.Provider != "openai" || row.Model != "gpt-4.1-mini" {
		t.Fatalf("row before the call: %+v", row)
	}
	if d := row.ExpiresAt.Sub(row.CreatedAt); d < 23*time.Hour || d > 25*time.Hour {
		t.Errorf("expires %v after creation, want the 24h default retention", d)
	}

	raw := []byte(`{"id":"chatcmpl-1",   "choices":[{"message":{"content":"hi"}}]}`) // spacing a jsonb would lose
	resp := &llm.Response{ID: "chatcmpl-1", Content: "hi", FinishReason: "stop", Raw: raw}
	got, ours, err := att.Succeed(ctx, ledger.ResultOf(resp))
	if err != nil || !ours || got.Attempt != 1 {
		t.Fatalf("Succeed: %+v %v %v", got, ours, err)
	}
	row = mustGet(t, l, c.Key)
	if row.State != ledger.StateSucceeded || row.Owner != "" || !bytes.Equal(row.Raw, raw) || len(row.Response) == 0 {
		t.Fatalf("row after success: %+v", row)
	}

	att2, rec, err := l.Begin(ctx, c)
	if err != nil || att2 != nil || rec == nil {
		t.Fatalf("second Begin: %v %v %v", att2, rec, err)
	}
	replayed, err := rec.LLMResponse()
	if err != nil || replayed.ID != "chatcmpl-1" || replayed.Content != "hi" || !bytes.Equal(replayed.Raw, raw) {
		t.Fatalf("replay %+v %v", replayed, err)
	}
}

func TestLiveOwnerIsWaitedForThenReplayed(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{Wait: 30 * time.Second})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	att, _, err := l.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		att *ledger.Attempt
		rec *ledger.Record
		err error
	}
	waiter := make(chan result, 1)
	go func() {
		a, r, err := l.Begin(ctx, c)
		waiter <- result{a, r, err}
	}()
	select {
	case r := <-waiter:
		t.Fatalf("second Begin did not wait for the live owner: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	if _, _, err := att.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "r1", Content: "done"})); err != nil {
		t.Fatal(err)
	}
	r := <-waiter
	if r.err != nil || r.att != nil || r.rec == nil {
		t.Fatalf("waiter got %+v", r)
	}
	if resp, _ := r.rec.LLMResponse(); resp.ID != "r1" {
		t.Fatalf("waiter replayed %+v", resp)
	}
}

func TestWaitIsBoundedAndInFlightIsRetryable(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l, pool := newLedger(t, ledger.Config{Wait: 5 * time.Second, Clock: clock})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	if _, _, err := l.Begin(ctx, c); err != nil {
		t.Fatal(err)
	}
	_, _, err := l.Begin(ctx, c)
	var ife *ledger.InFlightError
	if !errors.As(err, &ife) || !errors.Is(err, ledger.ErrInFlight) || ife.Attempt != 1 {
		t.Fatalf("err %v, want an InFlightError", err)
	}
	if v := retry.Classify(err); !v.Retryable || v.Class != retry.ClassConflict {
		t.Fatalf("classified %+v, want a retryable conflict", v)
	}
	var waited time.Duration
	for _, d := range clock.Sleeps() {
		waited += d
	}
	if waited < 5*time.Second || waited > 6*time.Second {
		t.Errorf("waited %v (sleeps %v), want about Config.Wait = 5s", waited, clock.Sleeps())
	}
	for i, d := range clock.Sleeps() {
		if d > time.Second {
			t.Errorf("poll %d slept %v, more than the 1s cap", i, d)
		}
	}
	// Wait < 0: no wait at all.
	l2, err2 := ledger.New(pool, ledger.Config{Wait: -1, Clock: retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))})
	if err2 != nil {
		t.Fatal(err2)
	}
	if _, _, err := l2.Begin(ctx, c); !errors.Is(err, ledger.ErrInFlight) {
		t.Fatalf("Wait -1: %v", err)
	}
}

func TestDeadOwnerIsTakenOverAfterTheLeaseAndCountedAmbiguous(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	reg := prometheus.NewRegistry()
	l, _ := newLedger(t, ledger.Config{Lease: 15 * time.Second, Wait: -1, Clock: clock, Registerer: reg})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	deadCtx, die := context.WithCancel(ctx)
	dead, _, err := l.Begin(deadCtx, c)
	if err != nil {
		t.Fatal(err)
	}
	die() // the owner's process is gone: nothing renews its lease any more

	clock.Advance(14 * time.Second)
	if _, _, err := l.Begin(ctx, c); !errors.Is(err, ledger.ErrInFlight) {
		t.Fatalf("before the lease ran out: %v, want ErrInFlight", err)
	}
	clock.Advance(2 * time.Second)
	att, rec, err := l.Begin(ctx, c)
	if err != nil || rec != nil || att == nil {
		t.Fatalf("after the lease: %v %v %v", att, rec, err)
	}
	if att.Number() != 2 || att.Ambiguous() != 1 {
		t.Fatalf("took over as attempt %d with %d ambiguous, want 2 and 1", att.Number(), att.Ambiguous())
	}
	row := mustGet(t, l, c.Key)
	if row.State != ledger.StateInFlight || row.Attempt != 2 || row.Ambiguous != 1 {
		t.Fatalf("row %+v", row)
	}
	if v := counterValue(t, reg, "onceflow_llm_ledger_ambiguous_total", map[string]string{"provider": "openai", "model": "gpt-4.1-mini"}); v != 1 {
		t.Errorf("ambiguous_total = %v, want 1", v)
	}
	// The dead attempt's late Fail changes nothing: the row is not its any more.
	if err := dead.Fail(ctx, errors.New("late"), true); err != nil {
		t.Fatal(err)
	}
	if r := mustGet(t, l, c.Key); r.Attempt != 2 || r.Ambiguous != 1 || r.Owner == "" {
		t.Fatalf("a late Fail of the dead attempt changed the row: %+v", r)
	}
}

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

func TestKeyReusedWithAnotherRequest(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{})
	ctx := ctxT(t)
	c := callOf("job-1/s", request("x"))
	if _, _, err := l.Begin(ctx, c); err != nil {
		t.Fatal(err)
	}
	c.RequestHash = ledger.RequestHash(request("y"))
	_, _, err := l.Begin(ctx, c)
	if !errors.Is(err, ledger.ErrKeyReused) || !retry.IsPermanent(err) {
		t.Fatalf("err %v, want a permanent ErrKeyReused", err)
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

func TestConcurrentCallersMakeOneCall(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{Wait: 30 * time.Second})
	ctx := ctxT(t)
	model := &countingModel{delay: 200 * time.Millisecond}
	client := l.Wrap("openai", model)
	req := request("concurrent")
	req.IdempotencyKey = ledger.Work("job-1", "summarise")
	const n = 8
	var wg sync.WaitGroup
	ids := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			resp, err := client.Complete(ctx, req)
			errs[i] = err
			if resp != nil {
				ids[i] = resp.ID
			}
		})
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil || ids[i] != ids[0] || ids[i] == "" {
			t.Fatalf("caller %d: %q %v (first %q)", i, ids[i], errs[i], ids[0])
		}
	}
	if got := model.calls(); got != 1 {
		t.Fatalf("%d model calls for %d concurrent callers, want 1", got, n)
	}
	if k := model.lastKey(); k != ledger.Key(req.IdempotencyKey, req) {
		t.Errorf("provider got Idempotency-Key %q, want the ledger key", k)
	}
}

func TestPurgeDeletesExpiredRowsInBatches(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l, pool := newLedger(t, ledger.Config{Retention: time.Hour, Lease: 10 * time.Minute, PurgeBatch: 2, Clock: clock, Wait: -1})
	ctx := ctxT(t)
	for i := range 5 {
		att, _, err := l.Begin(ctx, callOf(fmt.Sprintf("job-%d/s", i), request("x")))
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := att.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "r"})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.ToolKeys(ctx, "openai", "req", []llm.ToolCall{{ID: "c1", Name: "t", Arguments: "{}"}}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(59 * time.Minute)
	live, _, err := l.Begin(ctx, callOf("job-live/s", request("x"))) // created now: expires in an hour
	if err != nil {
		t.Fatal(err)
	}
	n, err := l.Purge(ctx)
	if err != nil || n != 0 {
		t.Fatalf("purged %d before expiry (%v)", n, err)
	}
	clock.Advance(2 * time.Minute)
	n, err = l.Purge(ctx)
	if err != nil || n != 6 {
		t.Fatalf("purged %d rows (%v), want 5 calls and 1 tool call", n, err)
	}
	// An expired in_flight row whose owner still renews is kept.
	clock.Advance(time.Hour)
	if _, err := pool.Exec(ctx, `UPDATE llm_calls SET lease_until = $1`, clock.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if n, _ := l.Purge(ctx); n != 0 {
		t.Fatalf("purged a live in_flight row")
	}
	_ = live.Fail(ctx, errors.New("x"), false)
	if n, _ := l.Purge(ctx); n != 1 {
		t.Fatalf("purged %d, want the now failed expired row", n)
	}
}

// Issue 12, item 8: a row that succeeds near the end of its retention gets a new
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

func TestStats(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{Wait: -1})
	ctx := ctxT(t)
	a1, _, _ := l.Begin(ctx, callOf("j1/s", request("1")))
	_ = a1.Fail(ctx, io.ErrUnexpectedEOF, true)
	a1, _, err := l.Begin(ctx, callOf("j1/s", request("1")))
	if err != nil {
		t.Fatal(err)
	}
	_, _, _ = a1.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "x"}))
	a2, _, _ := l.Begin(ctx, callOf("j2/s", request("2")))
	_ = a2.Fail(ctx, &llm.APIError{StatusCode: 400}, false)
	a3, _, _ := l.Begin(ctx, callOf("j3/s", request("3")))
	_ = a3.Fail(ctx, context.DeadlineExceeded, true)
	other := ledger.Call{Key: "k-other", RequestHash: "h", Provider: "anthropic", Model: "claude-haiku-4-5"}
	if _, _, err := l.Begin(ctx, other); err != nil {
		t.Fatal(err)
	}
	st, err := ledger.ReadStats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	want := []ledger.Stats{
		{Provider: "anthropic", Model: "claude-haiku-4-5", Calls: 1, InFlight: 1, Attempts: 1},
		{Provider: "openai", Model: "gpt-4.1-mini", Calls: 3, InFlight: 1, Succeeded: 1, Failed: 1, Abandoned: 1, Attempts: 2 + 2 + 2, Ambiguous: 2},
	}
	if fmt.Sprint(st) != fmt.Sprint(want) {
		t.Fatalf("stats\n%+v\nwant\n%+v", st, want)
	}
}

func TestIsAmbiguous(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"429", &llm.APIError{StatusCode: 429}, false},
		{"500", &llm.APIError{StatusCode: 500}, false},
		{"400", &llm.APIError{StatusCode: 400}, false},
		{"502 from a proxy", &llm.APIError{StatusCode: 502}, true},
		{"504 from a proxy", &llm.APIError{StatusCode: 504}, true},
		{"stream error event", &llm.APIError{StatusCode: 200, Type: "server_error"}, false},
		{"malformed answer", llm.Malformed("openai", "", errors.New("bad")), false},
		{"permanent before sending", retry.Permanent(errors.New("unknown role")), false},
		{"per-call timeout", &retry.AttemptTimeoutError{Err: context.DeadlineExceeded}, true},
		{"canceled", fmt.Errorf("openai: %w", context.Canceled), true},
		{"reset", &url.Error{Op: "Post", Err: &net.OpError{Op: "read", Err: syscall.ECONNRESET}}, true},
		{"truncated", fmt.Errorf("openai: %w", io.ErrUnexpectedEOF), true},
		{"refused", &url.Error{Op: "Post", Err: &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}}, false},
		{"dns", &url.Error{Op: "Post", Err: &net.DNSError{Err: "no such host"}}, false},
		{"dial timeout", &url.Error{Op: "Post", Err: &net.OpError{Op: "dial", Err: context.DeadlineExceeded}}, false},
		{"in flight", &ledger.InFlightError{}, false},
		// HTTP/2: the request was sent on a stream; only the server's word that it did
		// not process it (REFUSED_STREAM, a GOAWAY below the stream) makes it clear.
		{"h2 RST_STREAM INTERNAL_ERROR", &url.Error{Op: "Post", Err: http2.StreamError{StreamID: 1, Code: http2.ErrCodeInternal, Cause: errors.New("received from peer")}}, true},
		{"h2 RST_STREAM REFUSED_STREAM", &url.Error{Op: "Post", Err: http2.StreamError{StreamID: 1, Code: http2.ErrCodeRefusedStream, Cause: errors.New("received from peer")}}, false},
		{"h2 GOAWAY below the stream", fmt.Errorf("openai: %w", &url.Error{Op: "Post", Err: errors.New("http2: Transport received GOAWAY from server ErrCode:INTERNAL_ERROR")}), false},
		{"h2 GOAWAY covering the stream", &url.Error{Op: "Post", Err: errors.New(`http2: server sent GOAWAY and closed the connection; LastStreamID=1, ErrCode=NO_ERROR, debug=""`)}, true},
		{"h2 connection lost", &url.Error{Op: "Post", Err: errors.New("http2: client connection lost")}, true},
		{"unknown", errors.New("something"), true},
	} {
		if got := ledger.IsAmbiguous(tc.err); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// countingModel is an llm.Client that answers after delay and counts calls; it stands
// for a provider (outside this machine) in tests about the ledger's own logic.
type countingModel struct {
	delay time.Duration
	mu    sync.Mutex
	n     int
	key   string
	fail  []error
}

func (m *countingModel) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	m.mu.Lock()
	m.n++
	n := m.n
	m.key = req.IdempotencyKey
	var err error
	if len(m.fail) > 0 {
		err, m.fail = m.fail[0], m.fail[1:]
	}
	m.mu.Unlock()
	if m.delay > 0 {
		select {
		case <-time.After(m.delay):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if err != nil {
		return nil, err
	}
	return &llm.Response{ID: fmt.Sprintf("resp-%d", n), Content: "answer " + fmt.Sprint(n), FinishReason: "stop", Raw: []byte(`{"n":` + fmt.Sprint(n) + `}`)}, nil
}

func (m *countingModel) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	panic("not used")
}

func (m *countingModel) calls() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n
}

func (m *countingModel) lastKey() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.key
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
	deadline := time.Now().Add(20 * time.Second)
	for !mustGet(t, l, c.Key).LeaseUntil.After(clock.Now()) {
		if time.Now().After(deadline) {
			t.Fatal("the live owner never renewed its lease")
		}
		time.Sleep(20 * time.Millisecond)
	}
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

func TestDatabaseErrorsAreRetryable(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/onceflow?sslmode=disable&connect_timeout=1", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	l, _ := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
	_, _, err = l.Begin(ctxT(t), callOf("job-1/s", request("x")))
	if !errors.Is(err, ledger.ErrUnavailable) || !retry.Transient(err) || !retry.Classify(err).Retryable {
		t.Fatalf("Begin with PostgreSQL down: %v (classified %+v), want a retryable ErrUnavailable", err, retry.Classify(err))
	}
}
