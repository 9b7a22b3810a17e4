package retry

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"
)

// Defaults of Policy's fields, applied to zero values.
const (
	DefaultBase           = 500 * time.Millisecond
	DefaultCap            = 8 * time.Second
	DefaultMaxAttempts    = 4
	DefaultPerCallTimeout = 20 * time.Second
	DefaultMinAttempt     = time.Second
	DefaultRetryAfterCap  = 30 * time.Second
)

// Policy says how Do retries. The zero Policy is usable: every zero field takes its
// documented default. A Policy is a value; it is safe for concurrent use by several Do
// calls when its Clock, Rand and OnRetry are.
type Policy struct {
	// Base is the backoff unit: retry n sleeps up to min(Cap, Base·2ⁿ). Default: 0.5s.
	Base time.Duration
	// Cap bounds one backoff sleep. Default: 8s.
	Cap time.Duration
	// MaxAttempts is the number of attempts, the first included. Default: 4.
	MaxAttempts int
	// PerCallTimeout is the wall-clock limit of one attempt, enforced as a context
	// deadline (capped by what is left of the Deadline). Default: 20s.
	PerCallTimeout time.Duration
	// MinAttempt is the shortest attempt worth making: Do does not start an attempt
	// with less time than this, and does not sleep when the sleep would leave less.
	// Default: 1s; a value above PerCallTimeout is lowered to PerCallTimeout, since no
	// attempt could ever be made otherwise.
	MinAttempt time.Duration
	// RetryAfterCap bounds a server's Retry-After: a longer request is shortened to it.
	// Default: 30s. (Waiting less than the server asks mostly buys another 429; the
	// Deadline still bounds every sleep.)
	RetryAfterCap time.Duration
	// Classify decides what is retryable. Default: the package's Classify.
	Classify func(error) Verdict
	// Clock reads time and sleeps between attempts. Default: SystemClock. The
	// per-call timeout is always a real context deadline, so that the network stack
	// enforces it.
	Clock Clock
	// Rand draws the jitter. Default: math/rand/v2's global source.
	Rand Rand
	// OnRetry, when set, is called before each sleep, for logs and metrics. It runs on
	// Do's goroutine and must not block.
	OnRetry func(Retry)
}

// Retry describes one decision to retry, for Policy.OnRetry.
type Retry struct {
	// Attempt is the number of the attempt that failed, from 1.
	Attempt int
	// Class is why the failure is retryable.
	Class Class
	// Delay is the sleep before the next attempt.
	Delay time.Duration
	// FromRetryAfter reports whether Delay came from the server's Retry-After (capped)
	// rather than from the jittered backoff.
	FromRetryAfter bool
	// Err is the attempt's error.
	Err error
}

// WithDefaults returns p with every zero field set to its default and MinAttempt lowered
// to PerCallTimeout when above it.
func (p Policy) WithDefaults() Policy {
	p.Base = cmp.Or(p.Base, DefaultBase)
	p.Cap = cmp.Or(p.Cap, DefaultCap)
	if p.MaxAttempts <= 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	p.PerCallTimeout = cmp.Or(p.PerCallTimeout, DefaultPerCallTimeout)
	p.MinAttempt = min(cmp.Or(p.MinAttempt, DefaultMinAttempt), p.PerCallTimeout)
	p.RetryAfterCap = cmp.Or(p.RetryAfterCap, DefaultRetryAfterCap)
	if p.Classify == nil {
		p.Classify = Classify
	}
	if p.Clock == nil {
		p.Clock = SystemClock{}
	}
	if p.Rand == nil {
		p.Rand = globalRand{}
	}
	return p
}

// Delay returns the sleep after the failed attempt number attempt (from 1) with verdict
// v: the server's Retry-After capped at RetryAfterCap when present, else full jitter
// over [0, min(Cap, Base·2^(attempt-1))]. p must have its defaults applied.
func (p Policy) Delay(attempt int, v Verdict) (d time.Duration, fromRetryAfter bool) {
	if v.HasRetryAfter {
		return min(v.RetryAfter, p.RetryAfterCap), true
	}
	return FullJitter(p.Rand, p.Base, p.Cap, attempt-1), false
}

