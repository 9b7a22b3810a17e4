package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/strictjson"
	"github.com/onceflow/onceflow/queue"
)

// JobNamespace is the UUIDv5 namespace of derived job ids: a job id derived from an
// idempotency key is uuid.NewSHA1(JobNamespace, scope.Encode()) where scope is the
// key's idempotency.Scope (see JobID). It is the UUIDv5 of the URL
// "https://github.com/onceflow/onceflow/jobs" in the URL namespace, and never changes:
// a retried request must map to the job id its first attempt got.
var JobNamespace = uuid.MustParse("82d05cc3-eef7-5704-933f-413aa8eeee8c")

// JobID returns the job id derived from an idempotency scope: its UUIDv5 under
// JobNamespace, in canonical lower-case form.
func JobID(scope idempotency.Scope) string {
	return uuid.NewSHA1(JobNamespace, scope.Encode()).String()
}

// EnqueueScope returns the idempotency scope of a job enqueued from Go with a key on
// DefaultQueue: the tenant, the method "ENQUEUE", the kind as the path and the key.
// Route uses the HTTP request's method and path instead. EnqueueScopeOn is the scope on
// any queue.
func EnqueueScope(tenant, kind, key string) idempotency.Scope {
	return EnqueueScopeOn(DefaultQueue, tenant, kind, key)
}

// EnqueueScopeOn returns the idempotency scope of a job enqueued from Go with a key on
// queue: EnqueueScope's on DefaultQueue, else with the path kind + "@" + queue. A key is
// scoped by its queue because its record is kept with the queue (in the queue's hash
// slot, so that the accept is one atomic script on Redis Cluster too): the same key on
// another queue is another key, and another job id.
func EnqueueScopeOn(queue, tenant, kind, key string) idempotency.Scope {
	path := kind
	if queue != DefaultQueue {
		path = kind + "@" + queue
	}
	return idempotency.Scope{Tenant: tenant, Method: "ENQUEUE", Path: path, Key: key}
}

// MaxKeyLen is the longest idempotency key Enqueue takes, in bytes.
const MaxKeyLen = 255

// EnqueueOpts are the options of one enqueue; the zero value is valid.
type EnqueueOpts struct {
	// Queue is the queue the job goes to. Default: the arguments' own (JobArgsWithOpts),
	// else DefaultQueue.
	Queue string
	// Tenant owns the job: JobState answers only to it, and keys are scoped by it.
	// Up to 64 characters of A-Z a-z 0-9 . _ -. Default: none.
	Tenant string
	// Key is the idempotency key: 1 to MaxKeyLen printable ASCII characters. With a key,
	// enqueueing is idempotent for Config.ResultTTL: a second Enqueue with the same
	// tenant, kind, queue and key adds nothing and returns the first job's id
	// (Replayed), and one with other arguments fails with idempotency.ErrKeyReused. The
	// job id is derived from the key (JobID of EnqueueScopeOn), so even a second enqueue
	// after the key expired carries the same id and the job's Commit runs once. The same
	// key on another queue is another key (see EnqueueScopeOn). Default: none (a
	// random job id, and every Enqueue adds a job).
	Key string
	// JobID sets the job id outright: 1 to 200 printable ASCII characters without
	// spaces, not shaped like a stream entry id. With a Key too, JobID wins but the key
	// still deduplicates. A job id is one job: enqueueing it again for the same tenant
	// adds a delivery of that job (its Commit still runs once), and for another tenant
	// on the same queue fails with ErrJobIDTaken while its index lives (Config.ResultTTL
	// after it is done; the index lives with the queue, in the job's partition). On
	// another queue, later, or after the queue's partitions changed (the id may then
	// belong to another partition, docs/queue.md "Partitions"), the enqueue is accepted, but the job whose Commit comes second finds the other's
	// completion and fails permanently with ErrJobIDTaken (dead-lettered, nothing
	// written): the first to commit wins. So choose ids unique across tenants, queues and
	// kinds (prefix them with all three), or give a Key instead: a derived id includes
	// the tenant, the kind and the queue.
	// Default: derived from Key (with the tenant and kind), else a random UUID.
	JobID string
	// RunAt delays the job: it waits in the queue's scheduled set, and its JobState is
	// queued with RunAt, until that time, when a worker's mover adds it to the queue
	// (within WorkerConfig.ScheduleInterval, 1s by default). It is read on this
	// process's clock; workers compare it with Redis'. A keyed enqueue deduplicates as
	// without it (a second one replays the first's answer, whatever its RunAt).
	// Default: zero, at once (as is a time already past).
	RunAt time.Time
}

// EnqueueResult says what an Enqueue did.
type EnqueueResult struct {
	// JobID is the job's id.
	JobID string
	// Queue is the queue it went to.
	Queue string
	// Replayed reports that the key had been used already: nothing was added, and JobID
	// is the first enqueue's.
	Replayed bool
}

