package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/redisscript"
)

// DefaultJobTTL is how long the job index (the hash at Keys.Job) of a job that left the
// stream acknowledged is kept, the default of WorkerConfig.JobTTL; it matches the
// default ONCEFLOW_RESULT_TTL, the time the API replays a stored response. While the job
// is queued, running or dead-lettered its index does not expire.
const DefaultJobTTL = 24 * time.Hour

// ErrJobIDTaken is matched by the error of an enqueue of a job id whose index belongs to
// another tenant (the index records the tenant of the job's first enqueue, "" for
// none): a job id is one job, and a caller that chooses ids cannot take over, or have
// its job confused with, another tenant's. Nothing is written. Another enqueue with the
// index's own tenant is allowed, as before.
var ErrJobIDTaken = errors.New("queue: the job id belongs to another tenant")

// jobIDTakenReply starts the error enqueue.lua raises for ErrJobIDTaken.
const jobIDTakenReply = "JOBIDTAKEN"

// EnqueueError returns err, the error of a script that runs the queue's enqueue (alone,
// or as a Step of EnqueueStep or EnqueueAtStep in another package's script), with
// ErrJobIDTaken added to what it matches when the enqueue refused another tenant's job
// id. Other errors, and nil, are returned as they are.
func EnqueueError(err error) error {
	var rerr redis.Error
	if errors.As(err, &rerr) && strings.HasPrefix(rerr.Error(), jobIDTakenReply) {
		return fmt.Errorf("%w: %w", ErrJobIDTaken, err)
	}
	return err
}

// enqueueScript runs enqueue(KEYS, ARGV) (lua/enqueue.lua).
var enqueueScript = enqueueFunc.Script()

// enqueueKeys returns the keys enqueue.lua takes to enqueue jobID, in order: the stream,
// the dead-letter stream and the job index.
func (k Keys) enqueueKeys(jobID string) []string {
	return []string{k.Stream(), k.Dead(), k.Job(jobID)}
}

// enqueueArgs returns the arguments enqueue.lua takes to enqueue m: its tenant, then its
// fields (Message.Values). A zero m.EnqueuedAt is set to the current time. An m that
// fails Validate gives an error wrapping ErrMalformed.
func enqueueArgs(m Message) ([]any, error) {
	if m.EnqueuedAt.IsZero() {
		m.EnqueuedAt = time.Now()
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("enqueue job %q: %w", clip(m.JobID), err)
	}
	return append([]any{m.Tenant}, m.Values()...), nil
}

// EnqueueStep returns the enqueue of m on keys' queue as a Step: the queue's own enqueue
// (the function Enqueue runs: the entry, and the job index's rules) with its keys and
// args, for a script of another package to run in the same atomic step as writes of its
// own (redisstore.Store.AcceptStep, the API's accept). It validates as Enqueue does: an
// invalid keys gives its error, an m that fails Validate an error wrapping ErrMalformed;
// a zero m.EnqueuedAt is set to the current time. Run, the step raises its errors
// before its first write (pass them through EnqueueError to match ErrJobIDTaken), so a
// script that writes only after it writes all or nothing. Its keys share the queue's
// hash slot.
func EnqueueStep(keys Keys, m Message) (redisscript.Step, error) {
	if err := keys.Validate(); err != nil {
		return redisscript.Step{}, err
	}
	args, err := enqueueArgs(m)
	if err != nil {
		return redisscript.Step{}, err
	}
	return enqueueFunc.Step(keys.enqueueKeys(m.JobID), args...)
}

