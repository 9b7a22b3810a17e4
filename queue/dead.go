package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Fields a dead-letter record adds to the message it holds.
const (
	deadReason     = "reason"
	deadDeliveries = "deliveries"
	deadOriginalID = "original_id"
	deadFailedAt   = "failed_at"
	deadRaw        = "raw" // malformed messages only: their fields as a JSON object
)

// Dead-letter reasons are "malformed: ...", "permanent: ..." or "exceeded N deliveries"
// (followed by "; last error: ..." when the last failed run's error is known);
// these are their bounded metric labels.
const (
	reasonMalformed     = "malformed"
	reasonPermanent     = "permanent"
	reasonMaxDeliveries = "max_deliveries"
)

// DeadLetter is one entry of the dead-letter stream: a job that will not be retried
// until an operator replays it.
type DeadLetter struct {
	// ID is the dead-letter stream entry id.
	ID string `json:"dead_id"`
	// JobID and Tenant are the job's, when the message had them (a malformed message may
	// not).
	JobID  string `json:"job_id"`
	Tenant string `json:"tenant"`
	// Kind is the job's kind; empty for a version 1 message.
	Kind string `json:"kind,omitempty"`
	// Reason says why: "malformed: ...", "permanent: ..." or "exceeded N deliveries"
	// (with "; last error: ..." when known).
	Reason string `json:"reason"`
	// Deliveries is the entry's delivery count when it was dead-lettered.
	Deliveries int64 `json:"deliveries"`
	// OriginalID is the job stream entry id the message had.
	OriginalID string `json:"original_id"`
	// FailedAt is when it was dead-lettered.
	FailedAt time.Time `json:"failed_at"`
	// Message is the job as it was enqueued; nil when the message was malformed, in
	// which case Raw holds its fields as a JSON object.
	Message *Message        `json:"message,omitempty"`
	Raw     json.RawMessage `json:"raw,omitempty"`
	// Partition is the queue partition whose dead-letter stream holds it (Keys.Partition;
	// set by ListDead and FindDead): replay and purge it with the keys of that partition.
	Partition int `json:"partition"`
}

// ErrDeadLetterNotFound is returned by Replay and Purge when the dead-letter entry does
// not exist (any more): already replayed or purged, or a wrong id.
var ErrDeadLetterNotFound = errors.New("dead letter not found")

// MarshalJSON renders the message with its payload as JSON and its time in RFC 3339.
func (m Message) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		JobID       string          `json:"job_id"`
		Kind        string          `json:"kind,omitempty"`
		Tenant      string          `json:"tenant"`
		Payload     json.RawMessage `json:"payload"`
		EnqueuedAt  time.Time       `json:"enqueued_at"`
		TraceParent string          `json:"traceparent,omitempty"`
	}{m.JobID, m.Kind, m.Tenant, m.Payload, m.EnqueuedAt.UTC(), m.TraceParent})
}

// deadLetterScript moves one pending entry to the dead-letter stream, with the job
// index's state=failed, in one step (lua/dead_letter.lua).
var deadLetterScript = scripts.MustScript("lua/dead_letter.lua", historyLib)

// deadLetter moves entry id (pending to consumer) to the dead-letter stream. msg is the
// parsed message, or nil when fields were malformed. It reports ok=false when the entry
// was no longer this consumer's.
//
// hist is the delivery's history event (historyRecord, without its dead letter's id,
// which the script adds), or "" for none.
func deadLetter(ctx context.Context, rdb redis.Scripter, keys Keys, group, consumer, id string, fields map[string]any, msg *Message, reason string, attempts int64, now time.Time, hist string) (deadID string, ok bool, err error) {
	ms := strconv.FormatInt(now.UnixMilli(), 10)
	var rec []any
	var jobID, tenant string
	if msg != nil {
		rec = msg.Values()
		jobID, tenant = msg.JobID, msg.Tenant
	} else {
		raw, err := json.Marshal(fields)
		if err != nil { // values are strings from Redis, so this does not happen
			raw = []byte(`{}`)
		}
		if s, _ := fields[fieldJobID].(string); ValidJobID(s) {
			jobID = s
			rec = append(rec, fieldJobID, s)
		}
		if s, _ := fields[fieldTenant].(string); s != "" && ValidTenant(s) {
			tenant = s
			rec = append(rec, fieldTenant, s)
		}
		rec = append(rec, deadRaw, string(raw))
	}
	rec = append(rec, deadReason, reason, deadOriginalID, id, deadFailedAt, ms)
	keyList := []string{keys.Stream(), keys.Dead()}
	if jobID != "" {
		keyList = append(keyList, keys.Job(jobID))
	}
	args := append([]any{group, consumer, id, reason, ms, tenant, attempts, hist}, rec...)
	deadID, err = deadLetterScript.Run(ctx, rdb, keyList, args...).Text()
	if errors.Is(err, redis.Nil) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("dead-letter entry %s: %w", id, err)
	}
	return deadID, true, nil
}

