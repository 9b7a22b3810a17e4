package queue

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/retry"
)

// Job is one delivery of a message to a Handler.
type Job struct {
	Message
	// ID is the stream entry id (1700000000000-0); a repeated enqueue of one job id has a
	// different ID.
	ID string
	// Deliveries is the number of this attempt: 1 for the first run, then 1 + the
	// attempts the job spent (runs that failed on it, and deliveries that never
	// reported because their worker died). Hand-backs and snoozes do not count, so two
	// runs may see the same number. Message.Attempts is the part recorded in the entry;
	// the rest is the consumer group's delivery counter.
	Deliveries int64
}

// Handler runs jobs. Handle is called from many goroutines at once (up to the Worker's
// Concurrency) and may be called again for a job it already ran, so it must be safe for
// concurrent use and idempotent per Job.JobID.
//
// Its result decides the entry's fate: nil acknowledges it; an error wrapping
// ErrPermanent (see Permanent) moves it to the dead-letter stream at once; an error
// wrapping ErrUnavailable (see Unavailable) hands it back without spending an attempt,
// to run again after a short wait (its Retry-After, if it carries one); a *SnoozeError
// (see Snooze) runs it again after its delay without spending an attempt, and so does a
// *retry.WaitError (a limiter had no capacity for the job's call; its Reason is kept in
// the job's index, JobIndex.Waiting, while it waits); any other
// error, or a panic, spends an attempt and schedules the next after a full-jitter
// backoff (WorkerConfig.RetryBase, RetryMax) or the error's Retry-After
// (retry.RetryAfterer: retry.RetryAfter's, a provider's 429), until the budget
// (MaxDeliveries) is spent. ctx is cancelled when the worker's shutdown timeout expires
// (the job is then handed back) and after MaxRunTime (a failed attempt).
type Handler interface {
	Handle(ctx context.Context, job *Job) error
}

// HandlerFunc adapts a function to the Handler interface.
type HandlerFunc func(ctx context.Context, job *Job) error

// Handle calls f(ctx, job).
func (f HandlerFunc) Handle(ctx context.Context, job *Job) error { return f(ctx, job) }

// ErrPermanent is retry.ErrPermanent, the one permanent marker of onceflow: a handler
// error that matches it (retry.Permanent, onceflow.Permanent) has its job dead-lettered
// after this run with the reason "permanent: <error>".
//
// Deprecated: use retry.ErrPermanent (or onceflow.ErrPermanent); this alias goes in a
// later release.
var ErrPermanent = retry.ErrPermanent

// Permanent returns err marked as permanent: it is retry.Permanent.
//
// Deprecated: use retry.Permanent (or onceflow.Permanent); this forwarder goes in a
// later release.
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

// SnoozeError asks the worker to run the job again after Delay without spending an
// attempt: the job is not failing, it is waiting for something (a time, a limit, a
// resource another job holds). Return it with Snooze.
type SnoozeError struct {
	// Delay is the wait before the next run; never negative.
	Delay time.Duration
}

// Snooze returns a *SnoozeError: the job runs again after d (0: at once) without
// spending an attempt. A job that snoozes for ever never fails: bound it yourself.
func Snooze(d time.Duration) error { return &SnoozeError{Delay: max(d, 0)} }

// Error says how long.
func (e *SnoozeError) Error() string { return fmt.Sprintf("snoozed for %v", e.Delay) }

// Completer is implemented by a Handler that records the jobs it completed (the onceflow
// Client's handler reads its completion records). Before a job whose budget is spent is
// dead-lettered, the worker asks: a job that completed (its effects committed, then its
// worker died before the acknowledgement) is acknowledged instead, so it is never both
// done and dead-lettered. An error means the answer is unknown (the store is down): the
// job is handed back, not buried.
type Completer interface {
	Completed(ctx context.Context, job *Job) (bool, error)
}
