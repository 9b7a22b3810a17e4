package limiter_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/limiter/pgbudget"
	"github.com/onceflow/onceflow/llm"
)

// TestStalledBudgetStoreHoldsNeitherRunNorBudgets: a regression test (attack round 2 of issue 15).
//
// Scenario: PostgreSQL does not fail, it stalls: a migration (or an operator's
// VACUUM FULL / ALTER TABLE) holds an ACCESS EXCLUSIVE lock on tenant_budgets, or the
// pool is exhausted, or the server is black-holed. refreshBudgets runs inside Run's one
// loop, with Run's context (no deadline), so the SELECT blocks the loop for as long as
// the stall (statement_timeout, 30 s by default, or minutes for a black hole / a full
// pool), and while it blocks Run does nothing else: no sync of pauses and learnt limits,
// no retry of kept settlements, no write of the cost view. And since the read neither
// succeeds nor fails, a process started meanwhile uses neither its tenants' own
// budgets nor the copy in Redis (the fix for "budgets unknown after a PostgreSQL outage
// at start" only covers a read that fails): acme, with its own budget of 1,000 tokens
// a day, gets the default, unlimited.
//
// What the operator sees: `onceflow tenants list` shows no calls; acme spends far
// beyond its budget. What should happen: the read of the budgets has its own timeout
// (a few seconds) and runs outside the loop that keeps Redis state fresh; a read that
// times out falls back to the copy like a failed one.
func TestStalledBudgetStoreHoldsNeitherRunNorBudgets(t *testing.T) {
	_, _, pool := testenv.MigratedPrivatePostgres(t, "")
	ctx := context.Background()
	store := pgbudget.New(pool)
	if err := store.Set(ctx, "acme", 1000); err != nil {
		t.Fatal(err)
	}
	rdb, prefix := testenv.Redis(t)
	// An earlier process read the budgets and left their copy in Redis.
	first := newLimiter(t, rdb, prefix, limiter.Config{Budgets: store})
	fctx, fcancel := context.WithCancel(ctx)
	fdone := make(chan struct{})
	go func() { defer close(fdone); _ = first.Run(fctx) }()
	testenv.WaitFor(t, 5*time.Second, "the first process's budgets", func() bool { return first.Budget("acme") == 1000 })
	fcancel()
	<-fdone

	// A migration holds the table.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE tenant_budgets IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}

	l := newLimiter(t, rdb, prefix, limiter.Config{Budgets: store, MaxWait: time.Millisecond, SyncInterval: 50 * time.Millisecond})
	run(t, l)
	time.Sleep(300 * time.Millisecond)
	admitted := 0
	for i := range 3 {
		p, err := l.Acquire(ctx, call("acme", fmt.Sprint("w", i), 100, 500)) // 600 tokens each
		if err != nil {
			continue
		}
		admitted++
		p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 100, OutputTokens: 500}})
	}
	if admitted != 1 {
		t.Errorf("PostgreSQL stalled (tenant_budgets locked): %d calls of 600 tokens admitted for acme, whose own budget (1000/day) is in the Redis copy; want 1", admitted)
	}
	// Run should still write the cost view every SyncInterval (50ms).
	deadline := time.Now().Add(3 * time.Second)
	for {
		us, err := l.Usage(ctx, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		calls := int64(0)
		for _, u := range us {
			calls += u.Calls
		}
		if calls == int64(admitted) && admitted > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("3s (60 SyncIntervals) after %d settled calls the cost view holds %d: Run is stuck in the read of the budgets", admitted, calls)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lateAdmission is a go-redis hook that makes the next admission (EVALSHA with 8
// keys) time out at once in the client, and delivers it to Redis only `after` later:
// a command that stalled in the network (TCP retransmissions, a partition healing) and
// reached Redis after the client gave up on it.
type lateAdmission struct {
	rdb   *redis.Client
	after time.Duration
	armed atomic.Bool
	ran   chan error
}

func (h *lateAdmission) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *lateAdmission) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *lateAdmission) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if len(args) > 2 && strings.HasPrefix(cmd.Name(), "eval") && fmt.Sprint(args[2]) == "8" && h.armed.CompareAndSwap(true, false) {
			go func() {
				time.Sleep(h.after)
				h.ran <- h.rdb.Do(context.Background(), args...).Err()
			}()
			err := fmt.Errorf("read tcp: i/o timeout: %w", os.ErrDeadlineExceeded)
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

// TestLateAdmissionAfterItsReleaseAdmitsNothing: a regression test (attack round 2 of issue 15).
//
// Scenario (attacking the fix "an admission whose reply is lost is ended as a call that
// never left"): the admission's reply is lost because the command itself was delayed
// (a stalled network), not because Redis ran it before the timeout. The limiter keeps
// the release, Run sends it within a SyncInterval on another connection, it finds
// nothing (a no-op), and THEN the delayed admission runs in Redis: it takes the model's
// only concurrency slot, the tenant's budget reservation and a request, for a call that
// will never be made and whose release has already been spent.
//
// What the operator sees: a model with ONCEFLOW_LLM_CONCURRENCY=1 (or a tenant cap)
// admits nothing for the permit's lease (2 minutes), and then the tenant is charged the
// whole reservation of a call never made. What should happen: the release leaves a
// tombstone (e.g. "r:<permit>" with the lease's TTL) that admitScript checks, so an
// admission arriving after its release is a no-op.
func TestLateAdmissionAfterItsReleaseAdmitsNothing(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	side, _ := testenv.Redis(t) // a plain client for the delayed command
	h := &lateAdmission{rdb: side, after: 500 * time.Millisecond, ran: make(chan error, 1)}
	rdb.AddHook(h)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{Concurrency: 1}, TenantTokenBudget: 10_000,
		MaxWait: time.Millisecond, SyncInterval: 50 * time.Millisecond})
	run(t, l)
	ctx := context.Background()
	// Load the script so that the delayed EVALSHA finds it.
	p, err := l.Acquire(ctx, call("acme", "warm", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})

	h.armed.Store(true)
	if _, err := l.Acquire(ctx, call("acme", "lost", 1000, 1000)); err == nil {
		t.Fatal("the armed admission was not intercepted")
	}
	if err := <-h.ran; err != nil {
		t.Fatalf("the delayed admission: %v", err)
	}
	time.Sleep(300 * time.Millisecond) // Run has retried everything it keeps
	_, err = l.Acquire(ctx, call("acme", "next", 10, 10))
	u := usageOf(t, l, "acme")
	if err != nil || u.BudgetReserved != 20 { // the next call's own reservation
		t.Fatalf("after an admission that arrived late, its release having run first: next call %v; acme's budget reserved %d (want 20, the next call's own): the phantom permit holds the only slot and 2000 tokens for its 2-minute lease, then is charged",
			err, u.BudgetReserved)
	}
}
