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
// ErrPermanent (see Permanent) moves it to the dead-letter stream at once; any other
// error, or a panic, leaves it pending so that it is delivered again after ClaimIdle,
// until MaxDeliveries. ctx is cancelled when the worker's shutdown timeout expires.
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
