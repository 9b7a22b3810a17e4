package limiter_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
)

// stuckBudgets is a BudgetSource whose read blocks until released, ignoring its
// context (a driver without context support, a source behind a mutex, a cgo call).
type stuckBudgets struct{ release chan struct{} }

func (s stuckBudgets) TokenBudgets(context.Context) (map[string]int64, error) {
	<-s.release
	return map[string]int64{"acme": 1000}, nil
}

// TestRunReturnsThoughABudgetReadIgnoresItsContext: a regression test (attack round 3 of issue 15).
//
// Scenario: Config.Budgets is a BudgetSource (a public interface) whose read does not
// honour its context. Run now waits for its budget goroutine on exit (wg.Wait), and
// that goroutine sits in TokenBudgets; the 5s budgetReadWithin only cancels a context
// nobody looks at.
//
// What the user sees: on shutdown (SIGTERM), Run never returns, so the process hangs
// until it is killed (its final cost-view flush and pending settlements are done, but
// the caller waiting for Run never proceeds). Before the round-2 change the read sat
// in Run's own loop and this was a stall of the loop; now it is a hang of the exit.
//
// What should happen: Run returns soon after ctx ends (it documents "It returns nil
// when ctx ends"): wait for the budget goroutine at most a bounded time (e.g.
// budgetReadWithin), or run each read in a goroutine whose result is dropped after
// the timeout, so the loop itself never blocks past it.
func TestRunReturnsThoughABudgetReadIgnoresItsContext(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	src := stuckBudgets{release: make(chan struct{})}
	t.Cleanup(func() { close(src.release) })
	l := newLimiter(t, rdb, prefix, limiter.Config{Budgets: src, SyncInterval: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = l.Run(ctx) }()
	time.Sleep(200 * time.Millisecond)
	cancel()
	select {
	case <-done:
	case <-time.After(8 * time.Second): // budgetReadWithin (5s) plus slack
		t.Fatal("Run did not return 8s after its context ended: it waits for a budget read that ignores its context (run.go Run: wg.Wait)")
	}
}

// TestOthersFollowTheProbesAnswerNotItsWindow: a regression test (attack round 3 of issue 15).
//
// Scenario: a 429 without Retry-After pauses model m for RateLimitPause (here 3s, a
// user who set it so). Once the pause is over, process A sends the probe; process B's
// call meanwhile is told 'paused: waiting for the first answer after a pause' and
// Acquire turns that into a LOCAL pause of the model until the probe window ends
// (limiter.go Acquire: st.setPause(now+delay) for every "paused" reason). The probe
// is answered 100ms later and settleScript ends the recovery in Redis.
//
// What the user sees: every call of process B for the rest of the probe window (up to
// RateLimitPause, 1s by default, 3s here) is put off locally, without asking Redis,
// although the model is healthy and recovered: the docs promise "the others wait for
// its answer ... The probe's answer ... ends the recovery and the others go".
//
// What should happen: the probe gate's denial must not become a local pause (it is a
// Redis-side wait: keep recovering=true and ask Redis again), so B's next call after
// the probe's answer is admitted.
func TestOthersFollowTheProbesAnswerNotItsWindow(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	cfg := limiter.Config{MaxWait: time.Millisecond, RateLimitPause: 3 * time.Second, SyncInterval: time.Hour}
	a := newLimiter(t, rdb, prefix, cfg)
	b := newLimiter(t, rdb, prefix, cfg)
	ctx := context.Background()
	p, err := a.Acquire(ctx, call("acme", "w0", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	tooMany := llm.NewAPIError("openai", http.StatusTooManyRequests, http.Header{}, []byte(`{"error":{"type":"requests","code":"rate_limit_exceeded","message":"slow down"}}`), time.Now(), nil)
	if pause := p.Done(limiter.Result{Sent: true, Err: tooMany}); pause != 3*time.Second {
		t.Fatalf("a 429 without Retry-After paused for %v, want RateLimitPause (3s)", pause)
	}
	time.Sleep(3100 * time.Millisecond)
	probe, err := a.Acquire(ctx, call("acme", "w1", 10, 10))
	if err != nil {
		t.Fatalf("the probe after the pause: %v", err)
	}
	if _, err := b.Acquire(ctx, call("acme", "w2", 10, 10)); err == nil {
		t.Fatal("a second call went while the probe was out")
	}
	time.Sleep(100 * time.Millisecond)
	probe.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	// The recovery is over in Redis: a call now goes.
	q, err := b.Acquire(ctx, call("acme", "w3", 10, 10))
	if err != nil {
		t.Fatalf("the probe was answered and the recovery ended, yet process B's next call is put off: %v", err)
	}
	q.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
}

// The calls waiting in their workers for a probe's answer go when it is announced
// ("resume" on the events channel), not at the end of the probe's window.
func TestWaitingCallsWakeOnTheProbesAnswer(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	// A window of 3s, the answer after 0.2s: a margin of seconds either side, for a
	// loaded machine.
	cfg := limiter.Config{MaxWait: 4 * time.Second, RateLimitPause: 3 * time.Second, SyncInterval: time.Hour}
	a := newLimiter(t, rdb, prefix, cfg)
	b := newLimiter(t, rdb, prefix, cfg)
	run(t, b)
	time.Sleep(200 * time.Millisecond) // b subscribes
	ctx := context.Background()
	p, err := a.Acquire(ctx, call("acme", "w0", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	tooMany := llm.NewAPIError("openai", http.StatusTooManyRequests, http.Header{}, []byte(`{"error":{"type":"requests","code":"rate_limit_exceeded","message":"slow down"}}`), time.Now(), nil)
	p.Done(limiter.Result{Sent: true, Err: tooMany}) // a 3s pause
	time.Sleep(3100 * time.Millisecond)
	probe, err := a.Acquire(ctx, call("acme", "probe", 10, 10))
	if err != nil {
		t.Fatalf("the probe after the pause: %v", err)
	}
	type got struct {
		took time.Duration
		err  error
	}
	ch := make(chan got, 1)
	go func() {
		start := time.Now()
		q, err := b.Acquire(ctx, call("acme", "waiter", 10, 10))
		if err == nil {
			q.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
		}
		ch <- got{time.Since(start), err}
	}()
	time.Sleep(200 * time.Millisecond)
	probe.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	g := <-ch
	if g.err != nil {
		t.Fatalf("the waiting call: %v", g.err)
	}
	// The probe's window is 3s; the answer came after 0.2s.
	if g.took > 2*time.Second {
		t.Fatalf("the waiting call went %v after it asked, want soon after the probe's answer (0.2s), not at the window's end (3s)", g.took)
	}
}

// A wait longer than half of what remains of the caller's deadline (a per-call
// timeout) is put off, not waited in-process: a wait that ran into the call's timeout
// would count as a failure of the provider (and a run of them opens its breaker).
func TestWaitNeverRunsIntoTheCallsTimeout(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: 2 * time.Second})
	p, err := l.Acquire(context.Background(), call("acme", "w0", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set("Retry-After", "1")
	tooMany := llm.NewAPIError("openai", http.StatusTooManyRequests, h, []byte(`{"error":{"type":"requests","code":"rate_limit_exceeded","message":"slow down"}}`), time.Now(), nil)
	p.Done(limiter.Result{Sent: true, Err: tooMany})                      // a 1s pause, within MaxWait
	ctx, cancel := context.WithTimeout(context.Background(), time.Second) // the per-call timeout
	defer cancel()
	start := time.Now()
	_, err = l.Acquire(ctx, call("acme", "w1", 10, 10))
	waitErr(t, err)
	if took := time.Since(start); took > 700*time.Millisecond { // waiting would take the whole 1s
		t.Fatalf("Acquire waited %v in-process for a pause as long as the call's whole timeout", took)
	}
	// With time to spare, the same pause is waited in-process.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	q, err := l.Acquire(ctx2, call("acme", "w2", 10, 10))
	if err != nil {
		t.Fatalf("with 10s left, a pause of under 1s: %v", err)
	}
	q.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
}

// At the fleet's first contact with a model (nothing configured, nothing learnt, no
// answer in the last 10 minutes) the first call goes alone: its answer's headers teach
// the limits before the others go, rather than every worker slot of the fleet meeting
// the provider's limit at once.
func TestFirstContactIsAProbe(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	a := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	b := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	ctx := context.Background()
	probe, err := a.Acquire(ctx, call("acme", "first", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Acquire(ctx, call("acme", "second", 10, 10))
	if we := waitErr(t, err); !strings.Contains(we.Reason, "probe") {
		t.Fatalf("a second call at first contact: %v, want it to wait for the probe", we)
	}
	probe.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	for i := range 20 { // the probe answered: everyone goes
		p, err := b.Acquire(ctx, call("acme", fmt.Sprint("after", i), 10, 10))
		if err != nil {
			t.Fatalf("call %d after the probe's answer: %v", i, err)
		}
		defer p.Done(limiter.Result{})
	}
}
