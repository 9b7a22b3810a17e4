package onceflow

import (
	"errors"
	"time"

	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// The error vocabulary of a job, shared by the queue, the retry policy and the outbox
// relay: a Worker returns nil (done), an error marked Permanent (dead-lettered at once,
// with the error as its reason), an error from RetryAfter (a failed attempt: run again
// after that delay), an error marked Unavailable (a dependency is down: handed back
// without spending an attempt), Snooze's or ErrWaiting's (run again after a delay
// without spending an attempt), or any other error (a failed attempt: run again after a full-jitter backoff,
// QueueConfig.RetryBase and RetryMax, until the queue's MaxDeliveries attempts are
// spent). Match them with errors.Is and errors.As only.
//
// onceflow marks its own errors so: Job.Commit and Job.CommitTx return PostgreSQL
// unreachable (a refused or lost connection, a server shutting down) as Unavailable,
// and a failing statement as a plain error; Job.Complete and Job.Stream return an
// exhausted provider quota and PostgreSQL unreachable under the ledger as Unavailable,
// and a call the model's limiter put off as a wait (ErrWaiting).
// The outbox relay reads the same markers on a Sender's error: Permanent
// (retry.Permanent) exhausts the row at once, Unavailable (outbox.Unavailable) retries
// it without counting an attempt, never exhausting it, and any other error counts an
// attempt; the sender of EnqueueTx's rows returns Redis unreachable as Unavailable.
var (
	// ErrPermanent is matched by every error marked with Permanent (Permanent and
	// retry.Permanent are the same marker).
	ErrPermanent = retry.ErrPermanent
	// ErrUnavailable is matched by errors that say a dependency is down rather than
	// that the job failed: Unavailable's, and an open circuit breaker's.
	ErrUnavailable = retry.ErrUnavailable
	// ErrWaiting is matched by the error of a model step the model's limiter put off (a
	// rate limit, a pause after a 429, the tenant's fair share or daily token budget):
	// return it as it is, and the job waits in its queue without spending an attempt
	// (a *retry.WaitError says how long and why; JobState.Waiting shows the reason).
	ErrWaiting = retry.ErrWaiting
	// ErrUnknownKind is matched by the error of a job whose kind has no Worker in the
	// process that took it (retried, as another process may know the kind, then
	// dead-lettered after MaxDeliveries with it in the reason), and by Enqueue's for
	// arguments whose Kind is not valid.
	ErrUnknownKind = errors.New("onceflow: unknown job kind")
	// ErrUndecodable is matched by the error of a job whose arguments do not decode into
	// its kind's type, which is dead-lettered with it.
	ErrUndecodable = errors.New("onceflow: undecodable job arguments")
	// ErrJobIDTaken is matched by Enqueue's error for a job id (EnqueueOpts.JobID) that
	// belongs to another tenant: nothing is enqueued. A Commit of a job whose id was
	// completed by a job of another tenant or kind fails permanently with it too (the
	// job is dead-lettered with the reason, never silently taken as done).
	ErrJobIDTaken = queue.ErrJobIDTaken

	// ErrClientRunning is returned by a second concurrent call of Client.Run.
	ErrClientRunning = errors.New("onceflow: client already running")

	// ErrJobNotFound is returned by JobState for an id no job has, or has for another
	// tenant: a tenant cannot learn that another's job exists.
	ErrJobNotFound = errors.New("onceflow: no such job")

	// ErrRedisOptions is matched by CheckRedis's errors.
	ErrRedisOptions = errors.New("onceflow: unsafe Redis client options")

	// ErrSomeRedisNodesDown is matched by PingRedis's error when some primaries of a Redis
	// Cluster answered and some did not: the partitions whose slots the silent ones hold
	// cannot be used until they come back or their replicas take over, the others can.
	ErrSomeRedisNodesDown = errors.New("some primaries of the Redis Cluster do not answer")

	// ErrUnknownQueue is returned by RunWorkers for a queue the client's Config does not
	// list (Config.Queues and the workflows' queues).
	ErrUnknownQueue = errors.New("onceflow: unknown queue")

	// ErrNoModel is matched by the permanent error of Job.Complete and Job.Stream on a
	// Client without Config.Model (or on a Job that no Client delivered).
	ErrNoModel = errors.New("onceflow: no model (Config.Model is not set)")

	// ErrAgentTurnLimit matches the error of an agent whose model still called tools at
	// its last turn (AgentConfig.MaxTurns).
	ErrAgentTurnLimit = errors.New("onceflow: the agent reached its turn limit")

	// ErrGateRejected matches the error of a job whose held answer an operator rejected (or
	// whose hold timed out): permanent, the job is dead-lettered with the gate's reason.
	ErrGateRejected = errors.New("onceflow: the answer failed its eval gate and was rejected")

	// ErrNotInDoubt matches the error of ResolveInDoubt for a call that is not in doubt (no
	// intent without a result under that key: resolved already, or never started).
	ErrNotInDoubt = errors.New("onceflow: the tool call is not in doubt")

	// ErrInDoubt matches the error of a job whose tool call, run at most once
	// (Job.ToolAtMostOnce), was started by an earlier delivery that never recorded how it
	// ended: onceflow cannot tell whether the effect happened, so it does not call again.
	// The job is dead-lettered in doubt (JobState says StatusInDoubt) until an operator
	// resolves the call (Inspector.ResolveInDoubt).
	ErrInDoubt = errors.New("onceflow: in doubt")

	// ErrWaitTimedOut matches the error of WaitSignal when the signal did not come within its
	// timeout.
	ErrWaitTimedOut = errors.New("onceflow: the wait timed out")

	// ErrAlreadySignalled matches the error of Client.Signal for a signal the job already
	// has (and of Approve and Reject for a call already decided): the first one stands.
	ErrAlreadySignalled = errors.New("onceflow: the job already has this signal")

	// ErrNotWaiting matches the error of Client.Approve and Client.Reject for a tool call
	// that no job waits for a decision on (another tenant's, resolved, or never asked).
	ErrNotWaiting = errors.New("onceflow: no job waits for this decision")

	// ErrBatchNotFound is Client.CancelBatch's error for an id that names no batch of
	// the lane (neither a submission id nor a provider's batch id).
	ErrBatchNotFound = errors.New("onceflow: no such batch")

	// ErrBatchNotCancellable is Client.CancelBatch's error for a batch that has ended,
	// or whose submission to the provider is not recorded yet (try again in a moment).
	ErrBatchNotCancellable = errors.New("onceflow: the batch cannot be cancelled")
)

// Permanent marks err as a failure no retry can fix: a Worker that returns it has its job
// dead-lettered at once with err as the reason; retry.Do and the outbox relay stop too.
// The result matches ErrPermanent and unwraps to err. Permanent(nil) is nil.
func Permanent(err error) error { return retry.Permanent(err) }

// IsPermanent reports whether err was marked permanent (errors.Is(err, ErrPermanent)).
func IsPermanent(err error) bool { return retry.IsPermanent(err) }

// RetryAfter returns err with a request to run the job again after d instead of after
// the queue's backoff; the run counts as a failed attempt. A provider error carrying a
// Retry-After (a 429, a 503) is treated so without it. A nil err becomes "retry requested". The result is
// a *retry.DelayError.
func RetryAfter(d time.Duration, err error) error { return retry.RetryAfter(d, err) }

// Unavailable marks err as a dependency's outage rather than the job's failure: the job
// is handed back with its delivery count as it was, so the outage spends none of its
// budget. The result matches ErrUnavailable and unwraps to err. Unavailable(nil) is nil.
func Unavailable(err error) error { return retry.Unavailable(err) }

// Snooze returns the request to run the job again after d (0: at once) without spending
// an attempt: the job is not failing, it waits for something (a time, a resource, a
// limit). It waits in its queue's scheduled set, holding no worker. A job that snoozes
// for ever never fails: bound it yourself (JobInfo.EnqueuedAt tells its age). The
// result is a *queue.SnoozeError.
func Snooze(d time.Duration) error { return queue.Snooze(d) }
