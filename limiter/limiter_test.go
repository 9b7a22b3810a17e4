package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// newLimiter returns a limiter on the shared test Redis under prefix (the tests' own),
// with cfg's other settings.
func newLimiter(t *testing.T, rdb redis.UniversalClient, prefix string, cfg limiter.Config) *limiter.Limiter {
	t.Helper()
	cfg.Prefix = prefix
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	l, err := limiter.New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// run runs l.Run until the test ends.
func run(t *testing.T, l *limiter.Limiter) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = l.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

func call(tenant, work string, in, out int) limiter.Call {
	return limiter.Call{Model: "m", Tenant: tenant, Work: work, InputTokens: in, OutputTokens: out}
}

// waitErr returns err as a *retry.WaitError, failing the test otherwise.
func waitErr(t *testing.T, err error) *retry.WaitError {
	t.Helper()
	var we *retry.WaitError
	if !errors.As(err, &we) {
		t.Fatalf("got %v, want a *retry.WaitError", err)
	}
	if !errors.Is(err, retry.ErrWaiting) || retry.Classify(err).Class != retry.ClassWaiting || retry.Classify(err).Retryable {
		t.Fatalf("a WaitError must match ErrWaiting and classify as waiting, not retryable: %+v", retry.Classify(err))
	}
	return we
}

func TestNothingConfiguredCostsNoRoundTrip(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	rt := &roundtrip.Counter{}
	rdb.AddHook(rt)
	l := newLimiter(t, rdb, prefix, limiter.Config{})
	for i := range 50 {
		p, err := l.Acquire(context.Background(), call("acme", fmt.Sprint("w", i), 100, 50))
		if err != nil {
			t.Fatal(err)
		}
		if pause := p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 90, OutputTokens: 10}}); pause != 0 {
			t.Fatalf("a plain answer paused the model for %v", pause)
		}
	}
	// The first call admits and settles through Redis (the process has not read the
	// fleet's pause yet, and it is the fleet's first contact: a probe), and so does the
	// second (which finds the probe answered); the others make none.
	if n := rt.Redis(); n != 4 {
		t.Fatalf("50 calls with no limit configured or learnt took %d Redis round trips, want 4 (the first two calls')", n)
	}
}

func TestRequestsPerMinuteHoldAcrossConcurrentCallers(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	const rpm = 60
	// Two limiters stand for two processes.
	ls := []*limiter.Limiter{
		newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: rpm}, MaxWait: time.Millisecond}),
		newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: rpm}, MaxWait: time.Millisecond}),
	}
	start := time.Now()
	var admitted, put atomic.Int64
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			p, err := ls[i%2].Acquire(context.Background(), call("acme", fmt.Sprint("w", i), 10, 10))
			if err != nil {
				waitErr(t, err)
				put.Add(1)
				return
			}
			admitted.Add(1)
			p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
		})
	}
	wg.Wait()
	// The bucket holds a minute's requests and refills one a second.
	most := int64(rpm) + int64(time.Since(start).Seconds()) + 1
	if a := admitted.Load(); a < rpm || a > most {
		t.Fatalf("200 concurrent calls against %d requests per minute: %d admitted, want %d to %d", rpm, a, rpm, most)
	}
	if admitted.Load()+put.Load() != 200 {
		t.Fatalf("admitted %d + put off %d != 200", admitted.Load(), put.Load())
	}
}

func TestTokensAreReservedThenCorrectedFromUsage(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{TPM: 10_000}, MaxWait: time.Millisecond})
	var permits []*limiter.Permit
	for i := range 10 { // each reserves 1000 of the 10,000
		p, err := l.Acquire(context.Background(), call("acme", fmt.Sprint("w", i), 200, 800))
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		permits = append(permits, p)
	}
	_, err := l.Acquire(context.Background(), call("acme", "w10", 200, 800))
	if we := waitErr(t, err); we.Delay < 4*time.Second {
		t.Fatalf("1000 tokens at 10,000 a minute come back in about 6s; the wait was %v", we.Delay)
	}
	// Each call used 100: 900 each come back, 9000 in all.
	for _, p := range permits {
		p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 60, OutputTokens: 40}})
	}
	for i := range 8 {
		p, err := l.Acquire(context.Background(), call("acme", fmt.Sprint("again", i), 200, 800))
		if err != nil {
			t.Fatalf("after the correction, call %d: %v", i, err)
		}
		p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 200, OutputTokens: 800}})
	}
}