// Enqueue adds a job with args to its queue, in one Redis round trip. With opts.Key the
// enqueue is idempotent (see EnqueueOpts.Key). Errors: arguments whose Kind is not valid
// (ErrUnknownKind) or that do not encode to a JSON object, invalid options, a reused key
// (idempotency.ErrKeyReused), or Redis's (after a network error the job may have been
// added; enqueueing again with the same key is safe). It does not check that a Worker of
// the kind exists: another process may run it.
func (c *Client) Enqueue(ctx context.Context, args JobArgs, opts *EnqueueOpts) (*EnqueueResult, error) {
	m, o, err := c.message(ctx, args, opts)
	if err != nil {
		return nil, err
	}
	if err := answersBeforeLeaving(ctx); err != nil {
		return nil, err
	}
	keys, err := c.enqueueKeys(ctx, o.Queue, m.JobID)
	if err != nil {
		return nil, fmt.Errorf("onceflow: enqueue %s job: %w", m.Kind, err)
	}
	if o.Key == "" {
		if err := c.enqueue(ctx, keys, m, o.RunAt); err != nil {
			return nil, fmt.Errorf("onceflow: enqueue %s job: %w", m.Kind, err)
		}
		return &EnqueueResult{JobID: m.JobID, Queue: o.Queue}, nil
	}
	return c.acceptKeyed(ctx, EnqueueScopeOn(o.Queue, o.Tenant, m.Kind, o.Key), m, keys, o.RunAt)
}

// message validates args and opts and returns the job's message and the effective
// options.
func (c *Client) message(ctx context.Context, args JobArgs, opts *EnqueueOpts) (queue.Message, EnqueueOpts, error) {
	var o EnqueueOpts
	if opts != nil {
		o = *opts
	}
	return c.messageFor(ctx, args, o, false)
}

// messageFor is message with the options as they are; with fixedTenant, o.Tenant is the
// job's tenant even when empty (a route's request's: the arguments' default tenant
// must not replace it).
func (c *Client) messageFor(ctx context.Context, args JobArgs, o EnqueueOpts, fixedTenant bool) (queue.Message, EnqueueOpts, error) {
	if args == nil {
		return queue.Message{}, o, fmt.Errorf("%w: nil arguments", ErrUnknownKind)
	}
	kind := args.Kind()
	if !queue.ValidKind(kind) {
		return queue.Message{}, o, fmt.Errorf("%w: kind %q of %T is not 1-%d characters of a-z 0-9 . _ - : starting with a letter or digit",
			ErrUnknownKind, kind, args, queue.MaxKindLen)
	}
	var def EnqueueOpts
	if d, ok := args.(JobArgsWithOpts); ok {
		def = d.EnqueueOpts()
	}
	o.Queue = cmp.Or(o.Queue, def.Queue, DefaultQueue)
	if !fixedTenant {
		o.Tenant = cmp.Or(o.Tenant, def.Tenant)
	}
	if err := c.keys(o.Queue).Validate(); err != nil {
		return queue.Message{}, o, fmt.Errorf("onceflow: enqueue %s: %w", kind, err)
	}
	if o.Key != "" && !validKey(o.Key) {
		return queue.Message{}, o, fmt.Errorf("onceflow: enqueue %s: key is not 1-%d printable ASCII characters", kind, MaxKeyLen)
	}
	// Encoded as the worker decodes (strictjson): arguments that would not decode back
	// fail here, at the enqueue, not as a dead letter.
	payload, err := strictjson.Encode(args)
	if err != nil {
		return queue.Message{}, o, fmt.Errorf("onceflow: encode %s arguments: %w", kind, err)
	}
	id := o.JobID
	switch {
	case id != "":
	case o.Key != "":
		id = JobID(EnqueueScopeOn(o.Queue, o.Tenant, kind, o.Key))
	default:
		id = uuid.NewString()
	}
	m := queue.Message{JobID: id, Kind: kind, Tenant: o.Tenant, Payload: payload, EnqueuedAt: time.Now(), TraceParent: c.cfg.TraceParent(ctx)}
	if err := m.Validate(); err != nil {
		return queue.Message{}, o, fmt.Errorf("onceflow: enqueue %s: %w", kind, err)
	}
	return m, o, nil
}

// validKey reports whether key is 1 to MaxKeyLen printable ASCII characters.
func validKey(key string) bool {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return false
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			return false
		}
	}
	return true
}

// enqueueAnswer is the stored answer of a keyed Enqueue.
type enqueueAnswer struct {
	JobID string `json:"job_id"`
	Queue string `json:"queue"`
}

// acceptKeyed enqueues m under scope in one round trip through the idempotency store's
// accept script, or returns the first enqueue's answer.
func (c *Client) acceptKeyed(ctx context.Context, scope idempotency.Scope, m queue.Message, keys queue.Keys, runAt time.Time) (*EnqueueResult, error) {
	body, _ := json.Marshal(enqueueAnswer{JobID: m.JobID, Queue: keys.Queue})
	resp := &idempotency.Response{Status: http.StatusAccepted, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
	stored, replayed, err := c.accept(ctx, scope, idempotency.Fingerprint(m.Payload), resp, m, keys, runAt)
	if err != nil {
		return nil, fmt.Errorf("onceflow: enqueue %s: %w", m.Kind, err)
	}
	var a enqueueAnswer
	if err := json.Unmarshal(stored.Body, &a); err != nil || a.JobID == "" {
		return nil, fmt.Errorf("onceflow: enqueue %s: the key's stored answer is not an enqueue's (used by a route?)", m.Kind)
	}
	return &EnqueueResult{JobID: a.JobID, Queue: cmp.Or(a.Queue, keys.Queue), Replayed: replayed}, nil
}
