package retry_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// script returns a call that fails with errs in order, then succeeds with "ok".
func script(errs ...error) (func(context.Context) (string, error), *int) {
	calls := 0
	return func(ctx context.Context) (string, error) {
		calls++
		if calls <= len(errs) {
			return "", errs[calls-1]
		}
		return "ok", nil
	}, &calls
}

func testPolicy(clock *retrytest.Clock, onRetry func(retry.Retry)) retry.Policy {
	return retry.Policy{Clock: clock, Rand: retrytest.Max{}, OnRetry: onRetry}
}

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestDoSucceedsAfterRetryableErrors(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	var retries []retry.Retry
	fn, calls := script(&apiErr{status: 503}, &apiErr{status: 429})
	v, err := retry.Do(context.Background(), testPolicy(clock, func(r retry.Retry) { retries = append(retries, r) }), retry.AfterOn(clock, time.Minute), fn)
	if err != nil || v != "ok" || *calls != 3 {
		t.Fatalf("Do = %q, %v after %d calls; want ok after 3", v, err, *calls)
	}
	// Max rand: the delays are the full-jitter upper bounds base·2⁰ and base·2¹.
	want := []time.Duration{500 * time.Millisecond, time.Second}
	if got := clock.Sleeps(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("sleeps %v, want %v", got, want)
	}
	if len(retries) != 2 || retries[0].Attempt != 1 || retries[0].Class != retry.ClassServerError ||
		retries[1].Attempt != 2 || retries[1].Class != retry.ClassRateLimited || retries[1].FromRetryAfter {
		t.Fatalf("OnRetry saw %+v", retries)
	}
}

func TestDoStopsAtOnceOnPermanentAndUnknownErrors(t *testing.T) {
	t.Parallel()
	for _, perm := range []error{&apiErr{status: 400, code: "context_length_exceeded"}, &apiErr{status: 429, code: "insufficient_quota"},
		errors.New("a bug of ours"), retry.Permanent(&apiErr{status: 503})} {
		clock := retrytest.NewClock(t0)
		fn, calls := script(perm, perm, perm)
		_, err := retry.Do(context.Background(), testPolicy(clock, nil), retry.AfterOn(clock, time.Minute), fn)
		if *calls != 1 || !errors.Is(err, perm) {
			t.Errorf("%v: %d calls, err %v; want 1 call returning it", perm, *calls, err)
		}
		var ex *retry.ExhaustedError
		if errors.As(err, &ex) || len(clock.Sleeps()) != 0 {
			t.Errorf("%v: wrapped as exhausted or slept", perm)
		}
	}
}

func TestDoExhaustsMaxAttempts(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	storm := &apiErr{status: 503}
	fn, calls := script(storm, storm, storm, storm, storm, storm)
	_, err := retry.Do(context.Background(), retry.Policy{Clock: clock, MaxAttempts: 3}, retry.AfterOn(clock, time.Hour), fn)
	var ex *retry.ExhaustedError
	if !errors.As(err, &ex) || ex.Attempts != 3 || *calls != 3 || !errors.Is(err, storm) {
		t.Fatalf("err %v after %d calls; want ExhaustedError after 3", err, *calls)
	}
	if !retry.Transient(err) {
		t.Fatal("an exhausted 503 must be transient so the queue redelivers it")
	}
	if n := len(clock.Sleeps()); n != 2 {
		t.Fatalf("%d sleeps, want 2", n)
	}
}

func TestDoHonoursRetryAfterCapped(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	var retries []retry.Retry
	fn, _ := script(&apiErr{status: 429, after: 3 * time.Second, hasAfter: true}, &apiErr{status: 429, after: time.Hour, hasAfter: true})
	p := testPolicy(clock, func(r retry.Retry) { retries = append(retries, r) })
	p.RetryAfterCap = 10 * time.Second
	if _, err := retry.Do(context.Background(), p, retry.AfterOn(clock, time.Minute), fn); err != nil {
		t.Fatal(err)
	}
	want := []time.Duration{3 * time.Second, 10 * time.Second}
	if got := clock.Sleeps(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("sleeps %v, want %v (Retry-After, then capped)", got, want)
	}
	if !retries[0].FromRetryAfter || !retries[1].FromRetryAfter {
		t.Fatalf("OnRetry did not flag Retry-After: %+v", retries)
	}
}

func TestDoStopsWhenTheSleepWouldExhaustTheDeadline(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	rl := &apiErr{status: 429, after: 9500 * time.Millisecond, hasAfter: true}
	fn, calls := script(rl, rl)
	_, err := retry.Do(context.Background(), testPolicy(clock, nil), retry.AfterOn(clock, 10*time.Second), fn)
	var dl *retry.DeadlineExceededError
	if !errors.As(err, &dl) || !errors.Is(err, retry.ErrDeadlineExceeded) || *calls != 1 || dl.Attempts != 1 {
		t.Fatalf("err %v after %d calls; want DeadlineExceeded after 1 (a 9.5s sleep leaves < 1s)", err, *calls)
	}
	if !errors.Is(err, rl) {
		t.Fatal("DeadlineExceededError does not unwrap to the last error")
	}
	if len(clock.Sleeps()) != 0 {
		t.Fatalf("slept %v although the sleep could not leave a useful attempt", clock.Sleeps())
	}
	if v := retry.Classify(err); v.Retryable || v.Class != retry.ClassDeadline || !retry.Transient(err) {
		t.Fatalf("deadline verdict %+v; want not retryable in-process but transient", v)
	}
}