func TestCallLargerThanTheTokenLimitIsPermanent(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{TPM: 1000}, TenantTokenBudget: 5000})
	_, err := l.Acquire(context.Background(), call("acme", "big", 900, 200))
	if !errors.Is(err, limiter.ErrTooLarge) || !retry.IsPermanent(err) {
		t.Fatalf("a call of 1100 tokens against 1000 a minute: %v, want a permanent ErrTooLarge", err)
	}
	l2 := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 500})
	if _, err := l2.Acquire(context.Background(), call("acme", "big", 400, 200)); !errors.Is(err, limiter.ErrTooLarge) {
		t.Fatalf("a call of 600 tokens against a budget of 500 a day: %v, want ErrTooLarge", err)
	}
}

func TestConcurrencyIsSharedAndALostPermitLapses(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	cfg := limiter.Config{Limits: limiter.Limits{Concurrency: 3}, MaxWait: time.Millisecond, Lease: 300 * time.Millisecond}
	a, b := newLimiter(t, rdb, prefix, cfg), newLimiter(t, rdb, prefix, cfg)
	ctx := context.Background()
	p1, err := a.Acquire(ctx, call("x", "1", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Acquire(ctx, call("x", "2", 1, 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Acquire(ctx, call("x", "3", 1, 1)); err != nil { // never settled: its process "died"
		t.Fatal(err)
	}
	_, err = b.Acquire(ctx, call("x", "4", 1, 1))
	if we := waitErr(t, err); we.Reason == "" {
		t.Fatal("a wait without a reason")
	}
	p1.Done(limiter.Result{Sent: true})
	p4, err := b.Acquire(ctx, call("x", "4", 1, 1)) // the place it was given is still its own
	if err != nil {
		t.Fatalf("after one call ended: %v", err)
	}
	p4.Done(limiter.Result{Sent: true})
	// Two permits are still out, one of them lost; its lease ends it.
	time.Sleep(400 * time.Millisecond)
	for i := range 2 {
		if _, err := a.Acquire(ctx, call("x", fmt.Sprint("after", i), 1, 1)); err != nil {
			t.Fatalf("after the lost permits' leases ended, call %d: %v", i, err)
		}
	}
}

func TestTenantConcurrencyCapsOneTenantOnly(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantConcurrency: 2, MaxWait: time.Millisecond})
	ctx := context.Background()
	for i := range 2 {
		if _, err := l.Acquire(ctx, call("greedy", fmt.Sprint(i), 1, 1)); err != nil {
			t.Fatal(err)
		}
	}
	_, err := l.Acquire(ctx, call("greedy", "3", 1, 1))
	if we := waitErr(t, err); we.Delay <= 0 {
		t.Fatalf("wait %v", we.Delay)
	}
	if _, err := l.Acquire(ctx, call("modest", "1", 1, 1)); err != nil {
		t.Fatalf("another tenant is not capped by the first's calls: %v", err)
	}
}

func TestA429PausesEveryProcessAtOnce(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	// Nothing configured: the processes make no round trip to admit, so the pause
	// must reach them through the announcement.
	a := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond, SyncInterval: time.Hour})
	b := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond, SyncInterval: time.Hour})
	run(t, b)
	time.Sleep(200 * time.Millisecond) // b subscribes
	p, err := a.Acquire(context.Background(), call("x", "1", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set("Retry-After", "3")
	rateLimited := llm.NewAPIError("openai", 429, h, []byte(`{"error":{"type":"requests","code":"rate_limit_exceeded","message":"slow down"}}`), time.Now(), nil)
	if pause := p.Done(limiter.Result{Sent: true, Err: rateLimited, RateLimit: rateLimited.RateLimit}); pause != 3*time.Second {
		t.Fatalf("a 429 with Retry-After 3 paused for %v", pause)
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		_, err := b.Acquire(context.Background(), call("y", "2", 1, 1))
		if err != nil {
			we := waitErr(t, err)
			if we.Delay < time.Second || we.Delay > 4*time.Second {
				t.Fatalf("the other process waits %v, want about the 3s left of the pause", we.Delay)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the other process still calls the model 2s after the 429")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A process that starts later meets the pause on its first call (it admits
	// through Redis until it has read the model's state once).
	c := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond, SyncInterval: time.Hour})
	_, err = c.Acquire(context.Background(), call("z", "w", 1, 1))
	waitErr(t, err)
}

func TestLimitsAreLearntFromTheProvidersHeaders(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	a := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	b := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond, SyncInterval: 50 * time.Millisecond})
	p, err := a.Acquire(context.Background(), call("x", "1", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set("X-Ratelimit-Limit-Requests", "600")
	h.Set("X-Ratelimit-Remaining-Requests", "3")
	h.Set("X-Ratelimit-Reset-Requests", "59.7s")
	rl := llm.RateLimitOf(h, time.Now())
	if p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 1}, RateLimit: rl}) != 0 {
		t.Fatal("3 requests left is no reason to pause")
	}
	// b learns the limit in its sync and then admits through Redis: 3 are left (the
	// answer said so), plus what refills meanwhile (10 a second).
	if _, err := b.Acquire(context.Background(), call("x", "warm", 1, 1)); err != nil {
		t.Fatal(err)
	}
	run(t, b)
	time.Sleep(200 * time.Millisecond)
	admitted := 0
	for i := range 20 {
		if _, err := b.Acquire(context.Background(), call("x", fmt.Sprint("w", i), 1, 1)); err == nil {
			admitted++
		}
	}
	if admitted < 3 || admitted > 10 {
		t.Fatalf("after a learnt limit of 600/min with 3 left, 20 quick calls: %d admitted, want 3 and the refill of well under a second", admitted)
	}
	// An answer that says nothing is left pauses the model: until its first request is
	// back (reset/limit, the window refilling evenly), or until the reset when the
	// window's size is not said.
	acquire := func(work string) *limiter.Permit {
		for {
			p, err := a.Acquire(context.Background(), call("y", work, 1, 1))
			if err == nil {
				return p
			}
			time.Sleep(waitErr(t, err).Delay)
		}
	}
	h.Set("X-Ratelimit-Remaining-Requests", "0")
	h.Set("X-Ratelimit-Reset-Requests", "60s")
	p = acquire("1")
	if pause := p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 1}, RateLimit: llm.RateLimitOf(h, time.Now())}); pause != 100*time.Millisecond {
		t.Fatalf("no request left of 600 a minute, whole again in 60s: paused for %v, want 100ms", pause)
	}
	h.Del("X-Ratelimit-Limit-Requests")
	h.Set("X-Ratelimit-Reset-Requests", "2s")
	p = acquire("2")
	if pause := p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 1}, RateLimit: llm.RateLimitOf(h, time.Now())}); pause != 2*time.Second {
		t.Fatalf("no request left of a window of unknown size, whole again in 2s: paused for %v, want 2s", pause)
	}
}

