package onceflow

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// JobArgs is implemented by the typed arguments of a job kind. Kind names the kind: 1 to
// 64 characters of a-z 0-9 . _ - and :, starting with a letter or a digit
// ("triage.ticket"); it routes a job to its Worker and must be the same on every call,
// including on the zero value (give it a value receiver). The arguments travel as JSON
// with encoding/json/v2's semantics at both ends (`json:` tags apply; a type it cannot
// represent, such as a time.Duration without a format option, is refused by Enqueue),
// and are decoded strictly when the job runs: field names are case-sensitive, unknown
// and repeated names are refused, and a job whose arguments do not decode (a producer
// of its own wrote them) is dead-lettered with the reason.
type JobArgs interface {
	Kind() string
}

// JobArgsWithOpts is implemented by arguments that carry their own enqueue defaults, such
// as the queue their kind runs on. Options passed to Enqueue win over them.
type JobArgsWithOpts interface {
	JobArgs
	EnqueueOpts() EnqueueOpts
}

// Job is one delivery of a job to its Worker: the typed arguments and what onceflow
// knows about the job. A Job is valid only during the Work call it was passed to, and
// its methods (Complete, Stream, Commit, ...) may be called from that call's goroutine
// and from goroutines it waits for.
type Job[T JobArgs] struct {
	// ID is the job id: derived from the idempotency key when one was given (see
	// EnqueueOpts), so every delivery and every duplicate enqueue of one job carries the
	// same ID. It is the deduplication key of everything the job does.
	ID string
	// Kind is the job's kind, Args.Kind() (or the queue's default kind for a message
	// enqueued before kinds existed).
	Kind string
	// Queue is the queue the job runs on.
	Queue string
	// Tenant owns the job; empty when none does.
	Tenant string
	// Args are the job's decoded arguments.
	Args T
	// Delivery is the attempt number: 1 for the first run, then 1 + the attempts the
	// job spent (runs that failed, deliveries whose process died). Hand-backs (a
	// dependency down, a shutdown) and snoozes do not count, so two runs may see the
	// same number. The queue's MaxDeliveries bounds it.
	Delivery int
	// EnqueuedAt is when the job was enqueued.
	EnqueuedAt time.Time

	run *runtime // this delivery's machinery: model, ledger, database, deadline
}

// Client returns the Client that delivered the job (nil for a Job it did not deliver),
// for a Worker's reads of its own tables (Inspector.DB).
func (j *Job[T]) Client() *Client {
	if j.run == nil {
		return nil
	}
	return j.run.client
}

// Committed reports whether a Commit or CommitTx of this delivery wrote the job's
// completion record: false before one returned, and after one that found the job
// already done by another delivery (which returns nil too). For a Worker's metrics of
// done against duplicate deliveries.
func (j *Job[T]) Committed() bool { return j.run != nil && j.run.committed.Load() }

// runtime is what one delivery carries for the Job helpers.
type runtime struct {
	client    *Client
	queue     string
	delivery  *queue.Job
	deadline  retry.Deadline // the delivery's budget (Config.JobBudget), from its start
	committed atomic.Bool    // a Commit of this delivery wrote the completion record
	recorded  jobSteps       // the job's recorded steps, as this delivery knows them (Do, Tool)
	// writeMu serializes the delivery's writes of finished records (a step's result, a
	// tool's, a wait), so that their created_at follows the order they became visible
	// in: the order the job's events stream them in (EventsHandler), which a record
	// committed late behind a later one would break.
	writeMu sync.Mutex
	// answers are the model steps' answers this delivery recorded without waiting for
	// the WAL flush (Config.DurableAnswers off): the job's Commit flushes them, or
	// the end of the delivery does (flushAnswers).
	answers ledger.Deferred
	// held are the model steps' answers not recorded yet (Config.DurableAnswers off):
	// the job's Commit records them in its own transaction when it follows the step;
	// anything else the delivery does first records them (releaseHeld).
	held ledger.Held
	// modelCalls counts the delivery's model steps in progress: a step that ends
	// beside another records its answer instead of holding it, since the other may be
	// a concurrent call of the same step, waiting for it.
	modelCalls atomic.Int32
}

// runtimeKey is the context key of the runtime of the delivery a Worker runs in.
type runtimeKey struct{}

// withRuntime returns ctx carrying rt, the runtime of the delivery it runs.
func withRuntime(ctx context.Context, rt *runtime) context.Context {
	return context.WithValue(ctx, runtimeKey{}, rt)
}

// runtimeFrom returns the runtime of the delivery ctx runs in, or nil.
func runtimeFrom(ctx context.Context) *runtime {
	rt, _ := ctx.Value(runtimeKey{}).(*runtime)
	return rt
}

// answersBeforeLeaving makes the model answers of the delivery ctx runs in (when it
// runs in one: Enqueue, EnqueueTx, Signal from a Worker) recorded and durable before
// what may carry one leaves the delivery: a job in Redis, another transaction, a
// signal. Its error is the ledger's (PostgresError, or an answer superseded).
func answersBeforeLeaving(ctx context.Context) error {
	if rt := runtimeFrom(ctx); rt != nil {
		return rt.flushBeforeEffect(ctx)
	}
	return nil
}
