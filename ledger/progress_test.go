package ledger_test

import (
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// TestStreamProgressCrashLosesOnlyFollowerData proves what the writes of a stream in
// progress (Attempt.Announce and AppendPartial, committed with synchronous_commit off)
// can lose when PostgreSQL crashes: the announcement and the partial output, which
// serve followers, and nothing else. The row's durable in-flight state survives, the
// next attempt takes the call over as after any crash of its owner, and the answer it
// records (Succeed, durable) survives a second crash. The setting stays inside the
// statements: the session that ran them still commits durably.
func TestStreamProgressCrashLosesOnlyFollowerData(t *testing.T) {
	t.Parallel()
	// One connection: the session the follower writes ran on is the one asked about
	// synchronous_commit afterwards.
	pg, open := crashablePostgres(t, "&pool_max_conns=1")
	ctx := ctxT(t)
	pool := open()

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

// The writes that serve followers (Announce and AppendPartial) commit with
// synchronous_commit off, a set_config(..., true) joined into their UPDATE: a crash may
// lose them, never anything else, and never leave a hole in what it keeps.
func TestFollowerWrites(t *testing.T) {
	t.Parallel()
	// A ledger may run on a pgx.Tx (ledger.DB says so). set_config(..., true) is SET LOCAL:
	// it lasts until the end of the transaction, and on a Tx that is the caller's, so the
	// follower writes must not leave synchronous_commit off for what the caller commits
	// with them (the answer Succeed records, the effects derived from it).
	t.Run("do not relax the caller's transaction", func(t *testing.T) {
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
		call := callOf("follower-tx", request("tx"))
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
	})
	// The setting is applied whenever the UPDATE writes its row, also once PostgreSQL uses a
	// generic plan for the prepared statement (pgx caches statements per connection; the
	// plan is forced generic here): after eight appends, none of them flushed the WAL, so a
	// crash loses the announcement and every append, while the durable Begin survives. Had
	// any of them committed durably, its flush would have kept everything before it.
	t.Run("stay relaxed under a generic plan", func(t *testing.T) {
		t.Parallel()
		pg, open := crashablePostgres(t, "&pool_max_conns=1&plan_cache_mode=force_generic_plan")
		pool := open()
		ctx := ctxT(t)
		var mode string
		if err := pool.QueryRow(ctx, `SHOW plan_cache_mode`).Scan(&mode); err != nil || mode != "force_generic_plan" {
			t.Fatalf("plan_cache_mode %q %v", mode, err)
		}
		cfg := ledger.Config{Lease: time.Hour, Wait: -1, Clock: retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), Logger: testenv.Logger(t)}
		l, _ := ledger.New(pool, cfg)
		call := ledger.Call{Key: "follower-generic", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
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
	})
	// The partial output on the row is always an exact prefix of what the attempt
	// appended: followers on other processes pass it on from the offset they reached.
	// A PostgreSQL crash loses the last relaxed appends; the owner, which was told they
	// committed, appends on after the restart (its pool replaced the dead connection on
	// a ping, so no write of its failed). The row must then not hold the earlier output
	// with a hole in it.
	t.Run("a crash-lost append leaves no hole in the partial", func(t *testing.T) {
		t.Parallel()
		pg, open := crashablePostgres(t, "&pool_max_conns=1")
		pool := open()
		ctx := ctxT(t)
		cfg := ledger.Config{Lease: time.Hour, Wait: -1, Clock: retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), Logger: testenv.Logger(t)}
		l, _ := ledger.New(pool, cfg)
		call := ledger.Call{Key: "follower-hole", Work: "POST /v1/chat/completions", RequestHash: "h", Provider: "openai", Model: "m"}
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
		// scenario needs it to go through. One that reports the row no longer takes this
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
	})
}
