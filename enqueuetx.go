package onceflow

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// TopicEnqueue is the outbox topic of the jobs EnqueueTx writes. Its sender is built
// in: every Client with Config.DB sends it from Run, whatever its Senders.
const TopicEnqueue = ReservedTopicPrefix + "enqueue"

// enqueueDedupeKey is the outbox dedupe key of job id's EnqueueTx row.
func enqueueDedupeKey(jobID string) string { return "enqueue:" + jobID }

// enqueueIntent is the payload of a TopicEnqueue row: the job's message and where it
// goes. Args holds the arguments' JSON as text, byte for byte: a jsonb object would be
// reordered, and a keyed enqueue's fingerprint is of these bytes.
type enqueueIntent struct {
	Queue       string `json:"queue"`
	Key         string `json:"key,omitempty"`
	JobID       string `json:"job_id"`
	Kind        string `json:"kind"`
	Tenant      string `json:"tenant,omitempty"`
	Args        string `json:"args"`
	EnqueuedAt  int64  `json:"enqueued_at"` // Unix milliseconds
	TraceParent string `json:"traceparent,omitempty"`
	RunAt       int64  `json:"run_at,omitempty"` // Unix milliseconds; 0: at once
}

// EnqueueTx enqueues a job inside tx, the caller's own pgx transaction: the job exists
// if and only if tx commits. It writes an outbox row (topic TopicEnqueue, dedupe key
// "enqueue:<job id>") in one round trip of tx; once tx commits, the outbox relay of a
// Client with Config.DB (Run) adds the job to its queue, within about the relay's
// PollInterval (Config.Relay, 250ms by default), with a keyed enqueue when opts has a
// Key. The relay may add it twice (it died between the send and recording it): with the
// same job id, so the job's Commit runs once.
//
// Arguments and options are Enqueue's, checked the same way. The result has the job id
// and queue; Replayed reports that a row for this job id was in the outbox already (an
// EnqueueTx with the same Key or JobID whose row was not purged yet): nothing was added,
// and the arguments were not compared; a row of another tenant's with that job id is
// ErrJobIDTaken (one more round trip, on this path only). The row's insert never aborts tx; its database
// error is returned and tx is the caller's to roll back.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, args JobArgs, opts *EnqueueOpts) (*EnqueueResult, error) {
	if tx == nil {
		return nil, errors.New("onceflow: EnqueueTx: nil transaction")
	}
	m, o, err := c.message(ctx, args, opts)
	if err != nil {
		return nil, err
	}
	if err := answersBeforeLeaving(ctx); err != nil {
		return nil, err
	}
	c.noteQueue(o.Queue)
	payload, err := json.Marshal(enqueueIntent{
		Queue: o.Queue, Key: o.Key, JobID: m.JobID, Kind: m.Kind, Tenant: m.Tenant, Args: string(m.Payload),
		EnqueuedAt: m.EnqueuedAt.UnixMilli(), TraceParent: m.TraceParent, RunAt: runAtMillis(o.RunAt),
	})
	if err != nil {
		return nil, fmt.Errorf("onceflow: enqueue %s in a transaction: %w", m.Kind, err)
	}
	_, err = pgoutbox.Insert(ctx, tx, outbox.Message{Topic: TopicEnqueue, DedupeKey: enqueueDedupeKey(m.JobID),
		Payload: payload, Traceparent: m.TraceParent})
	switch {
	case errors.Is(err, pgoutbox.ErrDuplicate):
		// The row of this job id exists: this job's (a replay), or another tenant's
		// that chose the same JobID, which this caller must not be told is its own.
		var tenant string
		if err := tx.QueryRow(ctx, `SELECT coalesce(payload->>'tenant', '') FROM outbox WHERE dedupe_key = $1`,
			enqueueDedupeKey(m.JobID)).Scan(&tenant); err != nil {
			return nil, fmt.Errorf("onceflow: enqueue %s in a transaction: read the job's row: %w", m.Kind, err)
		}
		if tenant != m.Tenant {
			return nil, fmt.Errorf("onceflow: enqueue %s in a transaction: %w", m.Kind, ErrJobIDTaken)
		}
		return &EnqueueResult{JobID: m.JobID, Queue: o.Queue, Replayed: true}, nil
	case err != nil:
		return nil, fmt.Errorf("onceflow: enqueue %s in a transaction: %w", m.Kind, err)
	}
	return &EnqueueResult{JobID: m.JobID, Queue: o.Queue}, nil
}

// runAtMillis is t in Unix milliseconds, 0 for the zero time.
func runAtMillis(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

// sendEnqueue is the built-in sender of TopicEnqueue: it adds the row's job to its
// queue, through the keyed accept when it had a key (a key already used for the same
// arguments adds nothing), with queue.Enqueue otherwise. A row that does not decode, a
// key used for other arguments and a job id of another tenant's (ErrJobIDTaken) are
// permanent. Redis unreachable or unable to
// take writes (redisUnreachable: a refused or broken connection, LOADING, READONLY,
// MASTERDOWN, ...) is marked Unavailable, so the relay retries the row for as long as
// the outage lasts without counting attempts: a committed job is never exhausted
// because Redis was down. Other Redis errors are retried and counted. The enqueue is
// safe to repeat (same job id; a keyed one is a replay).
func (c *Client) sendEnqueue(ctx context.Context, om outbox.Message) error {
	var in enqueueIntent
	if err := json.Unmarshal(om.Payload, &in); err != nil {
		return retry.Permanent(fmt.Errorf("decode %s row: %w", TopicEnqueue, err))
	}
	m := queue.Message{JobID: in.JobID, Kind: in.Kind, Tenant: in.Tenant, Payload: json.RawMessage(in.Args),
		EnqueuedAt: time.UnixMilli(in.EnqueuedAt), TraceParent: in.TraceParent}
	if err := c.keys(in.Queue).Validate(); err != nil {
		return retry.Permanent(fmt.Errorf("%s row: %w", TopicEnqueue, err))
	}
	keys, err := c.enqueueKeys(ctx, in.Queue, in.JobID)
	if redisUnreachable(err) {
		return outbox.Unavailable(err)
	} else if err != nil {
		return err
	}
	if err := m.Validate(); err != nil {
		return retry.Permanent(fmt.Errorf("%s row: %w", TopicEnqueue, err))
	}
	var runAt time.Time
	if in.RunAt > 0 {
		runAt = time.UnixMilli(in.RunAt)
	}
	if in.Key != "" {
		_, err = c.acceptKeyed(ctx, EnqueueScopeOn(keys.Queue, m.Tenant, m.Kind, in.Key), m, keys, runAt)
		if errors.Is(err, idempotency.ErrKeyReused) {
			return retry.Permanent(err)
		}
	} else {
		err = c.enqueue(ctx, keys, m, runAt)
	}
	if errors.Is(err, ErrJobIDTaken) { // another tenant's job id: no retry can change that
		return retry.Permanent(err)
	}
	if redisUnreachable(err) && !errors.Is(err, outbox.ErrUnavailable) {
		return outbox.Unavailable(err)
	}
	return err
}
