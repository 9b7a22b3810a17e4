package limiter_test

import (
	"context"
	"errors"
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
	"github.com/onceflow/onceflow/retry"
)

// lostReply is a go-redis hook that lets Redis run the next script call with nkeys
// keys, then reports a timeout: the reply lost after the command ran (a stalled server
// or network, the client's read deadline passed), which the limiter cannot tell from a
// command that never arrived.
type lostReply struct {
	nkeys int64
	armed atomic.Bool
	hit   atomic.Int64
}

func (h *lostReply) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *lostReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *lostReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if err == nil && len(args) > 2 && strings.HasPrefix(cmd.Name(), "eval") && fmt.Sprint(args[2]) == fmt.Sprint(h.nkeys) &&
			h.armed.CompareAndSwap(true, false) {
			h.hit.Add(1)
			err = fmt.Errorf("read tcp: i/o timeout: %w", os.ErrDeadlineExceeded)
			cmd.SetErr(err)
		}
		return err
	}
}

// A settlement whose reply is lost is kept and retried by Run, although Redis ran it:
// the retry must change nothing, so the tenant is charged the call's usage once (not
// usage - reservation again, which would give a tenant back tokens after each hiccup).
func TestSettlementRunTwiceChargesOnce(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	hook := &lostReply{nkeys: 6} // settleScript
	rdb.AddHook(hook)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 100_000, Limits: limiter.Limits{TPM: 100_000},
		SyncInterval: 50 * time.Millisecond})
	run(t, l)
	p, err := l.Acquire(context.Background(), call("acme", "w1", 100, 1000)) // reserves 1,100 tokens
	if err != nil {
		t.Fatal(err)
	}
	hook.armed.Store(true)
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 100, OutputTokens: 50}})
	if hook.hit.Load() != 1 {
		t.Fatal("the settlement's reply was not lost: the test tests nothing")
	}
	time.Sleep(300 * time.Millisecond) // Run retries the kept settlement
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 150 || u.BudgetReserved != 0 {
		t.Fatalf("after a settlement ran and was retried: budget used %d reserved %d, want 150 and 0", u.BudgetUsed, u.BudgetReserved)
	}
}

// The same once the permit's lease ended before it settled: the reservation was
// charged whole, and the settlement, run twice, corrects that charge once.
func TestLateSettlementRunTwiceCorrectsOnce(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	hook := &lostReply{nkeys: 6}
	rdb.AddHook(hook)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 100_000, Lease: 200 * time.Millisecond,
		SyncInterval: 50 * time.Millisecond})
	run(t, l)
	ctx := context.Background()
	p, err := l.Acquire(ctx, call("acme", "slow", 100, 1000)) // reserves 1,100 tokens
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)                     // its lease ends
	q, err := l.Acquire(ctx, call("acme", "next", 10, 10)) // charges the lapsed reservation whole
	if err != nil {
		t.Fatal(err)
	}
	q.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 1120 {
		t.Fatalf("after the lease ended: used %d, want the whole reservation charged (1100) and the next call's 20", u.BudgetUsed)
	}
	hook.armed.Store(true)
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 100, OutputTokens: 50}})
	if hook.hit.Load() != 1 {
		t.Fatal("the settlement's reply was not lost: the test tests nothing")
	}
	time.Sleep(300 * time.Millisecond) // Run retries it
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 170 || u.BudgetReserved != 0 {
		t.Fatalf("after a late settlement ran twice: used %d reserved %d, want 170 (150 + 20) and 0", u.BudgetUsed, u.BudgetReserved)
	}
}

