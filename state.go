package onceflow

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/queue"
)

// Status is where a job is.
type Status string

// The statuses JobState reports.
const (
	// StatusQueued: accepted, waiting for a worker (or handed back to wait again).
	StatusQueued Status = "queued"
	// StatusRunning: a worker holds it now.
	StatusRunning Status = "running"
	// StatusDone: its Commit won, and Result holds what it stored; or it finished
	// without a Commit (its Worker returned nil, or the Client has no Config.DB) and was
	// acknowledged: then Result and CompletedAt are empty.
	StatusDone Status = "done"
	// StatusFailed: dead-lettered; Error says why.
	StatusFailed Status = "failed"
	// StatusInDoubt: dead-lettered because a tool call it runs at most once
	// (Job.ToolAtMostOnce) was started and its outcome never recorded; InDoubt names the
	// calls, and an operator resolves each (Inspector.ResolveInDoubt).
	StatusInDoubt Status = "in_doubt"
)

// JobState is what JobState knows about a job.
type JobState struct {
	// ID, Kind, Queue and Tenant are the job's (Kind and Queue when known).
	ID     string `json:"job_id"`
	Kind   string `json:"kind,omitempty"`
	Queue  string `json:"queue,omitempty"`
	Tenant string `json:"-"`
	// Status is where the job is.
	Status Status `json:"status"`
	// Result is what the job's Commit stored with Commit.Result (StatusDone), or nil.
	Result json.RawMessage `json:"result,omitempty"`
	// Error is the dead-letter reason (StatusFailed).
	Error string `json:"error,omitempty"`
	// CompletedAt is when the job's Commit committed (StatusDone).
	CompletedAt time.Time `json:"completed_at,omitzero"`
	// RunAt is when a queued job waiting in the scheduled set runs: its next attempt
	// after a failure, after a snooze or hand-back, or EnqueueOpts.RunAt.
	RunAt time.Time `json:"run_at,omitzero"`
	// Waiting says what a queued job waiting in the scheduled set waits for: the
	// model's limiter put it off (a rate limit, its tenant's fair share or daily token
	// budget), or it waits for a signal ("signal <name>", WaitSignal) or an operator's
	// decision ("signal approval:<key>", Job.Approval); "" otherwise.
	Waiting string `json:"waiting,omitempty"`
	// InDoubt are the tool calls of a job in doubt (StatusInDoubt).
	InDoubt []InDoubtCall `json:"in_doubt,omitempty"`
}

// InDoubtCall is a tool call whose outcome nobody recorded (Job.ToolAtMostOnce).
type InDoubtCall struct {
	// Tool and Arguments are the call's; Key is its key (ToolCall.Key).
	Tool      string `json:"tool"`
	Arguments string `json:"arguments"`
	Key       string `json:"key"`
	// StartedAt is when its intent was recorded.
	StartedAt time.Time `json:"started_at"`
}

// JobState returns the state of job id for tenant: done (its completion record, read from
// PostgreSQL), else failed or in doubt (a failed job with tool calls in doubt, read from
// PostgreSQL), running, done without a Commit or queued (its job index and
// its stream entry, read from Redis, in each queue the client works, enqueued to or
// routes to). An unknown id,
// another tenant's job, or a job whose index expired after it finished gives
// ErrJobNotFound; a store that does not answer gives its error (answer 503). It costs
// one PostgreSQL round trip and, for a job not done, two Redis round trips per queue
// (one for a failed job), plus a second PostgreSQL read for a job that finished between
// the two.
func (c *Client) JobState(ctx context.Context, tenant, id string) (*JobState, error) {
	if !queue.ValidJobID(id) {
		return nil, ErrJobNotFound
	}
	if c.cfg.DB != nil {
		st, err := c.completed(ctx, tenant, id)
		if err == nil || !errors.Is(err, ErrJobNotFound) {
			return st, err
		}
	}
	for _, name := range c.stateQueues() {
		st, err := c.indexed(ctx, name, tenant, id)
		if err == nil && st.Status == StatusFailed && c.steps != nil {
			return c.inDoubt(ctx, st)
		}
		if err == nil || !errors.Is(err, ErrJobNotFound) {
			return st, err
		}
	}
	return nil, ErrJobNotFound
}

