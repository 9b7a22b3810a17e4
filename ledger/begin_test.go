package ledger_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"iter"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

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

// An owner cannot renew its lease while PostgreSQL is down, so after an outage longer
// than the lease every lease in the table has run out, the live owners' too. The lease
// therefore also counts from PostgreSQL's start: for one lease after a restart no row
// is taken over (a live owner renews meanwhile), and Progress calls such a row live, as
// Begin judges it. Here the owner is gone (its renewal stopped with its context), so
// the row is taken over once that lease passed.
func TestLeaseCountsFromPostgresStart(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	pg, open := crashablePostgres(t, "&pool_max_conns=1")
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

// TestRelaxedInsertCrashLosesOnlyAnAccountingRecord proves what Config.RelaxedInsert
// (synchronous_commit off for the in-flight insert alone) can lose when PostgreSQL
// crashes (SIGKILL, a power cut for the database): the in_flight row of a call in
// progress, which is an accounting record (one ambiguous attempt goes uncounted), never
// an effect. Three jobs are in different states at the crash:
//
//   - B, inserted durably, calling the model: its row survives (the control);
//   - C, inserted relaxed, answered, its response and effect committed durably: the
//     durable commit also flushed the earlier relaxed insert; it replays after the
//     crash, no second call;
//   - A, inserted relaxed, calling the model: its row is lost.
//
// After the restart every job is redelivered. A calls the model again as if for the
// first time (attempt 1, no ambiguity recorded: that is the loss); B's dead attempt is
// taken over and counted as ambiguous. Each job ends with exactly one effect.
func TestRelaxedInsertCrashLosesOnlyAnAccountingRecord(t *testing.T) {
	t.Parallel()
	pg, open := crashablePostgres(t, "")
	ctx := ctxT(t)
	pool := open()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (job text PRIMARY KEY, body text NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	newLedgers := func(p *pgxpool.Pool) (durable, relaxed *ledger.Ledger) {
		cfg := ledger.Config{Lease: time.Minute, Wait: -1, Clock: clock, Logger: testenv.Logger(t)}
		durable, _ = ledger.New(p, cfg)
		cfg.RelaxedInsert = true
		relaxed, _ = ledger.New(p, cfg)
		return durable, relaxed
	}
	durable, relaxed := newLedgers(pool)
	model := &countingModel{}
	calls := map[string]int{}
	job := func(name string) (ledger.Call, *llm.Request) {
		req := request("job " + name)
		work := ledger.Work(name, "summarise")
		return ledger.Call{Key: ledger.Key(work, req), Work: work, RequestHash: ledger.RequestHash(req), Provider: "openai", Model: req.Model}, req
	}
	// finish commits the response and the job's effect in one transaction.
	finish := func(p *pgxpool.Pool, att *ledger.Attempt, name string, resp *llm.Response) {
		tx, err := p.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		rec, _, err := att.SucceedTx(ctx, tx, ledger.ResultOf(resp))
		if err != nil {
			t.Fatal(err)
		}
		got, _ := rec.LLMResponse()
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, name, got.Content); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	callModel := func(name string, req *llm.Request) *llm.Response {
		calls[name]++
		resp, err := model.Complete(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}

	callB, reqB := job("B")
	if _, _, err := durable.Begin(ctx, callB); err != nil {
		t.Fatal(err)
	}
	callModel("B", reqB) // the request went out; the answer never gets recorded

	callC, reqC := job("C")
	attC, _, err := relaxed.Begin(ctx, callC)
	if err != nil {
		t.Fatal(err)
	}
	finish(pool, attC, "C", callModel("C", reqC))

	callA, reqA := job("A")
	if _, _, err := relaxed.Begin(ctx, callA); err != nil {
		t.Fatal(err)
	}
	callModel("A", reqA) // the request went out
	pg.Kill()            // kill -9 of PostgreSQL: a crash of the database machine
	pg.Start()

	pool = open()
	durable, relaxed = newLedgers(pool)
	if _, err := durable.Get(ctx, callA.Key); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("job A's relaxed in-flight row survived the crash (%v): with wal_writer_delay 10s it should have been lost", err)
	}
	if r, err := durable.Get(ctx, callB.Key); err != nil || r.State != ledger.StateInFlight || r.Owner == "" {
		t.Fatalf("job B's durable in-flight row after the crash: %+v %v", r, err)
	}
	if r, err := durable.Get(ctx, callC.Key); err != nil || r.State != ledger.StateSucceeded {
		t.Fatalf("job C after the crash: %+v %v (its durable success must also have made the relaxed insert durable)", r, err)
	}

	// Redelivery of all three jobs, with the relaxed ledger as in production.
	redeliver := func(name string, c ledger.Call, req *llm.Request) {
		att, rec, err := relaxed.Begin(ctx, c)
		if errors.Is(err, ledger.ErrInFlight) { // B's dead owner still holds its lease: wait it out
			clock.Advance(2 * time.Minute)
			att, rec, err = relaxed.Begin(ctx, c)
		}
		if err != nil {
			t.Fatalf("redeliver %s: %v", name, err)
		}
		if rec != nil {
			return // replayed: no call, and the effect is already there
		}
		finish(pool, att, name, callModel(name, req))
	}
	redeliver("A", callA, reqA)
	redeliver("B", callB, reqB)
	redeliver("C", callC, reqC)

	for name, want := range map[string]int{"A": 2, "B": 2, "C": 1} {
		if calls[name] != want {
			t.Errorf("job %s: %d model calls, want %d", name, calls[name], want)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE job = $1`, name).Scan(&n); err != nil || n != 1 {
			t.Errorf("job %s: %d effects (%v), want exactly 1", name, n, err)
		}
	}
	a, _ := durable.Get(ctx, callA.Key)
	b, _ := durable.Get(ctx, callB.Key)
	// What the crash lost: A's first attempt. Two requests went out for A, and the
	// ledger shows one attempt and no ambiguity; B, durable, shows both.
	if a.State != ledger.StateSucceeded || a.Attempt != 1 || a.Ambiguous != 0 {
		t.Errorf("job A: %s, attempt %d, ambiguous %d; want succeeded, 1, 0 (the lost accounting record)", a.State, a.Attempt, a.Ambiguous)
	}
	if b.State != ledger.StateSucceeded || b.Attempt != 2 || b.Ambiguous != 1 {
		t.Errorf("job B: %s, attempt %d, ambiguous %d; want succeeded, 2, 1", b.State, b.Attempt, b.Ambiguous)
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