func TestBudgetRaceNeverOverspends(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	const budget = 10_000
	ls := []*limiter.Limiter{
		newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: budget, MaxWait: time.Millisecond}),
		newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: budget, MaxWait: time.Millisecond}),
	}
	var admitted, budgetWaits atomic.Int64
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			p, err := ls[i%2].Acquire(context.Background(), call("acme", fmt.Sprint("w", i), 60, 40))
			if err != nil {
				we := waitErr(t, err)
				if we.Delay < time.Millisecond || we.Delay > 25*time.Hour {
					t.Errorf("a budget wait of %v is not until the next UTC day", we.Delay)
				}
				budgetWaits.Add(1)
				return
			}
			admitted.Add(1)
			time.Sleep(time.Millisecond) // the calls overlap
			p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 60, OutputTokens: 40}})
		})
	}
	wg.Wait()
	if admitted.Load() != budget/100 || budgetWaits.Load() != 200-budget/100 {
		t.Fatalf("200 concurrent calls of 100 tokens against %d a day: %d admitted, %d put off; want exactly %d admitted",
			budget, admitted.Load(), budgetWaits.Load(), budget/100)
	}
	u := usageOf(t, ls[0], "acme")
	if u.BudgetUsed != budget || u.BudgetReserved != 0 {
		t.Fatalf("budget counters used %d reserved %d, want %d and 0", u.BudgetUsed, u.BudgetReserved, budget)
	}
}