// Enqueue adds m to the queue named by keys and records m.Tenant in the job index
// (Keys.Job), in one round trip (lua/enqueue.lua). It returns the stream entry id. A zero
// m.EnqueuedAt is set to the current time. Enqueueing the same job id twice is allowed
// and adds a second entry: handlers deduplicate on the job id; enqueueing it for another
// tenant than its index's is refused with an error wrapping ErrJobIDTaken. Enqueueing a job whose
// index says failed runs it again: its dead letter is deleted and its index says queued
// (see lua/enqueue.lua).
//
// The index does not expire while the job waits or runs, however long; the worker gives
// it WorkerConfig.JobTTL when the trim removes the job's acknowledged entry.
//
// An m that fails Validate is refused with an error wrapping ErrMalformed and nothing is
// written. Redis errors are returned wrapped; on a network error the job may or may not
// have been added, and enqueueing it again is safe. Safe for concurrent use.
func Enqueue(ctx context.Context, rdb redis.Scripter, keys Keys, m Message) (string, error) {
	if err := keys.Validate(); err != nil {
		return "", err
	}
	args, err := enqueueArgs(m)
	if err != nil {
		return "", err
	}
	id, err := enqueueScript.Run(ctx, rdb, keys.enqueueKeys(m.JobID), args...).Text()
	if err != nil {
		return "", fmt.Errorf("enqueue job %s: %w", m.JobID, EnqueueError(err))
	}
	return id, nil
}

// Job states recorded in the job index.
const (
	// StateQueued: the job was accepted and has not failed. The queue does not record
	// success; a handler's own store (the summaries table) knows that.
	StateQueued = "queued"
	// StateFailed: the job is in the dead-letter stream.
	StateFailed = "failed"
)

// ErrUnknownJob is returned by JobState for a job id that has no index: never enqueued,
// or trimmed from the stream after its acknowledgement (or its dead letter purged)
// longer ago than the index TTL.
var ErrUnknownJob = errors.New("unknown job")

// JobState reads the job index of jobID: the tenant that owns it, its state (StateQueued,
// StateScheduled or StateFailed) and, when failed, the dead-letter reason. An id without an index gives
// ErrUnknownJob. One round trip; safe for concurrent use.
func JobState(ctx context.Context, rdb redis.Cmdable, keys Keys, jobID string) (tenant, state, reason string, err error) {
	if !ValidJobID(jobID) {
		return "", "", "", ErrUnknownJob
	}
	ix, err := ReadJobIndex(ctx, rdb, keys, jobID)
	if err != nil {
		return "", "", "", err
	}
	return ix.Tenant, ix.State, ix.Reason, nil
}

// JobIndex is what the job index (Keys.Job) of a job records.
type JobIndex struct {
	// Tenant owns the job ("" for none).
	Tenant string
	// State is StateQueued or StateFailed.
	State string
	// Reason is the dead-letter reason when failed.
	Reason string
	// Entry is the stream entry id of the job's latest enqueue ("" when failed or
	// scheduled, or for an index written before entries were recorded); see EntryState.
	Entry string
	// RunAt is when a scheduled job (StateScheduled) is due.
	RunAt time.Time
	// Waiting is what a scheduled job waits for when it was put off by a limiter (a
	// rate limit, a token budget: a *retry.WaitError's Reason), "" otherwise.
	Waiting string
}

// ReadJobIndex is JobState returning the whole index, in one round trip (HMGET). An id
// without an index gives ErrUnknownJob.
func ReadJobIndex(ctx context.Context, rdb redis.Cmdable, keys Keys, jobID string) (JobIndex, error) {
	if !ValidJobID(jobID) {
		return JobIndex{}, ErrUnknownJob
	}
	vals, err := rdb.HMGet(ctx, keys.Job(jobID), "tenant", "state", "reason", "entry", "run_at", "waiting").Result()
	if err != nil {
		return JobIndex{}, fmt.Errorf("read job index %s: %w", jobID, err)
	}
	str := func(v any) string { s, _ := v.(string); return s }
	ix := JobIndex{Tenant: str(vals[0]), State: str(vals[1]), Reason: str(vals[2]), Entry: str(vals[3])}
	if ms, err := strconv.ParseInt(str(vals[4]), 10, 64); err == nil && ix.State == StateScheduled {
		ix.RunAt = time.UnixMilli(ms).UTC()
		ix.Waiting = str(vals[5])
	}
	if ix.Tenant == "" && ix.State == "" {
		return JobIndex{}, ErrUnknownJob
	}
	if ix.State == "" {
		ix.State = StateQueued
	}
	return ix, nil
}
