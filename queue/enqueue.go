package queue

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// DefaultJobTTL is how long Enqueue keeps a job's index (the hash at Keys.Job) when the
// job does not fail; it matches the default ONCEFLOW_RESULT_TTL, the time the API
// replays a stored response.
const DefaultJobTTL = 24 * time.Hour

// enqueueScript adds one job and records its tenant in the job index, in one round trip.
//
//	KEYS[1]  the stream (Keys.Stream)
//	KEYS[2]  the job index (Keys.Job(job_id))
//	ARGV[1]  tenant
//	ARGV[2]  index TTL in milliseconds
//	ARGV[3:] the entry's field/value list (Message.Values)
//
// Returns the new entry id. Invariant: a job index that records a failure (state failed,
// no TTL, pointing at a dead-letter entry) keeps living as long as that entry, so a
// repeated enqueue of a failed job does not put a TTL back on it.
var enqueueScript = redis.NewScript(`
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('HSET', KEYS[2], 'tenant', ARGV[1])
if redis.call('HGET', KEYS[2], 'state') ~= 'failed' then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return id
`)

// Enqueue adds m to the queue named by keys and records m.Tenant in the job index
// (Keys.Job), with DefaultJobTTL, in one round trip. It returns the stream entry id.
// A zero m.EnqueuedAt is set to the current time. Enqueueing the same job id twice is
// allowed and adds a second entry: handlers deduplicate on the job id.
//
// An m that fails Validate is refused with an error wrapping ErrMalformed and nothing is
// written. Redis errors are returned wrapped; on a network error the job may or may not
// have been added, and enqueueing it again is safe. Safe for concurrent use.
func Enqueue(ctx context.Context, rdb redis.Scripter, keys Keys, m Message) (string, error) {
	return EnqueueTTL(ctx, rdb, keys, m, DefaultJobTTL)
}

// EnqueueTTL is Enqueue with the job index kept for ttl instead of DefaultJobTTL.
func EnqueueTTL(ctx context.Context, rdb redis.Scripter, keys Keys, m Message, ttl time.Duration) (string, error) {
	if err := keys.Validate(); err != nil {
		return "", err
	}
	if m.EnqueuedAt.IsZero() {
		m.EnqueuedAt = time.Now()
	}
	if err := m.Validate(); err != nil {
		return "", fmt.Errorf("enqueue job %q: %w", clip(m.JobID), err)
	}
	if ttl <= 0 {
		return "", fmt.Errorf("enqueue job %s: ttl %v is not positive", m.JobID, ttl)
	}
	args := append([]any{m.Tenant, ttl.Milliseconds()}, m.Values()...)
	id, err := enqueueScript.Run(ctx, rdb, []string{keys.Stream(), keys.Job(m.JobID)}, args...).Text()
	if err != nil {
		return "", fmt.Errorf("enqueue job %s: %w", m.JobID, err)
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
// or enqueued longer ago than the index TTL.
var ErrUnknownJob = errors.New("unknown job")

// JobState reads the job index of jobID: the tenant that owns it, its state (StateQueued
// or StateFailed) and, when failed, the dead-letter reason. An id without an index gives
// ErrUnknownJob. One round trip; safe for concurrent use.
func JobState(ctx context.Context, rdb redis.Cmdable, keys Keys, jobID string) (tenant, state, reason string, err error) {
	if !ValidJobID(jobID) {
		return "", "", "", ErrUnknownJob
	}
	vals, err := rdb.HMGet(ctx, keys.Job(jobID), "tenant", "state", "reason").Result()
	if err != nil {
		return "", "", "", fmt.Errorf("read job index %s: %w", jobID, err)
	}
	str := func(v any) string { s, _ := v.(string); return s }
	tenant, state, reason = str(vals[0]), str(vals[1]), str(vals[2])
	if tenant == "" && state == "" {
		return "", "", "", ErrUnknownJob
	}
	if state == "" {
		state = StateQueued
	}
	return tenant, state, reason, nil
}