// TestBudgetOverspendIsBoundedByTheEstimatesError is the documented bound: the calls
// in flight at once can overspend by what their usage exceeds their reservation.
func TestBudgetOverspendIsBoundedByTheEstimatesError(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	const budget = 10_000
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: budget, MaxWait: time.Millisecond})
	start := make(chan struct{})
	var wg sync.WaitGroup
	var admitted atomic.Int64
	for i := range 200 {
		wg.Go(func() {
			<-start
			p, err := l.Acquire(context.Background(), call("acme", fmt.Sprint("w", i), 60, 40))
			if err != nil {
				return
			}
			admitted.Add(1)
			// The estimate was low: the call used 130 tokens of its 100 reserved.
			p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 90, OutputTokens: 40}})
		})
	}
	close(start)
	wg.Wait()
	u := usageOf(t, l, "acme")
	over := u.BudgetUsed - budget
	bound := admitted.Load() * 30 // each admitted call's usage beyond its reservation
	if over > bound {
		t.Fatalf("used %d of %d: overspent %d, beyond the bound %d", u.BudgetUsed, budget, over, bound)
	}
	if u.BudgetUsed < budget {
		t.Fatalf("used %d: the calls with more usage than estimated should have been charged it", u.BudgetUsed)
	}
}

func TestBudgetReleasedOnFailureAndChargedWhenAmbiguous(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 1000})
	ctx := context.Background()
	p, err := l.Acquire(ctx, call("acme", "1", 100, 100))
	if err != nil {
		t.Fatal(err)
	}
	if u := usageOf(t, l, "acme"); u.BudgetReserved != 200 {
		t.Fatalf("reserved %d while in flight, want 200", u.BudgetReserved)
	}
	p.Done(limiter.Result{Sent: false, Err: errors.New("dial tcp: connection refused")})
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 0 || u.BudgetReserved != 0 {
		t.Fatalf("a call never sent: used %d reserved %d, want 0 and 0", u.BudgetUsed, u.BudgetReserved)
	}
	p, err = l.Acquire(ctx, call("acme", "2", 100, 100))
	if err != nil {
		t.Fatal(err)
	}
	p.Done(limiter.Result{Sent: true, Err: llm.NewAPIError("openai", 400, nil, nil, time.Now(), nil)})
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 0 {
		t.Fatalf("a call the provider refused: used %d, want 0", u.BudgetUsed)
	}
	p, err = l.Acquire(ctx, call("acme", "3", 100, 100))
	if err != nil {
		t.Fatal(err)
	}
	p.Done(limiter.Result{Sent: true, Ambiguous: true, Err: context.DeadlineExceeded})
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 200 {
		t.Fatalf("a call whose answer was lost (billed though unseen): used %d, want its reservation, 200", u.BudgetUsed)
	}
}

