package queue

import (
	"context"
	"errors"
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
// ClaimIdle, until MaxDeliveries. ctx is cancelled when the worker's shutdown timeout
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
// "permanent: <error>". Return it wrapped, with Permanent or fmt.Errorf("...: %w", ...).
var ErrPermanent = errors.New("permanent job error")

// Permanent returns err marked as permanent: errors.Is(result, ErrPermanent) and
// errors.Is(result, err) both hold, and its message is err's. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string   { return e.err.Error() }
func (e *permanentError) Unwrap() []error { return []error{ErrPermanent, e.err} }

// ErrUnavailable marks a handler error that says a dependency the job needs is down (a
// provider's quota is exhausted, its circuit breaker is open), not that the job
// failed: the entry is handed back pending with its delivery count as it was before
// this delivery, so the run spends none of the job's MaxDeliveries, and it is delivered
// again after ClaimIdle. Return it wrapped, with Unavailable. A worker with a Gate takes
// no new work while the dependency is down, so handed-back jobs wait rather than spin.
var ErrUnavailable = errors.New("dependency unavailable")

// Unavailable returns err marked as a dependency's failure rather than the job's:
// errors.Is(result, ErrUnavailable) and errors.Is(result, err) both hold, and its
// message is err's. Unavailable(nil) is nil.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &unavailableError{err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string   { return e.err.Error() }
func (e *unavailableError) Unwrap() []error { return []error{ErrUnavailable, e.err} }

// Gate holds a Worker back from new work while a dependency its handler needs is down;
// *breaker.Breaker implements it.
type Gate interface {
	// Admit blocks until the worker may take jobs and returns how many it may take at
	// most (0: no limit), or ctx's error when ctx ends first.
	Admit(ctx context.Context) (int, error)
}