// ParseDeadLetter decodes one dead-letter stream entry. It does not fail: a record it
// cannot fully read keeps what it could, with Message nil and Raw holding its fields, so
// listing never hides an entry.
func ParseDeadLetter(id string, fields map[string]any) DeadLetter {
	str := func(k string) string { s, _ := fields[k].(string); return s }
	d := DeadLetter{
		ID:         id,
		JobID:      str(fieldJobID),
		Tenant:     str(fieldTenant),
		Kind:       str(fieldKind),
		Reason:     str(deadReason),
		OriginalID: str(deadOriginalID),
	}
	d.Deliveries, _ = strconv.ParseInt(str(deadDeliveries), 10, 64)
	if ms, err := strconv.ParseInt(str(deadFailedAt), 10, 64); err == nil {
		d.FailedAt = time.UnixMilli(ms).UTC()
	}
	if raw := str(deadRaw); raw != "" {
		d.Raw = json.RawMessage(raw)
		if !json.Valid(d.Raw) {
			d.Raw, _ = json.Marshal(raw)
		}
		return d
	}
	msgFields := make(map[string]any, len(messageFieldsV2))
	names := messageFieldsV1
	if str(fieldVersion) == FormatVersion {
		names = messageFieldsV2
	}
	for _, f := range names {
		if v, ok := fields[f]; ok {
			msgFields[f] = v
		}
	}
	m, err := ParseMessage(msgFields)
	if err != nil {
		d.Raw, _ = json.Marshal(fields)
		return d
	}
	d.Message = &m
	return d
}

// ListDead returns up to count dead letters, oldest first, starting at the entry id
// start ("-" or "" for the beginning), and the start of the next page, "" when there is
// none. One round trip; safe for concurrent use.
func ListDead(ctx context.Context, rdb redis.Cmdable, keys Keys, start string, count int64) ([]DeadLetter, string, error) {
	if start == "" {
		start = "-"
	}
	if count <= 0 {
		count = 100
	}
	msgs, err := rdb.XRangeN(ctx, keys.Dead(), start, "+", count).Result()
	if err != nil {
		return nil, "", fmt.Errorf("list dead letters: %w", err)
	}
	out := make([]DeadLetter, 0, len(msgs))
	for _, m := range msgs {
		d := ParseDeadLetter(m.ID, m.Values)
		d.Partition = keys.Partition
		out = append(out, d)
	}
	next := ""
	if int64(len(msgs)) == count {
		next = "(" + msgs[len(msgs)-1].ID
	}
	return out, next, nil
}

// FindDead returns every dead letter of jobID, oldest first, by scanning the dead-letter
// stream. Safe for concurrent use.
func FindDead(ctx context.Context, rdb redis.Cmdable, keys Keys, jobID string) ([]DeadLetter, error) {
	var out []DeadLetter
	for start := "-"; start != ""; {
		page, next, err := ListDead(ctx, rdb, keys, start, 500)
		if err != nil {
			return nil, err
		}
		for _, d := range page {
			if d.JobID == jobID {
				out = append(out, d)
			}
		}
		start = next
	}
	return out, nil
}

// getDead reads one dead-letter entry.
func getDead(ctx context.Context, rdb redis.Cmdable, keys Keys, deadID string) (DeadLetter, error) {
	msgs, err := rdb.XRangeN(ctx, keys.Dead(), deadID, deadID, 1).Result()
	if err != nil {
		return DeadLetter{}, fmt.Errorf("read dead letter %s: %w", deadID, err)
	}
	if len(msgs) == 0 {
		return DeadLetter{}, fmt.Errorf("%w: %s", ErrDeadLetterNotFound, deadID)
	}
	return ParseDeadLetter(msgs[0].ID, msgs[0].Values), nil
}

// replayScript re-enqueues a dead letter with the queue's enqueue and removes it, in
// one step (lua/replay.lua).
var replayScript = scripts.MustScript("lua/replay.lua", historyLib, enqueueLib)