func TestLostPermitsBudgetIsChargedWhenItsLeaseEnds(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 1000, Lease: 200 * time.Millisecond})
	ctx := context.Background()
	if _, err := l.Acquire(ctx, call("acme", "lost", 100, 100)); err != nil { // its process dies
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	p, err := l.Acquire(ctx, call("acme", "next", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	if u := usageOf(t, l, "acme"); u.BudgetUsed != 220 || u.BudgetReserved != 0 {
		t.Fatalf("used %d reserved %d, want the lost call's whole reservation charged (200) and the next's 20", u.BudgetUsed, u.BudgetReserved)
	}
}

// usageOf returns tenant's usage today, the budget counters included.
func usageOf(t *testing.T, l *limiter.Limiter, tenant string) limiter.TenantUsage {
	t.Helper()
	us, err := l.Usage(context.Background(), time.Now(), tenant)
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range us {
		if u.Tenant == tenant {
			return u
		}
	}
	t.Fatalf("no usage of %s", tenant)
	return limiter.TenantUsage{}
}

// TestFairShare: a tenant with a backlog does not hold back one that comes later
// beyond its share. Each simulated job waits out its WaitError and asks again with the
// same work key, as a snoozed job does.
func TestFairShare(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	const rpm = 600 // 10 a second
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: rpm}, MaxWait: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	drain(t, rdb, l, "m") // the rate holds from the start
	type admission struct {
		tenant string
		at     time.Time
	}
	var mu sync.Mutex
	var log []admission
	job := func(tenant, work string) {
		for ctx.Err() == nil {
			p, err := l.Acquire(ctx, call(tenant, work, 1, 1))
			if err == nil {
				mu.Lock()
				log = append(log, admission{tenant, time.Now()})
				mu.Unlock()
				p.Done(limiter.Result{Sent: true})
				return
			}
			var we *retry.WaitError
			if !errors.As(err, &we) {
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(we.Delay):
			}
		}
	}
	var wg sync.WaitGroup
	for i := range 300 {
		wg.Go(func() { job("a", fmt.Sprint("a", i)) })
	}
	time.Sleep(2 * time.Second)
	bStart := time.Now()
	var bwg sync.WaitGroup
	for i := range 10 {
		bwg.Go(func() { job("b", fmt.Sprint("b", i)) })
	}
	bwg.Wait()
	bTook := time.Since(bStart)
	cancel()
	wg.Wait()
	// b's fair share is half of 10 a second: 10 calls in 2s. Twice that is the bound
	// the issue sets; a FIFO limiter would take 30s (the backlog before them).
	if bTook > 4*time.Second {
		t.Fatalf("10 calls of a tenant arriving behind 300 of another took %v, more than twice their fair share (2s)", bTook)
	}
	mu.Lock()
	defer mu.Unlock()
	before, during := 0, 0
	for _, ad := range log {
		switch {
		case ad.tenant != "a":
		case ad.at.Before(bStart):
			before++
		case ad.at.Before(bStart.Add(bTook)):
			during++
		}
	}
	t.Logf("a had %d calls in the 2s before b came; b's 10 calls took %v, and a had %d calls meanwhile", before, bTook, during)
	// Capacity is not left idle: alone, a had the whole 10 a second (less the first
	// places' spread).
	if before < 12 {
		t.Fatalf("alone, the backlogged tenant had %d calls in 2s at 10 a second: capacity was left idle", before)
	}
}

func TestRedisRestartMidWindowKeepsLimitsAndBudgets(t *testing.T) {
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	prefix := "restart" + strconv.FormatInt(time.Now().UnixNano(), 36)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 60}, TenantTokenBudget: 1000,
		MaxWait: time.Millisecond, SyncInterval: 100 * time.Millisecond})
	run(t, l)
	ctx := context.Background()
	for i := range 30 {
		p, err := l.Acquire(ctx, call("acme", fmt.Sprint("before", i), 10, 10))
		if err != nil {
			t.Fatal(err)
		}
		p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}})
	}
	inFlight, err := l.Acquire(ctx, call("acme", "inflight", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	// The call in flight ends while Redis is down: its settlement waits for Redis.
	inFlight.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 15, OutputTokens: 15}})
	if _, err := l.Acquire(ctx, call("acme", "down", 1, 1)); !errors.Is(err, retry.ErrUnavailable) {
		t.Fatalf("with Redis down Acquire says %v, want an error matching ErrUnavailable", err)
	}
	srv.Start()
	// The settlement lands; the window's requests are still spent.
	deadline := time.Now().Add(10 * time.Second)
	for {
		u := usageOf(t, l, "acme")
		if u.BudgetUsed == 30*20+30 && u.BudgetReserved == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the restart the budget says used %d reserved %d, want %d and 0", u.BudgetUsed, u.BudgetReserved, 30*20+30)
		}
		time.Sleep(100 * time.Millisecond)
	}
	admitted := 0
	for i := range 60 {
		if p, err := l.Acquire(ctx, call("acme", fmt.Sprint("after", i), 1, 1)); err == nil {
			admitted++
			p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 1, OutputTokens: 1}})
		}
	}
	if admitted > 29+15 { // 29 left, plus the refill of the restart's seconds
		t.Fatalf("after a restart %d of 60 calls were admitted: the window's 31 earlier requests were forgotten", admitted)
	}
}