// completed reads the completion record of id, if it is tenant's.
func (c *Client) completed(ctx context.Context, tenant, id string) (*JobState, error) {
	st, err := c.completion(ctx, id)
	if err != nil {
		return nil, err
	}
	if st.Tenant != tenant {
		return nil, ErrJobNotFound
	}
	return st, nil
}

// completion reads the completion record of id.
func (c *Client) completion(ctx context.Context, id string) (*JobState, error) {
	st := &JobState{ID: id, Status: StatusDone}
	var result []byte
	err := c.cfg.DB.QueryRow(ctx, `SELECT kind, queue, tenant, result, completed_at FROM job_completions WHERE job_id = $1`, id).
		Scan(&st.Kind, &st.Queue, &st.Tenant, &result, &st.CompletedAt)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, ErrJobNotFound
	case err != nil:
		return nil, fmt.Errorf("onceflow: read job %s: %w", id, err)
	}
	st.Result = result
	return st, nil
}

// indexed reads the job index of id in queue name.
//
// The index and the entry's state are two reads, and a delivery settled between them
// (a retry or a limiter's wait scheduled, a dead letter) acknowledges the entry the
// index still names: an acknowledged entry is therefore only "done" when a second read
// of the index finds it unchanged (the scripts that settle a delivery update the index
// in the step that acknowledges it); otherwise the state is read again from the newer
// index.
func (c *Client) indexed(ctx context.Context, name, tenant, id string) (*JobState, error) {
	keys, ix, err := c.findIndex(ctx, name, tenant, id)
	if err != nil {
		return nil, err
	}
	for range 3 {
		st, entry, err := c.fromIndex(ctx, keys, name, id, ix)
		if err != nil || entry != queue.EntryAcknowledged {
			return st, err
		}
		// Finished, unless the index moved on. Its Commit may have landed after
		// JobState looked in PostgreSQL: look again. Without a completion record (a
		// Worker that returned nil without Commit, or a client without Config.DB) it
		// is done, with no Result.
		again, err := c.readIndex(ctx, keys, tenant, id)
		if err != nil {
			return nil, err
		}
		if again.State == ix.State && again.Entry == ix.Entry {
			if c.cfg.DB != nil {
				if done, err := c.completed(ctx, tenant, id); err == nil || !errors.Is(err, ErrJobNotFound) {
					return done, err
				}
			}
			st.Status = StatusDone
			return st, nil
		}
		ix = again
	}
	// An index that moves on at every look: a job retried in a tight loop.
	return &JobState{ID: id, Queue: name, Tenant: ix.Tenant, Status: StatusQueued}, nil
}

// findIndex finds the job index of id in queue name: in the partition it is enqueued
// to, else (enqueued before the queue's partitions changed) in the others that may hold
// jobs. ErrJobNotFound when no partition has it, or it is another tenant's.
func (c *Client) findIndex(ctx context.Context, name, tenant, id string) (queue.Keys, queue.JobIndex, error) {
	keys := c.jobKeys(name, id)
	ix, err := c.readIndex(ctx, keys, tenant, id)
	if !errors.Is(err, ErrJobNotFound) {
		return keys, ix, err
	}
	n, kerr := c.knownPartitions(ctx, name)
	if kerr != nil {
		return keys, ix, kerr
	}
	for p := range n {
		if p == keys.Partition {
			continue
		}
		other := keys.InPartition(p)
		if ix, err := c.readIndex(ctx, other, tenant, id); !errors.Is(err, ErrJobNotFound) {
			return other, ix, err
		}
	}
	return keys, ix, err
}

// knownPartitions returns queue.KnownPartitions of queue name, read at most once per
// knownPartitionsFor: a lowered count is rare, and a JobState of an unknown id must not
// pay a round trip for it each time.
func (c *Client) knownPartitions(ctx context.Context, name string) (int, error) {
	type known struct {
		n  int
		at time.Time
	}
	if v, ok := c.known.Load(name); ok && time.Since(v.(known).at) < knownPartitionsFor {
		return v.(known).n, nil
	}
	n, err := queue.KnownPartitions(ctx, c.rdb, c.keys(name), c.partitions(name))
	if err != nil {
		return 0, fmt.Errorf("onceflow: queue %q: %w", name, err)
	}
	c.known.Store(name, known{n, time.Now()})
	return n, nil
}

