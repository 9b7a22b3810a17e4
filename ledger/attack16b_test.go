package ledger_test

// Attacks on issue 16's second pass: Announce and AppendPartial commit with
// synchronous_commit off (followerWrite, a set_config(..., true) joined into the
// UPDATE). Each test states what must hold.

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// crashablePostgres is a migrated PostgreSQL of the test's own whose WAL writer waits
// 10 s and whose autovacuum is off (as in TestRelaxedInsertCrashLosesOnlyAnAccountingRecord):
// within the test's window only a durable commit flushes the WAL, so a SIGKILL loses
// exactly the relaxed commits since the last durable one. params are appended to the
// URL; open returns a one-connection pool on it.
func crashablePostgres(t *testing.T, params string) (pg *testenv.Server, open func() *pgxpool.Pool) {
	t.Helper()
	pg = testenv.PrivatePostgres(t)
	dsn := testenv.PostgresURLOf(pg)
	ctx := ctxT(t)
	if _, err := migrations.Up(ctx, dsn, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	open = func() *pgxpool.Pool {
		p, err := connect.Postgres(ctx, dsn+"&pool_max_conns=1"+params, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	pool := open()
	for _, sql := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET autovacuum = off`, `SELECT pg_reload_conf()`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	pool.Close()
	time.Sleep(200 * time.Millisecond) // let the WAL writer pick up its new delay
	return pg, open
}

// A ledger may run on a pgx.Tx (ledger.DB says so). set_config(..., true) is SET LOCAL:
// it lasts until the end of the transaction, and on a Tx that is the caller's, so the
// follower writes must not leave synchronous_commit off for what the caller commits
// with them (the answer Succeed records, the effects derived from it).
func TestAttack16bFollowerWritesDoNotRelaxTheCallersTransaction(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	l, err := ledger.New(tx, ledger.Config{Lease: time.Hour, Wait: -1, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	call := callOf("attack16b-tx", request("tx"))
	att, rec, err := l.Begin(ctx, call)
	if err != nil || rec != nil {
		t.Fatalf("begin: %v %v", rec, err)
	}
	defer att.Fail(ctx, nil, false)
	show := func() string {
		var s string
		if err := tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if s := show(); s != "on" {
		t.Fatalf("synchronous_commit before the follower writes: %q", s)
	}
	if ok, err := att.Announce(ctx, []byte(`{"status":200}`)); !ok || err != nil {
		t.Fatalf("announce: %v %v", ok, err)
	}
	if ok, err := att.AppendPartial(ctx, "data: one\n\n"); !ok || err != nil {
		t.Fatalf("append: %v %v", ok, err)
	}
	if s := show(); s != "on" {
		t.Fatalf("synchronous_commit of the caller's transaction after Announce/AppendPartial on a ledger over a pgx.Tx = %q, want on: "+
			"its commit (the Succeed that follows, the caller's effects) would not wait for the WAL flush", s)
	}
}

// The partial output on the row is always an exact prefix of what the attempt
// appended: followers on other processes pass it on from the offset they reached.
// A PostgreSQL crash loses the last relaxed appends; the owner, which was told they
// committed, appends on after the restart (its pool replaced the dead connection on
// a ping, so no write of its failed). The row must then not hold the earlier output
// with a hole in it.
func TestAttack16bCrashLostAppendLeavesNoHoleInThePartial(t *testing.T) {
	t.Parallel()
	pg, open := crashablePostgres(t, "")
	pool := open()
	ctx := ctxT(t)
	cfg := ledger.Config{Lease: time.Hour, Wait: -1, Clock: retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), Logger: testenv.Logger(t)}
	l, _ := ledger.New(pool, cfg)
	call := ledger.Call{Key: "attack16b-hole", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
	att, _, err := l.Begin(ctx, call)
	if err != nil {
		t.Fatal(err)
	}
	const a, b, c = "data: {\"n\":\"a\"}\n\n", "data: {\"n\":\"b\"}\n\n", "data: {\"n\":\"c, a longer event than b\"}\n\n"
	if ok, err := att.Announce(ctx, []byte(`{"status":200}`)); !ok || err != nil {
		t.Fatalf("announce: %v %v", ok, err)
	}
	if ok, err := att.AppendPartial(ctx, a); !ok || err != nil {
		t.Fatalf("append a: %v %v", ok, err)
	}
	// Any durable commit (a lease renewal, another call's Begin or Succeed) flushes the
	// WAL so far: the announcement and a are on disk.
	if _, err := pool.Exec(ctx, `CREATE TABLE durable_commit ()`); err != nil {
		t.Fatal(err)
	}
	if ok, err := att.AppendPartial(ctx, b); !ok || err != nil {
		t.Fatalf("append b: %v %v", ok, err)
	}
	if p, err := l.Progress(ctx, call.Key, 0); err != nil || string(p.Partial) != a+b {
		t.Fatalf("before the crash: %+v %v", p, err)
	}
	pg.Kill()
	pg.Start()
	time.Sleep(1200 * time.Millisecond) // the pool pings a connection idle for over 1 s before using it
	// A write that fails makes the owner stop persisting (no hole possible): the
	// attack needs it to go through. One that reports the row no longer takes this
	// attempt's output (false) is a correct answer.
	ok, err := att.AppendPartial(ctx, c)
	if err != nil {
		t.Fatalf("append c after the restart: %v (the pool did not replace its dead connection)", err)
	}
	p, err := l.Progress(ctx, call.Key, 0)
	if err != nil || !p.Streaming {
		t.Fatalf("after the restart: %+v %v", p, err)
	}
	if !strings.HasPrefix(a+b+c, string(p.Partial)) || ok && string(p.Partial) != a+b+c {
		follower, _ := l.Progress(ctx, call.Key, len(a+b))
		t.Fatalf("append c: %v; the row's partial after a crash lost b = %q: not a prefix of the stream %q; a follower that had a+b reads on with %q",
			ok, p.Partial, a+b+c, follower.Partial)
	}
}

// The setting is applied whenever the UPDATE writes its row, also once PostgreSQL uses a
// generic plan for the prepared statement (pgx caches statements per connection; the
// plan is forced generic here): after eight appends, none of them flushed the WAL, so a
// crash loses the announcement and every append, while the durable Begin survives. Had
// any of them committed durably, its flush would have kept everything before it.
func TestAttack16bFollowerWritesStayRelaxedUnderAGenericPlan(t *testing.T) {
	t.Parallel()
	pg, open := crashablePostgres(t, "&plan_cache_mode=force_generic_plan")
	pool := open()
	ctx := ctxT(t)
	var mode string
	if err := pool.QueryRow(ctx, `SHOW plan_cache_mode`).Scan(&mode); err != nil || mode != "force_generic_plan" {
		t.Fatalf("plan_cache_mode %q %v", mode, err)
	}
	cfg := ledger.Config{Lease: time.Hour, Wait: -1, Clock: retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), Logger: testenv.Logger(t)}
	l, _ := ledger.New(pool, cfg)
	call := ledger.Call{Key: "attack16b-generic", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
	att, _, err := l.Begin(ctx, call)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := att.Announce(ctx, []byte(`{"status":200}`)); !ok || err != nil {
		t.Fatalf("announce: %v %v", ok, err)
	}
	for i := range 8 {
		if ok, err := att.AppendPartial(ctx, "data: x\n\n"); !ok || err != nil {
			t.Fatalf("append %d: %v %v", i, ok, err)
		}
	}
	var setting string
	if err := pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&setting); err != nil || setting != "on" {
		t.Fatalf("the session's synchronous_commit after the follower writes = %q (%v), want on", setting, err)
	}
	pg.Kill()
	pg.Start()
	pool = open()
	l, _ = ledger.New(pool, cfg)
	r, err := l.Get(ctx, call.Key)
	if err != nil || r.State != ledger.StateInFlight || r.Attempt != 1 {
		t.Fatalf("the durable in-flight row after the crash: %+v %v", r, err)
	}
	if r.Partial != "" || r.Meta != nil {
		t.Fatalf("partial %q and meta %s survived the crash: one of the follower writes under a generic plan committed durably", r.Partial, r.Meta)
	}
}
