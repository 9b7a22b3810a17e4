package queue

import (
	"context"

	"github.com/onceflow/onceflow/retry"
)

// Job is one delivery of a message to a Handler.
type Job struct {
	Message
	// ID is the stream entry id (1700000000000-0); a repeated enqueue of one job id has a
	// different ID.
	ID string
	// Deliveries counts the deliveries of this entry, this one included: 1 for the first,
	// 2 after one reclaim, and so on (the consumer group's counter, from XPENDING).
	Deliveries int64
}

// Handler runs jobs. Handle is called from many goroutines at once (up to the Worker's
// Concurrency) and may be called again for a job it already ran, so it must be safe for
// concurrent use and idempotent per Job.JobID.
//
// Its result decides the entry's fate: nil acknowledges it; an error wrapping
// ErrPermanent (see Permanent) moves it to the dead-letter stream at once; an error
// wrapping ErrUnavailable (see Unavailable) hands it back without spending a delivery;
// any other error, or a panic, leaves it pending so that it is delivered again after
// ClaimIdle, until MaxDeliveries; an error from retry.RetryAfter(d, err) is delivered
// again after d instead, when d is shorter than ClaimIdle. ctx is cancelled when the worker's shutdown timeout
// expires.
type Handler interface {
	Handle(ctx context.Context, job *Job) error
}

// HandlerFunc adapts a function to the Handler interface.
type HandlerFunc func(ctx context.Context, job *Job) error

// Handle calls f(ctx, job).
func (f HandlerFunc) Handle(ctx context.Context, job *Job) error { return f(ctx, job) }

// ErrPermanent marks a handler error that no redelivery can fix (a 400 from the model, a
// payload the handler rejects): the job is dead-lettered after this run with the reason
// "permanent: <error>". It is retry.ErrPermanent, the one permanent marker of onceflow:
// retry.Permanent, outbox.Permanent and Permanent all mark errors with it. Return it
// wrapped, with Permanent or fmt.Errorf("...: %w", ...).
var ErrPermanent = retry.ErrPermanent

// Permanent returns err marked as permanent (retry.Permanent): errors.Is(result,
// ErrPermanent) and errors.Is(result, err) both hold, and its message is err's.
// Permanent(nil) is nil.
func Permanent(err error) error { return retry.Permanent(err) }

// ErrUnavailable marks a handler error that says a dependency the job needs is down (a
// provider's quota is exhausted, its circuit breaker is open), not that the job
// failed: the entry is handed back pending with its delivery count as it was before
// this delivery, so the run spends none of the job's MaxDeliveries, and it is delivered
// again after ClaimIdle. It is retry.ErrUnavailable, which an open breaker's error
// matches too. Return it wrapped, with Unavailable. A worker with a Gate takes no new
// work while the dependency is down, so handed-back jobs wait rather than spin.
var ErrUnavailable = retry.ErrUnavailable

// Unavailable returns err marked as a dependency's failure rather than the job's
// (retry.Unavailable): errors.Is(result, ErrUnavailable) and errors.Is(result, err) both
// hold, and its message is err's. Unavailable(nil) is nil.
func Unavailable(err error) error { return retry.Unavailable(err) }

// Gate holds a Worker back from new work while a dependency its handler needs is down;
// *breaker.Breaker implements it.
type Gate interface {
	// Admit blocks until the worker may take jobs and returns how many it may take at
	// most (0: no limit), or ctx's error when ctx ends first.
	Admit(ctx context.Context) (int, error)
}
