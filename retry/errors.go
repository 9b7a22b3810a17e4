package retry

import (
	"errors"
	"fmt"
	"net/http"
	"time"
)

var (
	// ErrDeadlineExceeded is matched (errors.Is) by every *DeadlineExceededError: the
	// delivery's budget ran out. It is never retried in-process; the queue redelivers
	// the message with a fresh budget.
	ErrDeadlineExceeded = errors.New("retry: delivery deadline exceeded")

	// ErrUnavailable is matched by errors that say a dependency is known to be down,
	// so a call was not even tried (an open circuit breaker's *breaker.OpenError).
	// Classify gives them ClassUnavailable: not retried in-process, but Transient.
	ErrUnavailable = errors.New("dependency unavailable")

	// ErrPermanent is matched by every error marked with Permanent: a failure no retry
	// can fix. It is the one permanent marker of onceflow: Classify reports it as
	// ClassPermanent and Do stops; a queue handler that returns it is dead-lettered at
	// once (queue.ErrPermanent is this value); an outbox sender that returns it
	// exhausts its row (outbox.ErrPermanent is this value).
	ErrPermanent = errors.New("permanent")

	// ErrWaiting is matched by every *WaitError: the call was not made because the
	// capacity it needs is not free now. Classify gives ClassWaiting: not retried
	// in-process, Transient, and not an Outage.
	ErrWaiting = errors.New("waiting for capacity")
)

// Permanent marks err as not retryable, whatever its kind: Classify returns a permanent
// ClassPermanent verdict, Do returns it after one attempt, a queue worker dead-letters
// the job and an outbox relay exhausts the row. The result matches ErrPermanent, its
// message is err's, and it unwraps to err, so errors.Is and errors.As still find what err
// holds. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

// IsPermanent reports whether err was marked with Permanent (errors.Is(err,
// ErrPermanent)).
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

type permanentError struct{ err error }

func (p *permanentError) Error() string        { return p.err.Error() }
func (p *permanentError) Unwrap() error        { return p.err }
func (p *permanentError) Is(target error) bool { return target == ErrPermanent }

// Unavailable marks err as an outage of a dependency rather than a failure of the work
// (see ErrUnavailable): the result matches ErrUnavailable, its message is err's, and it
// unwraps to err. A queue worker hands such a job back without spending a delivery.
// Unavailable(nil) is nil.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &unavailableError{err}
}

type unavailableError struct{ err error }

func (u *unavailableError) Error() string        { return u.err.Error() }
func (u *unavailableError) Unwrap() error        { return u.err }
func (u *unavailableError) Is(target error) bool { return target == ErrUnavailable }

// DelayError asks for the work to run again after Delay: a job handler returns it (with
// RetryAfter) when it knows when a retry can succeed (a provider's reset time, a
// downstream's maintenance window). It implements RetryAfterer, so Classify carries the
// delay, and unwraps to Err, whose class decides everything else.
type DelayError struct {
	// Delay is how long to wait before the next run; never negative.
	Delay time.Duration
	// Err is the failure; never nil.
	Err error
}

// RetryAfter returns err with the request to run again after d (a *DelayError). A
// negative d counts as zero; a nil err becomes "retry requested". Within retry.Do the
// delay is honoured as a Retry-After (when err is retryable); a queue worker reclaims
// the job after d rather than after its claim idle time, at most that (docs/queue.md).
func RetryAfter(d time.Duration, err error) error {
	if err == nil {
		err = errors.New("retry requested")
	}
	return &DelayError{Delay: max(d, 0), Err: err}
}

// Error is Err's message and the delay.
func (e *DelayError) Error() string {
	return fmt.Sprintf("%v (run again after %v)", e.Err, e.Delay)
}

// Unwrap returns Err.
func (e *DelayError) Unwrap() error { return e.Err }

// RetryAfter implements RetryAfterer.
func (e *DelayError) RetryAfter() (time.Duration, bool) { return e.Delay, true }

// WaitError says that a call was not made, or not taken further, because the capacity
// it needs is not free now: a rate limit, a concurrency limit, a token budget, a
// provider's pause after a 429 (package limiter returns it). It is neither the work's
// failure nor a dependency's outage. Do returns it at once, Classify gives
// ClassWaiting, and a queue worker runs the job again after Delay without spending an
// attempt, with Reason shown as the job's waiting reason. It matches ErrWaiting,
// implements RetryAfterer with Delay, and unwraps to Err.
type WaitError struct {
	// Delay is how long to wait before trying again; never negative.
	Delay time.Duration
	// Reason says what is waited for, in a few words ("rate limit of model gpt-4.1-mini:
	// requests per minute", "token budget of tenant acme for 2026-12-01").
	Reason string
	// Err is the answer that caused the wait (the 429 that paused a model), if any.
	Err error
}