func TestDoNoAttemptWithoutAUsefulBudget(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	fn, calls := script()
	_, err := retry.Do(context.Background(), testPolicy(clock, nil), retry.AfterOn(clock, 500*time.Millisecond), fn)
	if !errors.Is(err, retry.ErrDeadlineExceeded) || *calls != 0 {
		t.Fatalf("err %v after %d calls; want DeadlineExceeded before any call (budget < MinAttempt)", err, *calls)
	}
}

func TestDoPerCallTimeoutIsAContextDeadline(t *testing.T) {
	t.Parallel()
	var limits []time.Duration
	calls := 0
	hang := func(ctx context.Context) (int, error) {
		calls++
		dl, _ := ctx.Deadline()
		limits = append(limits, time.Until(dl))
		<-ctx.Done()
		return 0, fmt.Errorf("call: %w", ctx.Err())
	}
	clock := retrytest.NewClock(t0)
	p := retry.Policy{Clock: clock, PerCallTimeout: 30 * time.Millisecond, MaxAttempts: 2}
	_, err := retry.Do(context.Background(), p, retry.AfterOn(clock, time.Minute), hang)
	var at *retry.AttemptTimeoutError
	if !errors.As(err, &at) || at.Limit != 30*time.Millisecond || calls != 2 {
		t.Fatalf("err %v after %d calls; want two AttemptTimeoutErrors of 30ms", err, calls)
	}
	for _, l := range limits {
		if l <= 0 || l > 30*time.Millisecond {
			t.Fatalf("call deadline %v from now, want within 30ms", l)
		}
	}
}

func TestDoPerCallTimeoutCappedByDeadline(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	var got time.Duration
	_, err := retry.Do(context.Background(), retry.Policy{Clock: clock, PerCallTimeout: time.Hour}, retry.AfterOn(clock, 5*time.Second),
		func(ctx context.Context) (int, error) {
			dl, _ := ctx.Deadline()
			got = time.Until(dl)
			return 1, nil
		})
	if err != nil || got > 5*time.Second || got < 4*time.Second {
		t.Fatalf("call deadline %v from now (err %v), want about the 5s left of the delivery", got, err)
	}
}

func TestDoMinAttemptLoweredToPerCallTimeout(t *testing.T) {
	t.Parallel()
	p := retry.Policy{PerCallTimeout: 200 * time.Millisecond}.WithDefaults()
	if p.MinAttempt != 200*time.Millisecond {
		t.Fatalf("MinAttempt %v, want lowered to the 200ms per-call timeout", p.MinAttempt)
	}
	d := retry.Policy{}.WithDefaults()
	if d.Base != 500*time.Millisecond || d.Cap != 8*time.Second || d.MaxAttempts != 4 || d.PerCallTimeout != 20*time.Second ||
		d.MinAttempt != time.Second || d.RetryAfterCap != 30*time.Second {
		t.Fatalf("defaults %+v", d)
	}
}

func TestDoCancelledDuringSleep(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	rl := &apiErr{status: 503}
	calls := 0
	_, err := retry.Do(ctx, retry.Policy{}, retry.After(time.Minute), func(context.Context) (int, error) {
		calls++
		cancel() // shutdown arrives while the first attempt fails
		return 0, rl
	})
	if !errors.Is(err, context.Canceled) || !errors.Is(err, rl) || calls != 1 {
		t.Fatalf("err %v after %d calls; want canceled wrapping the 503 after 1", err, calls)
	}
	if v := retry.Classify(err); v.Class != retry.ClassCanceled || !retry.Transient(err) {
		t.Fatalf("verdict %+v", v)
	}
}

func TestDoCallerContextDeadlineIsADeliveryDeadline(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := retry.Do(ctx, retry.Policy{MinAttempt: time.Millisecond}, retry.Deadline{}, func(ctx context.Context) (int, error) {
		<-ctx.Done()
		return 0, ctx.Err()
	})
	if !errors.Is(err, retry.ErrDeadlineExceeded) {
		t.Fatalf("err %v, want a DeadlineExceededError for the caller's context deadline", err)
	}
}

func TestDeadlineCountsDownOnItsClockAndTheZeroOneHasNoLimit(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(t0)
	d := retry.AfterOn(clock, 10*time.Second)
	if d.Remaining() != 10*time.Second || d.Expired() || d.IsZero() || !d.At().Equal(t0.Add(10*time.Second)) {
		t.Fatalf("fresh deadline: remaining %v", d.Remaining())
	}
	clock.Advance(11 * time.Second)
	if d.Remaining() != -time.Second || !d.Expired() {
		t.Fatalf("after 11s: remaining %v", d.Remaining())
	}
	var zero retry.Deadline
	if !zero.IsZero() || zero.Expired() || zero.Remaining() < 100*365*24*time.Hour {
		t.Fatal("the zero Deadline must have no limit")
	}
	// The system clock's readings are monotonic: a wall-clock step cannot shift it.
	real := retry.After(time.Hour)
	if r := real.Remaining(); r <= 59*time.Minute || r > time.Hour {
		t.Fatalf("After(1h).Remaining() = %v", r)
	}
	if !strings.Contains(real.At().String(), "m=") {
		t.Fatal("a system-clock Deadline lost its monotonic reading")
	}
}