// drain empties model's request bucket of l (as a minute of calls would), so that a test
// starts at the limit's steady pace.
func drain(t *testing.T, rdb *redis.Client, l *limiter.Limiter, model string) {
	t.Helper()
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(context.Background(), l.Keys().Model("llm/"+model), "rt", 0, "rts", now.UnixMilli()).Err(); err != nil {
		t.Fatal(err)
	}
}

// TestBacklogsInterleaveAndComeBackOnce: the backlogs of three tenants put off together
// are placed round robin at the capacity's pace, so a job comes back about when there
// is room for it: it waits in its worker when its place is near (MaxWait), and is put
// off (its job snoozed) about once when it is far, not once per turn of three
// oversubscribed lines. And the capacity is used: the backlog drains at the limit.
func TestBacklogsInterleaveAndComeBackOnce(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	const rpm = 6000 // 100 a second
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: rpm}, MaxWait: 200 * time.Millisecond})
	ctx := context.Background()
	drain(t, rdb, l, "m")
	var snoozes atomic.Int64
	var rmu sync.Mutex
	reasons := map[string]int{}
	var wg sync.WaitGroup
	const perTenant = 60
	start := time.Now()
	for i := range perTenant {
		for _, tenant := range []string{"a", "b", "c"} {
			wg.Go(func() {
				for {
					p, err := l.Acquire(ctx, call(tenant, fmt.Sprint(tenant, i), 1, 1))
					if err == nil {
						p.Done(limiter.Result{Sent: true})
						return
					}
					snoozes.Add(1)
					we := waitErr(t, err)
					rmu.Lock()
					reasons[we.Reason]++
					rmu.Unlock()
					time.Sleep(we.Delay)
				}
			})
		}
		time.Sleep(100 * time.Microsecond) // the tenants' jobs arrive interleaved
	}
	wg.Wait()
	took := time.Since(start)
	per := float64(snoozes.Load()) / (3 * perTenant)
	t.Logf("%d jobs in %v (ideal 1.8s), %.2f snoozes each: %v", 3*perTenant, took, per, reasons)
	if per > 2 {
		t.Fatalf("each job was put off %.2f times on average: the lines do not bring jobs back when there is room", per)
	}
	if took > 6*time.Second {
		t.Fatalf("180 jobs at 100 a second took %v: capacity was left idle", took)
	}
}

// TestFirstBacklogIsNotSpacedByTheOutputReservation: lines placed before any answer
// settled space calls by the prompt's estimate, not by the whole output reservation,
// which most answers stop far short of: under a token limit that is not binding, the
// backlog comes back at the request limit's pace.
func TestFirstBacklogIsNotSpacedByTheOutputReservation(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	// 100 requests a second; 200 prompt tokens and 1024 of output reserved a call: by
	// the reservation, 25,000 tokens a second would allow 20 calls a second, by the
	// prompt 125.
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 6000, TPM: 1_500_000}, MaxWait: time.Millisecond})
	ctx := context.Background()
	drain(t, rdb, l, "m")
	var last time.Duration
	for i := range 50 {
		if _, err := l.Acquire(ctx, call("a", fmt.Sprint("job", i), 200, 1024)); err != nil {
			last = waitErr(t, err).Delay // (a call may find a request refilled meanwhile)
		}
	}
	// 50 calls at 100 a second: the last place is about 0.5s away, not 2.5s.
	if last > time.Second {
		t.Fatalf("the 50th call of a first backlog waits %v: spaced by the output reservation, not the rate", last)
	}
}