// Error is the reason and the delay.
func (e *WaitError) Error() string {
	msg := fmt.Sprintf("waiting %v for capacity: %s", e.Delay.Round(time.Millisecond), e.Reason)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Is reports whether target is ErrWaiting.
func (e *WaitError) Is(target error) bool { return target == ErrWaiting }

// Unwrap returns Err.
func (e *WaitError) Unwrap() error { return e.Err }

// RetryAfter implements RetryAfterer.
func (e *WaitError) RetryAfter() (time.Duration, bool) { return e.Delay, true }

// DeadlineExceededError reports that the delivery's Deadline left less than one useful
// attempt (Policy.MinAttempt), before an attempt or before a sleep, or that the
// caller's context deadline passed. It matches ErrDeadlineExceeded and unwraps to the
// last attempt's error, if any.
type DeadlineExceededError struct {
	// Remaining is what was left of the deadline when Do stopped (may be negative).
	Remaining time.Duration
	// Attempts is the number of attempts made.
	Attempts int
	// Err is the last attempt's error; nil when no attempt was made.
	Err error
}

// Error describes the stop and the last error.
func (e *DeadlineExceededError) Error() string {
	msg := fmt.Sprintf("retry: delivery deadline exceeded after %d attempts (%v left)", e.Attempts, e.Remaining.Round(time.Millisecond))
	if e.Err != nil {
		msg += ": last error: " + e.Err.Error()
	}
	return msg
}

// Is makes errors.Is(err, ErrDeadlineExceeded) true.
func (e *DeadlineExceededError) Is(target error) bool { return target == ErrDeadlineExceeded }

// Unwrap returns the last attempt's error.
func (e *DeadlineExceededError) Unwrap() error { return e.Err }

// AttemptTimeoutError reports that one attempt ran past its per-call timeout, the
// wall-clock limit Do puts on every call. It is retryable (ClassTimeout) and unwraps to
// the error the call returned (usually one wrapping context.DeadlineExceeded).
type AttemptTimeoutError struct {
	// Limit is the timeout the attempt ran under: min(PerCallTimeout, deadline left).
	Limit time.Duration
	// Err is what the call returned.
	Err error
}

// Error names the limit and the call's error.
func (e *AttemptTimeoutError) Error() string {
	return fmt.Sprintf("retry: attempt timed out after %v: %v", e.Limit, e.Err)
}

// Unwrap returns the call's error.
func (e *AttemptTimeoutError) Unwrap() error { return e.Err }

// Timeout reports true, like a net.Error timeout.
func (e *AttemptTimeoutError) Timeout() bool { return true }

// ExhaustedError reports that every one of Policy.MaxAttempts attempts failed with a
// retryable error. It unwraps to the last error, so Classify and Transient still see a
// retryable failure and the queue redelivers it.
type ExhaustedError struct {
	// Attempts is the number of attempts made.
	Attempts int
	// Err is the last attempt's error.
	Err error
}

// Error names the attempts and the last error.
func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("retry: gave up after %d attempts: %v", e.Attempts, e.Err)
}

// Unwrap returns the last attempt's error.
func (e *ExhaustedError) Unwrap() error { return e.Err }

// StatusError is an HTTP error response reduced to what classification needs. HTTP
// clients that are not provider SDKs (the outbox's webhook sender) return it for a
// non-2xx answer so that Classify sees the status, Retry-After and x-should-retry.
type StatusError struct {
	// Status is the HTTP status code.
	Status int
	// After is the parsed Retry-After (see RetryAfterFromHeader), valid when HasAfter.
	After    time.Duration
	HasAfter bool
	// Should is the x-should-retry verdict ("true" or "false"), empty when absent.
	Should string
}

// NewStatusError builds a StatusError from a response's status and headers; now is the
// instant used to turn an HTTP-date Retry-After into a duration.
func NewStatusError(status int, h http.Header, now time.Time) *StatusError {
	e := &StatusError{Status: status, Should: h.Get("X-Should-Retry")}
	e.After, e.HasAfter = RetryAfterFromHeader(h, now)
	return e
}

// Error is "HTTP <status> <text>".
func (e *StatusError) Error() string {
	return fmt.Sprintf("HTTP %d %s", e.Status, http.StatusText(e.Status))
}

// HTTPStatus implements HTTPStatuser.
func (e *StatusError) HTTPStatus() int { return e.Status }

// RetryAfter implements RetryAfterer.
func (e *StatusError) RetryAfter() (time.Duration, bool) { return e.After, e.HasAfter }

// ShouldRetry implements ShouldRetrier.
func (e *StatusError) ShouldRetry() (bool, bool) { return ParseShouldRetry(e.Should) }

// ParseShouldRetry reads an x-should-retry header value: "true" or "false" (any case,
// surrounding spaces ignored); anything else counts as absent.
func ParseShouldRetry(v string) (retry bool, ok bool) {
	switch {
	case equalFoldTrim(v, "true"):
		return true, true
	case equalFoldTrim(v, "false"):
		return false, true
	}
	return false, false
}
