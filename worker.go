package onceflow

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/onceflow/onceflow/internal/strictjson"
	"github.com/onceflow/onceflow/queue"
)

// Worker runs the jobs of one kind, the kind of T. Work is called from many goroutines at
// once, and again for a job it already ran (a delivery is at least once), so it must be
// safe for concurrent use and idempotent per job.ID: Job.Commit makes the job's writes
// and effects happen once whatever the number of runs.
//
// Its result decides the job's fate; see the error vocabulary at ErrPermanent.
type Worker[T JobArgs] interface {
	Work(ctx context.Context, job *Job[T]) error
}

// WorkFunc adapts a function to the Worker interface.
type WorkFunc[T JobArgs] func(ctx context.Context, job *Job[T]) error

// Work calls f(ctx, job).
func (f WorkFunc[T]) Work(ctx context.Context, job *Job[T]) error { return f(ctx, job) }

// Middleware wraps the run of every job, whatever its kind, as net/http middleware wraps
// handlers: for logging, metrics, tracing or recovering. next runs the job (decoding its
// arguments and calling its Worker); a middleware may inspect info and the error.
type Middleware func(next JobFunc) JobFunc

// JobFunc runs one job; see Middleware.
type JobFunc func(ctx context.Context, info *JobInfo) error

// JobInfo describes a job to a Middleware, before its arguments are decoded.
type JobInfo struct {
	// ID, Kind, Queue and Tenant are the job's.
	ID, Kind, Queue, Tenant string
	// Delivery is the attempt number (Job.Delivery).
	Delivery int
	// EntryID is the stream entry id of this delivery ("1700000000000-0"): a job
	// enqueued twice under one job id is two entries with two EntryIDs. It names the
	// entry in the dead-letter stream and in `onceflow dlq`.
	EntryID string
	// Args are the job's arguments as they were enqueued (JSON).
	Args []byte
	// TraceParent is the W3C traceparent the job was enqueued with, or "".
	TraceParent string

	msg queue.Message
	rt  *runtime
}

// Workers is the registry of the Worker of each kind: create it with NewWorkers, add
// workers with AddWorker, and give it to Config.Workers. It is safe for concurrent use,
// but adding workers after NewClient has no effect on that Client.
type Workers struct {
	mu     sync.RWMutex
	byKind map[string]*kindWorker
}

// kindWorker runs the jobs of one kind.
type kindWorker struct {
	kind  string
	queue string // the queue its jobs go to by default ("" for DefaultQueue)
	run   func(ctx context.Context, rt *runtime, m queue.Message, delivery int) error
}

// NewWorkers returns an empty registry.
func NewWorkers() *Workers { return &Workers{byKind: map[string]*kindWorker{}} }

// AddWorker registers w for the kind of T. It panics when the kind is not valid or
// already has a worker, mistakes a program makes at start; AddWorkerSafely returns them
// as errors.
func AddWorker[T JobArgs](ws *Workers, w Worker[T]) {
	if err := AddWorkerSafely(ws, w); err != nil {
		panic(err)
	}
}

// AddWorkerSafely is AddWorker returning an error instead of panicking.
func AddWorkerSafely[T JobArgs](ws *Workers, w Worker[T]) error {
	if w == nil {
		return errors.New("onceflow: AddWorker: nil worker")
	}
	var zero T
	kind := zero.Kind()
	if !queue.ValidKind(kind) {
		return fmt.Errorf("%w: AddWorker: kind %q of %T is not 1-%d characters of a-z 0-9 . _ - : starting with a letter or digit",
			ErrUnknownKind, kind, zero, queue.MaxKindLen)
	}
	var q string
	if o, ok := any(zero).(JobArgsWithOpts); ok {
		q = o.EnqueueOpts().Queue
	}
	kw := &kindWorker{kind: kind, queue: q, run: func(ctx context.Context, rt *runtime, m queue.Message, delivery int) error {
		job := &Job[T]{ID: m.JobID, Kind: kind, Queue: rt.queue, Tenant: m.Tenant, Delivery: delivery, EnqueuedAt: m.EnqueuedAt, run: rt}
		if err := strictjson.Decode(m.Payload, &job.Args); err != nil {
			return Permanent(undecodable(kind, err))
		}
		return w.Work(ctx, job)
	}}
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.byKind == nil {
		ws.byKind = map[string]*kindWorker{}
	}
	if _, dup := ws.byKind[kind]; dup {
		return fmt.Errorf("onceflow: AddWorker: kind %q already has a worker", kind)
	}
	ws.byKind[kind] = kw
	return nil
}

// undecodable is the error of a job whose arguments did not decode: it names the kind
// and, when the decoder said, the field.
func undecodable(kind string, err error) error {
	detail := err.Error()
	var se *strictjson.Error
	if errors.As(err, &se) {
		detail = se.Msg
		if se.Field != "" {
			detail = se.Field + ": " + se.Msg
		}
	}
	return fmt.Errorf("%w for kind %q: %s", ErrUndecodable, kind, detail)
}

// Kinds returns the registered kinds, sorted.
func (ws *Workers) Kinds() []string {
	ws.mu.RLock()
	defer ws.mu.RUnlock()
	out := make([]string, 0, len(ws.byKind))
	for k := range ws.byKind {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// snapshot returns a copy of the registry, which a Client keeps.
func (ws *Workers) snapshot() map[string]*kindWorker {
	out := map[string]*kindWorker{}
	if ws == nil {
		return out
	}
	ws.mu.RLock()
	defer ws.mu.RUnlock()
	for k, v := range ws.byKind {
		out[k] = v
	}
	return out
}