// errAttemptDeadline is the cause of a per-call context deadline set by Do.
var errAttemptDeadline = errors.New("retry: per-call timeout")

// Do calls fn until it succeeds, fails permanently, or the policy says stop. Each call
// gets a context whose deadline is min(PerCallTimeout, deadline.Remaining()), and which
// carries deadline for ExtendDeadline; a call
// cut by it returns an *AttemptTimeoutError, which is retryable. Between attempts Do
// sleeps (on p.Clock) for the server's Retry-After or the jittered backoff.
//
// It returns fn's value on success, and otherwise:
//   - the error itself when Classify says it is not retryable;
//   - *ExhaustedError after MaxAttempts retryable failures;
//   - *DeadlineExceededError when an attempt would get less than MinAttempt, when a
//     sleep would leave less than MinAttempt, or when ctx's own deadline passed;
//   - an error wrapping context.Canceled (and the last error) when ctx is cancelled.
//
// The zero Deadline means no delivery limit. Do is safe for concurrent use.
func Do[T any](ctx context.Context, p Policy, deadline Deadline, fn func(ctx context.Context) (T, error)) (T, error) {
	p = p.WithDefaults()
	var zero T
	var last error
	for attempt := 1; ; attempt++ {
		if ctx.Err() != nil {
			return zero, stopped(ctx, deadline, attempt-1, last)
		}
		remaining := deadline.Remaining()
		limit := min(p.PerCallTimeout, remaining)
		if limit < p.MinAttempt {
			return zero, &DeadlineExceededError{Remaining: remaining, Attempts: attempt - 1, Err: last}
		}

		callCtx, cancel := context.WithTimeoutCause(ctx, limit, errAttemptDeadline)
		if !deadline.IsZero() {
			callCtx = context.WithValue(callCtx, deadlineKey{}, deadline)
		}
		v, err := fn(callCtx)
		timedOut := errors.Is(context.Cause(callCtx), errAttemptDeadline)
		cancel()
		if err == nil {
			return v, nil
		}
		if ctx.Err() != nil {
			return zero, stopped(ctx, deadline, attempt, err)
		}
		if timedOut {
			err = &AttemptTimeoutError{Limit: limit, Err: err}
		}
		last = err

		verdict := p.Classify(err)
		if !verdict.Retryable {
			return zero, err
		}
		if attempt >= p.MaxAttempts {
			return zero, &ExhaustedError{Attempts: attempt, Err: err}
		}
		delay, fromRA := p.Delay(attempt, verdict)
		if !deadline.IsZero() {
			if left := deadline.Remaining(); left-delay < p.MinAttempt {
				return zero, &DeadlineExceededError{Remaining: left, Attempts: attempt, Err: err}
			}
		}
		if p.OnRetry != nil {
			p.OnRetry(Retry{Attempt: attempt, Class: verdict.Class, Delay: delay, FromRetryAfter: fromRA, Err: err})
		}
		if err := p.Clock.Sleep(ctx, delay); err != nil {
			return zero, stopped(ctx, deadline, attempt, last)
		}
	}
}

// stopped is Do's error when ctx ended: a DeadlineExceededError for a context deadline
// (the caller's budget), otherwise the cancellation wrapping the last error.
func stopped(ctx context.Context, deadline Deadline, attempts int, last error) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		remaining := deadline.Remaining()
		if at, ok := ctx.Deadline(); ok && deadline.IsZero() {
			remaining = time.Until(at)
		}
		return &DeadlineExceededError{Remaining: remaining, Attempts: attempts, Err: last}
	}
	if last == nil || errors.Is(last, context.Canceled) {
		return fmt.Errorf("retry: stopped after %d attempts: %w", attempts, ctx.Err())
	}
	return fmt.Errorf("retry: stopped after %d attempts: %w (last error: %w)", attempts, ctx.Err(), last)
}
