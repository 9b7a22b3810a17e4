package ledger_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/retry/retrytest"
)

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
	pg := testenv.PrivatePostgres(t)
	dsn := testenv.PostgresURLOf(pg)
	ctx := ctxT(t)
	if _, err := migrations.Up(ctx, dsn, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	open := func() *pgxpool.Pool {
		p, err := connect.Postgres(ctx, dsn, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	pool := open()
	// Keep the WAL writer from writing the relaxed commit within the test's
	// millisecond window (it would otherwise within 200ms), and autovacuum from
	// committing (and so flushing) behind our back: the crash then deterministically
	// lands before the relaxed commit reached the OS.
	for _, sql := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET autovacuum = off`,
		`SELECT pg_reload_conf()`, `CREATE TABLE effects (job text PRIMARY KEY, body text NOT NULL)`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond) // let the WAL writer pick up its new delay

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

// TestStreamProgressCrashLosesOnlyFollowerData proves what the writes of a stream in
// progress (Attempt.Announce and AppendPartial, committed with synchronous_commit off)
// can lose when PostgreSQL crashes: the announcement and the partial output, which
// serve followers, and nothing else. The row's durable in-flight state survives, the
// next attempt takes the call over as after any crash of its owner, and the answer it
// records (Succeed, durable) survives a second crash. The setting stays inside the
// statements: the session that ran them still commits durably.
func TestStreamProgressCrashLosesOnlyFollowerData(t *testing.T) {
	t.Parallel()
	pg := testenv.PrivatePostgres(t)
	dsn := testenv.PostgresURLOf(pg)
	ctx := ctxT(t)
	if _, err := migrations.Up(ctx, dsn, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	open := func() *pgxpool.Pool {
		// One connection: the session the follower writes ran on is the one asked
		// about synchronous_commit afterwards.
		p, err := connect.Postgres(ctx, dsn+"&pool_max_conns=1", nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	pool := open()
	// As in TestRelaxedInsertCrashLosesOnlyAnAccountingRecord: nothing but a durable
	// commit flushes the WAL within the test's window.
	for _, sql := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET autovacuum = off`, `SELECT pg_reload_conf()`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond)

	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	cfg := ledger.Config{Lease: time.Minute, Wait: -1, Clock: clock, Logger: testenv.Logger(t)}
	l, _ := ledger.New(pool, cfg)
	call := ledger.Call{Key: "stream-crash", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
	att, _, err := l.Begin(ctx, call) // durable
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := att.Announce(ctx, []byte(`{"status":200}`)); !ok || err != nil {
		t.Fatalf("announce: %v %v", ok, err)
	}
	if ok, err := att.AppendPartial(ctx, "data: one\n\n"); !ok || err != nil {
		t.Fatalf("append: %v %v", ok, err)
	}
	var setting string
	if err := pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&setting); err != nil || setting != "on" {
		t.Fatalf("synchronous_commit of the session after the follower writes = %q (%v), want on", setting, err)
	}
	if r, err := l.Get(ctx, call.Key); err != nil || r.Partial != "data: one\n\n" || r.Meta == nil {
		t.Fatalf("before the crash the follower writes are visible at once: %+v %v", r, err)
	}
	pg.Kill()
	pg.Start()

	pool = open()
	l, _ = ledger.New(pool, cfg)
	r, err := l.Get(ctx, call.Key)
	if err != nil || r.State != ledger.StateInFlight || r.Owner == "" || r.Attempt != 1 {
		t.Fatalf("the durable in-flight row after the crash: %+v %v", r, err)
	}
	if r.Partial != "" || r.Meta != nil || r.PartialAttempt != 0 {
		t.Fatalf("the announcement and partial survived the crash (partial %q, meta %s): with wal_writer_delay 10s they should have been lost, as commits that do not wait for the flush", r.Partial, r.Meta)
	}

	clock.Advance(2 * time.Minute) // the dead owner's lease runs out
	att, rec, err := l.Begin(ctx, call)
	if err != nil || rec != nil || att.Number() != 2 {
		t.Fatalf("take-over after the crash: %v %v %v", att, rec, err)
	}
	if ok, err := att.AppendPartial(ctx, "data: two\n\n"); !ok || err != nil {
		t.Fatalf("append: %v %v", ok, err)
	}
	if _, _, err := att.Succeed(ctx, ledger.Result{Response: []byte(`{}`), Raw: []byte("data: two\n\n")}); err != nil {
		t.Fatal(err)
	}
	pg.Kill()
	pg.Start()
	pool = open()
	l, _ = ledger.New(pool, cfg)
	if r, err := l.Get(ctx, call.Key); err != nil || r.State != ledger.StateSucceeded || string(r.Raw) != "data: two\n\n" || r.Attempt != 2 || r.Ambiguous != 1 {
		t.Fatalf("the recorded answer after a second crash: %+v %v", r, err)
	}
}
