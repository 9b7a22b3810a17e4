package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// TestLearntTokenLimitNeverFailsACall: a regression test (attack round 2 of issue 15).
//
// Scenario: nothing configured, Anthropic. One answer carries Anthropic's separate
// input-token window (anthropic-ratelimit-input-tokens-limit: 30000, tier 1 ITPM).
// Done learns it as the model's *tokens per minute* (ltpm = cmp.Or(Tokens.Limit,
// InputTokens.Limit)), and Acquire then compares it with the call's estimate of
// prompt PLUS output (MaxTokens). A request with a 1,000-token prompt and
// max_tokens 32,000 (a normal Claude request; ITPM counts input only) now fails with a
// permanent ErrTooLarge: the job is dead-lettered although the provider would take it.
// The same happens fleet-wide for 10 minutes after one wrong header (a proxy's, an
// error page's) saying x-ratelimit-limit-tokens: 500: every call needing more fails
// permanently, and since none is sent, none relearns the real limit.
//
// What should happen: a learnt limit (a hint that lapses, "one wrong header does not
// throttle the fleet for good") must never make a call fail permanently; at most it
// waits (admitScript already clamps the need to tpm). An input-token window must be
// compared with the input estimate only.
func TestLearntTokenLimitNeverFailsACall(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	p, err := l.Acquire(context.Background(), call("acme", "w0", 100, 100))
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set("Anthropic-Ratelimit-Requests-Limit", "50")
	h.Set("Anthropic-Ratelimit-Requests-Remaining", "49")
	h.Set("Anthropic-Ratelimit-Input-Tokens-Limit", "30000")
	h.Set("Anthropic-Ratelimit-Input-Tokens-Remaining", "29000")
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 100, OutputTokens: 100}, RateLimit: llm.RateLimitOf(h, time.Now())})

	_, err = l.Acquire(context.Background(), call("acme", "w1", 1000, 32000))
	if errors.Is(err, limiter.ErrTooLarge) || (err != nil && !retry.Classify(err).Retryable && retry.Classify(err).Class != retry.ClassWaiting) {
		t.Errorf("a 1,000-token prompt with max_tokens 32,000 under a learnt input-token limit of 30,000 failed permanently: %v", err)
	}

	// One wrong header: x-ratelimit-limit-tokens: 500.
	l2 := newLimiter(t, rdb, prefix+"b", limiter.Config{MaxWait: time.Millisecond})
	p, err = l2.Acquire(context.Background(), call("acme", "v0", 10, 10))
	if err != nil {
		t.Fatal(err)
	}
	h = http.Header{}
	h.Set("X-Ratelimit-Limit-Tokens", "500")
	p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 10, OutputTokens: 10}, RateLimit: llm.RateLimitOf(h, time.Now())})
	_, err = l2.Acquire(context.Background(), call("acme", "v1", 200, 1024))
	if errors.Is(err, limiter.ErrTooLarge) {
		t.Fatalf("one answer's x-ratelimit-limit-tokens: 500 makes every ordinary call (200 + 1024 tokens) fail permanently for 10 minutes: %v", err)
	}
}

// TestEmptyWindowPauseSendsNoProbe: a regression test (attack round 2 of issue 15).
//
// Scenario: the provider's answers teach 600 requests a minute; one answer says
// x-ratelimit-remaining-requests: 0 (the fleet used the last request of the window, a
// normal event at the limit). Per docs/limits.md this pauses the model "until its first
// unit is back (its reset divided by its size)": 100 ms. But every pause also marks
// the model recovering, so once those 100 ms are over only ONE call (a probe) may go,
// and all others wait until that probe's answer (a model call: seconds) or one more a
// second. One second later the bucket holds 10 requests (600/min), yet 10 concurrent
// calls get 1 admission; the rest are put off with "waiting for the first answer after
// a pause". At steady load at the learnt limit this happens every time the window
// empties: throughput collapses to about one call per model latency.
//
// What should happen: an exhausted window is not a 429 herd; its pause should not
// start a recovery (or the probe gate should apply only to 429/quota pauses), so the
// refilled bucket is usable: about 10 admitted after 1 s.
func TestEmptyWindowPauseSendsNoProbe(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	h := http.Header{}
	h.Set("X-Ratelimit-Limit-Requests", "600")
	h.Set("X-Ratelimit-Remaining-Requests", "0")
	h.Set("X-Ratelimit-Reset-Requests", "60s")
	p, err := l.Acquire(context.Background(), call("acme", "w0", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	if pause := p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 1, OutputTokens: 1}, RateLimit: llm.RateLimitOf(h, time.Now())}); pause != 100*time.Millisecond {
		t.Fatalf("pause %v, want 100ms", pause)
	}
	time.Sleep(1100 * time.Millisecond) // the bucket refills ~11 requests
	admitted, reasons := 0, map[string]int{}
	for i := range 10 {
		_, err := l.Acquire(context.Background(), call("acme", fmt.Sprint("w", i+1), 1, 1))
		if err == nil {
			admitted++ // in flight: its answer takes seconds
			continue
		}
		reasons[waitErr(t, err).Reason]++
	}
	if admitted < 5 {
		t.Fatalf("1.1s after a 100ms empty-window pause with 600 rpm learnt: %d of 10 calls admitted, want ~10; put off: %v", admitted, reasons)
	}
}

// TestReservationsInFlightPutACallOffBrieflyNotADay: a regression test (attack round 2 of issue 15).
//
// Scenario: tenant acme has a budget of 10,000 tokens a day and has used 0. Eight of
// its calls are in flight, each reserving its estimate (100 prompt + 1,024 output, no
// MaxTokens set: the documented default): 8,992 tokens reserved, none used. A ninth
// call needs 1,124: the budget check counts used + reserved, so it is refused as
// "budget", and a budget refusal waits until the next UTC day (+ jitter), hours away.
// Seconds later the eight calls settle with their real usage (150 tokens each, 1,200
// used): 8,800 tokens of today's budget are free, yet the ninth job sits in the
// scheduled set until midnight, its GET saying "token budget of tenant acme is spent
// for today (8992 tokens used or reserved)". Every job of a busy tenant meets this
// long before its budget is really spent.
//
// What should happen: a call that would fit once the reservations in flight settle
// (used + need <= budget) waits for them (a short, lease-bounded wait, like the
// concurrency wait), not for the next day; only "used + need > budget" is a day's wait.
func TestReservationsInFlightPutACallOffBrieflyNotADay(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 10_000, MaxWait: time.Millisecond})
	ctx := context.Background()
	var inFlight []*limiter.Permit
	for i := range 8 {
		p, err := l.Acquire(ctx, call("acme", fmt.Sprint("f", i), 100, 1024))
		if err != nil {
			t.Fatal(err)
		}
		inFlight = append(inFlight, p)
	}
	_, err := l.Acquire(ctx, call("acme", "ninth", 100, 1024))
	we := waitErr(t, err)
	for _, p := range inFlight {
		p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: 100, OutputTokens: 50}})
	}
	u := usageOf(t, l, "acme")
	t.Logf("after the eight settled: used %d, reserved %d of 10000", u.BudgetUsed, u.BudgetReserved)
	if we.Delay > 5*time.Minute {
		t.Fatalf("a call of a tenant that has used 0 of its 10000 tokens (8 calls in flight) is put off for %v (%q); after they settle 8800 tokens are free but the job waits until the next UTC day",
			we.Delay.Round(time.Minute), we.Reason)
	}
}