// Replay puts the dead letter deadID back on the queue with the same job id (and
// payload, tenant and trace context; enqueued_at becomes now) and removes it from the
// dead-letter stream, in one atomic script that enqueues like Enqueue: the job's index
// says queued again and has no TTL until the job is acknowledged. It returns the new
// stream entry id. A dead letter that does not exist (already replayed or purged, or
// retired by a replay or an enqueue of the same job) gives an error wrapping
// ErrDeadLetterNotFound; a malformed one cannot be replayed (an error wrapping
// ErrMalformed) and should be purged. Safe for concurrent use: of two concurrent replays
// of one entry, one succeeds.
func Replay(ctx context.Context, rdb redis.Cmdable, keys Keys, deadID string) (string, error) {
	if err := keys.Validate(); err != nil {
		return "", err
	}
	d, err := getDead(ctx, rdb, keys, deadID)
	if err != nil {
		return "", err
	}
	if d.Message == nil {
		return "", fmt.Errorf("replay %s: %w: cannot replay a malformed message (%s); purge it", deadID, ErrMalformed, d.Reason)
	}
	m := *d.Message
	first := m.EnqueuedAt
	m.EnqueuedAt = time.Now()
	enq, err := enqueueArgs(m)
	if err != nil {
		return "", fmt.Errorf("replay %s: %w", deadID, err)
	}
	id, err := replayScript.Run(ctx, rdb, keys.enqueueKeys(m.JobID), append([]any{deadID, m.EnqueuedAt.UnixMilli(), first.UnixMilli()}, enq...)...).Text()
	if errors.Is(err, redis.Nil) {
		return "", fmt.Errorf("%w: %s", ErrDeadLetterNotFound, deadID)
	}
	if err != nil {
		return "", fmt.Errorf("replay %s: %w", deadID, EnqueueError(err))
	}
	return id, nil
}

// purgeScript deletes a dead letter and gives its job index a TTL back (lua/purge.lua).
var purgeScript = scripts.MustScript("lua/purge.lua", historyLib)

// Purge deletes the dead letter deadID for good. The job index stays "failed" for ttl
// more, then expires; a ttl that is not positive is refused (it would delete the index at
// once). A dead letter that does not exist gives an error wrapping
// ErrDeadLetterNotFound. Safe for concurrent use.
func Purge(ctx context.Context, rdb redis.Cmdable, keys Keys, deadID string, ttl time.Duration) error {
	if ttl <= 0 {
		return fmt.Errorf("purge %s: ttl %v is not positive", deadID, ttl)
	}
	if err := keys.Validate(); err != nil {
		return err
	}
	d, err := getDead(ctx, rdb, keys, deadID)
	if err != nil {
		return err
	}
	keyList := []string{keys.Dead()}
	if ValidJobID(d.JobID) {
		keyList = append(keyList, keys.Job(d.JobID))
	}
	n, err := purgeScript.Run(ctx, rdb, keyList, deadID, ttl.Milliseconds(), time.Now().UnixMilli()).Int()
	if err != nil {
		return fmt.Errorf("purge %s: %w", deadID, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %s", ErrDeadLetterNotFound, deadID)
	}
	return nil
}

// trimDeadScript deletes the dead letters below a threshold id and releases their job
// indexes, in one step (lua/trim_dead.lua).
var trimDeadScript = scripts.MustScript("lua/trim_dead.lua")

// trimDeadBatch bounds the dead letters one trimDeadScript call handles.
const trimDeadBatch = 500

// TrimDead deletes every dead letter that was written before before (dead-letter entry
// ids are their Unix millisecond times) and gives the job index of each the TTL ttl, as
// Purge does: the job reads as failed for ttl more, then is forgotten. It returns how
// many it deleted. It works in batches of 500: one XRANGE and one script call each, the
// script trimming with XTRIM MINID up to the batch's last entry, so an index is never
// left pointing at a deleted entry. Safe for concurrent use and to run from several
// workers (a dead letter is counted by the call that deleted it). On an error it
// returns what it deleted so far.
func TrimDead(ctx context.Context, rdb redis.Cmdable, keys Keys, before time.Time, ttl time.Duration) (int64, error) {
	if ttl <= 0 {
		return 0, fmt.Errorf("trim dead letters: ttl %v is not positive", ttl)
	}
	if err := keys.Validate(); err != nil {
		return 0, err
	}
	if before.UnixMilli() <= 0 {
		return 0, nil // no dead letter is older than the epoch
	}
	threshold := strconv.FormatInt(before.UnixMilli(), 10) + "-0"
	var total int64
	for {
		msgs, err := rdb.XRangeN(ctx, keys.Dead(), "-", "("+threshold, trimDeadBatch).Result()
		if err != nil {
			return total, fmt.Errorf("trim dead letters: %w", err)
		}
		if len(msgs) == 0 {
			return total, nil
		}
		cut := threshold
		if len(msgs) == trimDeadBatch { // more may follow: trim this batch only
			ms, seq, _ := splitID(msgs[len(msgs)-1].ID)
			cut = strconv.FormatUint(ms, 10) + "-" + strconv.FormatUint(seq+1, 10)
		}
		keyList := []string{keys.Dead()}
		args := []any{cut, ttl.Milliseconds()}
		for _, m := range msgs {
			if job, _ := m.Values[fieldJobID].(string); ValidJobID(job) {
				keyList = append(keyList, keys.Job(job))
				args = append(args, m.ID)
			}
		}
		n, err := trimDeadScript.Run(ctx, rdb, keyList, args...).Int64()
		if err != nil {
			return total, fmt.Errorf("trim dead letters: %w", err)
		}
		total += n
		if len(msgs) < trimDeadBatch {
			return total, nil
		}
	}
}