// knownPartitionsFor is how long knownPartitions keeps its answer.
const knownPartitionsFor = 30 * time.Second

// readIndex reads the job index of id, ErrJobNotFound when it is missing or another
// tenant's.
func (c *Client) readIndex(ctx context.Context, keys queue.Keys, tenant, id string) (queue.JobIndex, error) {
	ix, err := queue.ReadJobIndex(ctx, c.rdb, keys, id)
	switch {
	case errors.Is(err, queue.ErrUnknownJob) || err == nil && ix.Tenant != tenant:
		return queue.JobIndex{}, ErrJobNotFound
	case err != nil:
		return queue.JobIndex{}, fmt.Errorf("onceflow: read job %s: %w", id, err)
	}
	return ix, nil
}

// fromIndex is the state index ix gives, with its entry's state when that was read.
func (c *Client) fromIndex(ctx context.Context, keys queue.Keys, name, id string, ix queue.JobIndex) (*JobState, queue.EntryStatus, error) {
	st := &JobState{ID: id, Queue: name, Tenant: ix.Tenant, Status: StatusQueued}
	switch ix.State {
	case queue.StateFailed:
		st.Status, st.Error = StatusFailed, ix.Reason
		return st, queue.EntryWaiting, nil
	case queue.StateScheduled:
		st.RunAt, st.Waiting = ix.RunAt, ix.Waiting
		if strings.HasPrefix(ix.Waiting, "signal "+gatePrefix) {
			st.Status = StatusHeld
		}
		return st, queue.EntryWaiting, nil
	}
	if ix.Entry == "" {
		return st, queue.EntryWaiting, nil
	}
	entry, err := queue.EntryState(ctx, c.rdb, keys, queue.DefaultGroup, ix.Entry)
	if err != nil {
		return nil, entry, fmt.Errorf("onceflow: read job %s: %w", id, err)
	}
	if entry == queue.EntryDelivered {
		st.Status = StatusRunning
	}
	return st, entry, nil
}

// DefaultStateTimeout bounds StateHandler's reads of one request: a store that does not
// answer in time (a hung PostgreSQL, a Redis that stopped reading) gets 503 with
// Retry-After, not a request that hangs.
const DefaultStateTimeout = 2 * time.Second

// StateHandler returns an http.Handler for GET .../{job_id}: the state of the job
// r.PathValue("job_id") for the tenant tenant returns, as JSON (JobState's fields: job_id,
// kind, queue, status, and result, error or completed_at when known): 200, or 404 for
// an unknown id or another tenant's job, 401 when tenant returns an error matching
// idempotency.ErrUnauthenticated (500, or 503 with Retry-After for one matching
// ErrUnavailable, when it fails otherwise: see idempotency.ErrTenantLookup), 503 with
// Retry-After when a store does not answer within DefaultStateTimeout. Mount it with a {job_id} wildcard:
// mux.Handle("GET /v1/tickets/{job_id}", onceflow.StateHandler(c, tenant)).
func StateHandler(c *Client, tenant func(*http.Request) (string, error)) http.Handler {
	tenant = usableTenant(tenant)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t, ok := requestTenant(c, tenant, w, r)
		if !ok {
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), DefaultStateTimeout)
		defer cancel()
		st, err := c.JobState(ctx, t, r.PathValue("job_id"))
		switch {
		case errors.Is(err, ErrJobNotFound):
			writeDetail(w, http.StatusNotFound, "no such job")
		case err != nil:
			c.log.WarnContext(r.Context(), "onceflow: job state unavailable", "err", err)
			w.Header().Set("Retry-After", "1")
			writeDetail(w, http.StatusServiceUnavailable, "job state unavailable; retry later")
		default:
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(st)
		}
	})
}