// An admission whose reply is lost may have been admitted by Redis, for a caller that
// gave up (its job is handed back and the call never made). The limiter ends it as a
// call that never left, so its reservation is released rather than charged as a lost
// call's when its lease ends.
func TestAdmissionWithALostReplyIsReleased(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	hook := &lostReply{nkeys: 8} // admitScript
	rdb.AddHook(hook)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 100_000, Lease: 300 * time.Millisecond,
		SyncInterval: 50 * time.Millisecond})
	run(t, l)
	hook.armed.Store(true)
	_, err := l.Acquire(context.Background(), call("acme", "lost-admission", 100, 1000))
	if err == nil || hook.hit.Load() != 1 {
		t.Fatalf("Acquire with its reply lost: %v (hits %d), want an error", err, hook.hit.Load())
	}
	if c := retry.Classify(err).Class; c != retry.ClassUnavailable {
		t.Fatalf("Acquire with its reply lost: %v classified %s, want unavailable (the job is handed back)", err, c)
	}
	time.Sleep(500 * time.Millisecond) // Run released it; its lease would have ended
	p, err := l.Acquire(context.Background(), call("acme", "next", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 20 || u.BudgetReserved != 0 {
		t.Fatalf("after an admission whose reply was lost: budget used %d reserved %d, want 20 and 0 (the call that was made)",
			u.BudgetUsed, u.BudgetReserved)
	}
}

// A pause announced on the limiter's channel (by a hostile or buggy publisher, or a
// process with a larger MaxPause) is bounded by this process's MaxPause, as the
// pauses it sets itself are.
func TestAnnouncedPauseIsBoundedByMaxPause(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	run(t, l)
	time.Sleep(300 * time.Millisecond) // subscribed
	till := time.Now().Add(48 * time.Hour).UnixMilli()
	if err := rdb.Publish(context.Background(), l.Keys().Events(), fmt.Sprintf("pause %d llm/m", till)).Err(); err != nil {
		t.Fatal(err)
	}
	var we *retry.WaitError
	testenv.WaitFor(t, 5*time.Second, "the announced pause", func() bool {
		p, err := l.Acquire(context.Background(), call("acme", "w", 10, 10))
		if err == nil {
			p.Done(limiter.Result{})
			return false
		}
		return errors.As(err, &we)
	})
	if we.Delay > limiter.DefaultMaxPause+2*time.Second {
		t.Fatalf("an announced pause puts calls off for %v (%s), beyond MaxPause %v", we.Delay, we.Reason, limiter.DefaultMaxPause)
	}
}

// A process that starts while PostgreSQL is down has no tenant's own budget; it retries
// the read soon (not a whole BudgetRefresh later), so a tenant's own budget holds
// seconds after PostgreSQL is back.
func TestOwnBudgetsHoldSoonAfterPostgresIsBack(t *testing.T) {
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "")
	ctx := context.Background()
	store := pgbudget.New(pool)
	if err := store.Set(ctx, "acme", 1000); err != nil {
		t.Fatal(err)
	}
	pg.Stop()
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Budgets: store, MaxWait: time.Millisecond})
	run(t, l) // its first read of the budgets fails
	time.Sleep(500 * time.Millisecond)
	if b := l.Budget("acme"); b != 0 {
		t.Fatalf("with PostgreSQL down from the start and no copy, acme's budget is %d, want the default (0)", b)
	}
	pg.Start()
	testenv.WaitFor(t, 10*time.Second, "acme's own budget", func() bool { return l.Budget("acme") == 1000 })
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
		t.Fatalf("%d calls of 600 tokens admitted for acme, whose own budget is 1000 a day; want 1", admitted)
	}
}

// A process that starts while PostgreSQL is down takes the copy of the budgets another
// process left in Redis: the tenants' own budgets hold through the outage.
func TestBudgetsCopyInRedisServesAProcessStartedInAnOutage(t *testing.T) {
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "")
	ctx := context.Background()
	store := pgbudget.New(pool)
	if err := store.Set(ctx, "acme", 1000); err != nil {
		t.Fatal(err)
	}
	rdb, prefix := testenv.Redis(t)
	first := newLimiter(t, rdb, prefix, limiter.Config{Budgets: store})
	run(t, first)
	testenv.WaitFor(t, 5*time.Second, "the first process's budgets", func() bool { return first.Budget("acme") == 1000 })
	pg.Stop()
	later := newLimiter(t, rdb, prefix, limiter.Config{Budgets: store})
	run(t, later)
	testenv.WaitFor(t, 5*time.Second, "the copy of the budgets", func() bool { return later.Budget("acme") == 1000 })
}

// Model names may hold ':' (OpenAI's fine-tunes are "ft:gpt-4o-mini:org:suffix:id"):
// the keys of model "m:inflight" are not the keys of model "m".
func TestModelNamesWithColonsDoNotShareKeys(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 600, Concurrency: 10}, MaxWait: time.Millisecond})
	ctx := context.Background()
	p, err := l.Acquire(ctx, limiter.Call{Model: "m", Tenant: "acme", InputTokens: 1, OutputTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Done(limiter.Result{})
	q, err := l.Acquire(ctx, limiter.Call{Model: "m:inflight", Tenant: "acme:x", InputTokens: 1, OutputTokens: 1})
	if err != nil {
		t.Fatalf("a call to model \"m:inflight\" while one to \"m\" is in flight: %v", err)
	}
	q.Done(limiter.Result{})
}

// The cost view keeps the calls of names holding its field separator '|' (any
// printable ASCII is a valid model name).
func TestCostViewKeepsNamesWithAPipe(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{SyncInterval: 50 * time.Millisecond})
	run(t, l)
	p, err := l.Acquire(context.Background(), limiter.Call{Model: "a|b:%3A", Tenant: "ac|me", InputTokens: 10, OutputTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	testenv.WaitFor(t, 5*time.Second, "the call in the cost view", func() bool {
		us, err := l.Usage(context.Background(), time.Now())
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range us {
			if u.Tenant == "ac|me" && u.Calls == 1 && u.ByModel["a|b:%3A"].Calls == 1 {
				return true
			}
		}
		return false
	})
}