// A provider's absurd Retry-After does not stop the fleet for a month: pauses are
// bounded by MaxPause.
func TestPausesAreBounded(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond, MaxPause: 3 * time.Second})
	p, err := l.Acquire(context.Background(), call("x", "1", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set("Retry-After", "2592000")
	e := llm.NewAPIError("openai", 429, h, nil, time.Now(), nil)
	if pause := p.Done(limiter.Result{Sent: true, Err: e}); pause != 3*time.Second {
		t.Fatalf("a Retry-After of 30 days paused for %v, want MaxPause (3s)", pause)
	}
	_, err = l.Acquire(context.Background(), call("x", "2", 1, 1))
	if we := waitErr(t, err); we.Delay > 4*time.Second {
		t.Fatalf("the next call waits %v, want at most the bounded pause", we.Delay)
	}
}

// A background call (a shadow run) takes only capacity nobody else needs: it leaves
// BackgroundHeadroom of each shared limit free, and waits while another tenant waits
// for capacity; a call of its own class takes what is left.
func TestBackgroundCallsLeaveHeadroomAndYield(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{Concurrency: 8}, MaxWait: time.Millisecond, Lease: time.Minute})
	ctx := context.Background()
	bg := func(work string) limiter.Call {
		c := call("onceflow.shadow", work, 1, 1)
		c.Background = true
		return c
	}
	// With 8 calls in flight allowed, background calls stop at 6: a quarter stays free.
	var held []*limiter.Permit
	for i := range 6 {
		p, err := l.Acquire(ctx, bg(fmt.Sprint("bg", i)))
		if err != nil {
			t.Fatalf("background call %d of the 6 that leave a quarter free: %v", i, err)
		}
		held = append(held, p)
	}
	_, err := l.Acquire(ctx, bg("bg6"))
	if we := waitErr(t, err); !strings.HasSuffix(we.Reason, ": headroom") {
		t.Fatalf("the 7th background call: %q, want headroom", we.Reason)
	}
	// Production takes the headroom.
	for i := range 2 {
		p, err := l.Acquire(ctx, call("acme", fmt.Sprint("prod", i), 1, 1))
		if err != nil {
			t.Fatalf("production call %d in the headroom: %v", i, err)
		}
		held = append(held, p)
	}
	// Full: a production call waits (and is marked waiting); once capacity frees, the
	// background call still yields to it.
	if _, err := l.Acquire(ctx, call("acme", "prod-waiting", 1, 1)); !strings.HasSuffix(waitErr(t, err).Reason, ": concurrency") {
		t.Fatalf("production at the limit: %v, want a wait for concurrency", err)
	}
	for _, p := range held[:4] {
		p.Done(limiter.Result{Sent: true})
	}
	if _, err := l.Acquire(ctx, bg("bg7")); !strings.HasSuffix(waitErr(t, err).Reason, ": others first") && !strings.HasSuffix(waitErr(t, err).Reason, ": fair share") {
		t.Fatalf("a background call while production waits: %v, want it to yield", err)
	}
	if p, err := l.Acquire(ctx, call("acme", "prod-waiting", 1, 1)); err != nil {
		t.Fatalf("the waiting production call: %v", err)
	} else {
		p.Done(limiter.Result{Sent: true})
	}
}

// With a rate limit, a background call leaves a quarter of the minute's requests for
// the calls of its own class.
func TestBackgroundCallsLeaveAQuarterOfTheRequestsPerMinute(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 8}, MaxWait: time.Millisecond})
	ctx := context.Background()
	admitted := 0
	for i := range 8 {
		c := call("onceflow.shadow", fmt.Sprint("bg", i), 1, 1)
		c.Background = true
		p, err := l.Acquire(ctx, c)
		if err != nil {
			if we := waitErr(t, err); !strings.HasSuffix(we.Reason, ": headroom") {
				t.Fatalf("background call %d: %q, want headroom", i, we.Reason)
			}
			break
		}
		p.Done(limiter.Result{Sent: true})
		admitted++
	}
	if admitted != 6 {
		t.Fatalf("%d background calls of 8 requests a minute, want 6 (a quarter left)", admitted)
	}
	for i := range 2 {
		p, err := l.Acquire(ctx, call("acme", fmt.Sprint("prod", i), 1, 1))
		if err != nil {
			t.Fatalf("production call %d in the quarter left: %v", i, err)
		}
		p.Done(limiter.Result{Sent: true})
	}
}

// A background call of a tenant that has had nothing lately (no fair share holds it
// back) still yields while another tenant waits for capacity.
func TestBackgroundCallsYieldToAWaitingTenantWhateverTheirShare(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{Concurrency: 2}, MaxWait: time.Millisecond, Lease: time.Minute})
	ctx := context.Background()
	p1, err := l.Acquire(ctx, call("acme", "a1", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Acquire(ctx, call("acme", "a2", 1, 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Acquire(ctx, call("acme", "a3", 1, 1)); err == nil {
		t.Fatal("a third call at a concurrency of 2 went")
	}
	p1.Done(limiter.Result{Sent: true})
	c := call("shadow", "s1", 1, 1)
	c.Background = true
	if _, err := l.Acquire(ctx, c); !strings.HasSuffix(waitErr(t, err).Reason, ": others first") {
		t.Fatalf("a background call while acme waits: %v, want others first", err)
	}
}

// A call made through the provider's batch API is in the cost view under its model's
// batch name, at the batch price (half, or the table's batch prices), and takes nothing
// from the synchronous limits: a model whose RPM is spent still admits after it.
func TestBatchCallsAreInTheCostViewAtTheBatchPrice(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{SyncInterval: 50 * time.Millisecond,
		Models: map[string]limiter.Limits{"gpt-4.1-mini": {RPM: 1}},
		Prices: map[string]limiter.Price{"mine": {Input: 2, Output: 10, BatchOutput: 1}}})
	run(t, l)
	for range 3 {
		l.AccountBatch("acme", "gpt-4.1-mini", llm.Usage{InputTokens: 1_000_000, OutputTokens: 1_000_000})
	}
	l.AccountBatch("acme", "mine", llm.Usage{InputTokens: 1_000_000, OutputTokens: 1_000_000})
	var got limiter.TenantUsage
	testenv.WaitFor(t, 5*time.Second, "the batch calls in the cost view", func() bool {
		us, err := l.Usage(context.Background(), time.Now())
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range us {
			if u.Tenant == "acme" && u.Calls == 4 {
				got = u
				return true
			}
		}
		return false
	})
	mini := got.ByModel[limiter.BatchModel("gpt-4.1-mini")]
	sync := limiter.DefaultPrices["gpt-4.1-mini"]
	if want := 3 * (sync.Input + sync.Output) / 2; mini.Calls != 3 || !near(mini.CostUSD, want) {
		t.Errorf("gpt-4.1-mini in batches: %+v, want 3 calls costing %.4f (half the synchronous price)", mini, want)
	}
	if mine := got.ByModel[limiter.BatchModel("mine")]; !near(mine.CostUSD, 1+1) { // input: half of 2; output: the table's 1
		t.Errorf("mine in a batch: %+v, want 2.00 USD", mine)
	}
	if _, ok := got.ByModel["gpt-4.1-mini"]; ok {
		t.Errorf("batch calls counted as synchronous calls: %+v", got.ByModel)
	}
	p, err := l.Acquire(context.Background(), limiter.Call{Model: "gpt-4.1-mini", Tenant: "acme", InputTokens: 10, OutputTokens: 10})
	if err != nil {
		t.Fatalf("the model's one request per minute after three batch calls: %v", err)
	}
	p.Done(limiter.Result{})
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }
