package queue

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// deadLetterOne runs a worker whose handler fails job i permanently and returns the dead
// letter.
func deadLetterOne(t *testing.T, rdb redis.UniversalClient, keys Keys, i int) DeadLetter {
	t.Helper()
	before := len(deadLetters(t, rdb, keys))
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error {
		return Permanent(errors.New("bad input"))
	})})
	enqueue(t, rdb, keys, message(i, nil))
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == before+1 })
	w.stop(t)
	return deadLetters(t, rdb, keys)[before]
}

// effectHandler is an idempotent handler: the first run of a job id records its effect;
// later runs of the same id find it and do nothing.
type effectHandler struct {
	rdb     redis.UniversalClient
	effects string
	runs    atomic.Int32
}

func (h *effectHandler) Handle(ctx context.Context, j *Job) error {
	h.runs.Add(1)
	return h.rdb.HSetNX(ctx, h.effects, j.JobID, j.ID).Err()
}

// Replay puts the job back with the same id and removes the dead letter, atomically; the
// job then runs and its index says queued again.
func TestReplayReenqueuesWithSameJobID(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 1)
	newID, err := Replay(ctx, rdb, keys, d.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(deadLetters(t, rdb, keys)) != 0 {
		t.Error("dead letter still there after replay")
	}
	tenant, state, reason, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || tenant != "acme" || state != StateQueued || reason != "" {
		t.Errorf("JobState after replay = %q %q %q %v", tenant, state, reason, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl != -1 {
		t.Errorf("index TTL after replay = %v, want none while the job is queued", ttl)
	}
	msgs := rdb.XRange(ctx, keys.Stream(), newID, newID).Val()
	if len(msgs) != 1 {
		t.Fatalf("replayed entry %s not in the stream", newID)
	}
	m, err := ParseMessage(msgs[0].Values)
	if err != nil || m.JobID != jobID(1) || m.Tenant != "acme" || string(m.Payload) != `{"n":1}` {
		t.Errorf("replayed message %+v %v", m, err)
	}
	h := &effectHandler{rdb: rdb, effects: keys.Prefix + ":effects"}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: h})
	testenv.WaitFor(t, 10*time.Second, "the replayed job", func() bool { return rdb.HLen(ctx, h.effects).Val() == 1 })
	if _, err := Replay(ctx, rdb, keys, d.ID); !errors.Is(err, ErrDeadLetterNotFound) {
		t.Errorf("second replay = %v, want ErrDeadLetterNotFound", err)
	}
}

// Issue 3: replay of a job that meanwhile succeeded (a duplicate entry of the same job
// id, enqueued before the failure, completed after the dead letter). The replay runs it
// again and the handler's idempotency makes it a no-op: still one effect.
func TestReplayOfJobThatMeanwhileSucceeded(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	h := &effectHandler{rdb: rdb, effects: keys.Prefix + ":effects"}
	var first atomic.Bool
	enqueue(t, rdb, keys, message(1, nil), message(1, nil)) // the job and its duplicate
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 1, Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
		if first.CompareAndSwap(false, true) {
			return Permanent(errors.New("bad input"))
		}
		return h.Handle(ctx, j)
	})})
	testenv.WaitFor(t, 10*time.Second, "the dead letter and the duplicate's success", func() bool {
		return len(deadLetters(t, rdb, keys)) == 1 && h.runs.Load() == 1
	})
	d := deadLetters(t, rdb, keys)[0]
	if _, err := Replay(ctx, rdb, keys, d.ID); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the replayed run", func() bool { return h.runs.Load() == 2 })
	testenv.WaitFor(t, 5*time.Second, "acks", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	w.stop(t)
	if n := rdb.HLen(ctx, h.effects).Val(); n != 1 {
		t.Errorf("%d effects after replaying a job that had succeeded, want 1", n)
	}
	if len(deadLetters(t, rdb, keys)) != 0 {
		t.Error("dead letter still there")
	}
}

// Of concurrent replays of one dead letter, exactly one enqueues it.
func TestConcurrentReplaysEnqueueOnce(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 1)
	before := rdb.XLen(ctx, keys.Stream()).Val()
	var ok, notFound atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			_, err := Replay(ctx, rdb, keys, d.ID)
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, ErrDeadLetterNotFound):
				notFound.Add(1)
			default:
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if ok.Load() != 1 || notFound.Load() != 7 {
		t.Errorf("%d replays succeeded, %d not found; want 1 and 7", ok.Load(), notFound.Load())
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val(); n != before+1 {
		t.Errorf("stream grew by %d, want 1", n-before)
	}
}

// Purge deletes the dead letter; the job stays failed, with a TTL again, and no longer
// points at a record that is gone.
func TestPurgeDeletesTheDeadLetterAndTheJobReadsFailedForTheTTL(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 1)
	if err := Purge(ctx, rdb, keys, d.ID, time.Hour); err != nil {
		t.Fatal(err)
	}
	if len(deadLetters(t, rdb, keys)) != 0 {
		t.Error("dead letter still there after purge")
	}
	_, state, reason, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || state != StateFailed || reason != "permanent: bad input" {
		t.Errorf("JobState after purge = %q %q %v", state, reason, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl <= 0 || ttl > time.Hour {
		t.Errorf("index TTL after purge = %v", ttl)
	}
	if rdb.HExists(ctx, keys.Job(jobID(1)), "dead_id").Val() {
		t.Error("index still points at the purged dead letter")
	}
	if err := Purge(ctx, rdb, keys, d.ID, time.Hour); !errors.Is(err, ErrDeadLetterNotFound) {
		t.Errorf("second purge = %v", err)
	}
	if _, err := Replay(ctx, rdb, keys, d.ID); !errors.Is(err, ErrDeadLetterNotFound) {
		t.Errorf("replay after purge = %v", err)
	}
}

// A malformed dead letter cannot be replayed (it would only fail again); it can be
// purged.
func TestMalformedDeadLetterCannotBeReplayed(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), Values: []any{"v", "1", "job_id", "nope"}}).Err(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	d := deadLetters(t, rdb, keys)[0]
	var raw map[string]string
	if err := json.Unmarshal(d.Raw, &raw); err != nil || raw["job_id"] != "nope" {
		t.Errorf("raw fields %s: %v", d.Raw, err)
	}
	if _, err := Replay(ctx, rdb, keys, d.ID); !errors.Is(err, ErrMalformed) {
		t.Errorf("replay of a malformed dead letter = %v", err)
	}
	if err := Purge(ctx, rdb, keys, d.ID, time.Hour); err != nil {
		t.Error(err)
	}
}

func TestFindDeadAndListPages(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	// Job 1 twice (both entries enqueued before either fails) and job 2 between.
	enqueue(t, rdb, keys, message(1, nil), message(2, nil), message(1, nil))
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 1, Handler: HandlerFunc(func(context.Context, *Job) error {
		return Permanent(errors.New("bad input"))
	})})
	testenv.WaitFor(t, 10*time.Second, "three dead letters", func() bool { return len(deadLetters(t, rdb, keys)) == 3 })
	all := deadLetters(t, rdb, keys)
	d1, d3 := all[0], all[2]
	if d1.JobID != jobID(1) || all[1].JobID != jobID(2) || d3.JobID != jobID(1) {
		t.Fatalf("dead letters %+v, want jobs 1, 2, 1 in order", all)
	}
	found, err := FindDead(ctx, rdb, keys, jobID(1))
	if err != nil || len(found) != 2 || found[0].ID != d1.ID || found[1].ID != d3.ID {
		t.Errorf("FindDead = %v %v", found, err)
	}
	page, next, err := ListDead(ctx, rdb, keys, "", 2)
	if err != nil || len(page) != 2 || next == "" {
		t.Fatalf("first page %v next %q %v", page, next, err)
	}
	page, next, err = ListDead(ctx, rdb, keys, next, 2)
	if err != nil || len(page) != 1 || page[0].ID != d3.ID || next != "" {
		t.Errorf("second page %v next %q %v", page, next, err)
	}
}

func TestEnqueueAndJobState(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if _, _, _, err := JobState(ctx, rdb, keys, jobID(1)); !errors.Is(err, ErrUnknownJob) {
		t.Errorf("JobState of an unknown job = %v", err)
	}
	if _, _, _, err := JobState(ctx, rdb, keys, "../etc"); !errors.Is(err, ErrUnknownJob) {
		t.Errorf("JobState of an invalid id = %v", err)
	}
	m := message(1, nil)
	m.EnqueuedAt = time.Time{}
	id, err := Enqueue(ctx, rdb, keys, m)
	if err != nil {
		t.Fatal(err)
	}
	tenant, state, _, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || tenant != "acme" || state != StateQueued {
		t.Errorf("JobState = %q %q %v", tenant, state, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl != -1 {
		t.Errorf("index TTL %v while queued, want none", ttl)
	}
	if e := rdb.HGet(ctx, keys.Job(jobID(1)), "entry").Val(); e != id {
		t.Errorf("index entry %q, want the new entry %s", e, id)
	}
	got, err := ParseMessage(rdb.XRange(ctx, keys.Stream(), id, id).Val()[0].Values)
	if err != nil || time.Since(got.EnqueuedAt) > time.Minute {
		t.Errorf("enqueued message %+v %v (zero EnqueuedAt must become now)", got, err)
	}

	bad := message(2, nil)
	bad.Payload = json.RawMessage(`[1]`)
	if _, err := Enqueue(ctx, rdb, keys, bad); !errors.Is(err, ErrMalformed) {
		t.Errorf("enqueue of a non-object payload = %v", err)
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val(); n != 1 {
		t.Errorf("a refused enqueue wrote: stream length %d", n)
	}
	if _, err := Enqueue(ctx, rdb, Keys{Prefix: "p", Queue: "{x}"}, message(3, nil)); err == nil {
		t.Error("enqueue with a brace in the queue name succeeded")
	}
	// A key of another type: WRONGTYPE before the first write, so nothing is written.
	rdb.Set(ctx, keys.Job(jobID(4)), "x", 0)
	if _, err := Enqueue(ctx, rdb, keys, message(4, nil)); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Errorf("enqueue with a string at the index key = %v, want WRONGTYPE", err)
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val(); n != 1 {
		t.Errorf("a refused enqueue wrote: stream length %d", n)
	}
	other := Keys{Prefix: keys.Prefix, Queue: "other"}
	rdb.HSet(ctx, other.Job(jobID(5)), "tenant", "acme", "state", StateFailed, "dead_id", "1-0")
	rdb.Set(ctx, other.Dead(), "x", 0)
	if _, err := Enqueue(ctx, rdb, other, message(5, nil)); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Errorf("enqueue of a failed job with a string at the dead-letter key = %v, want WRONGTYPE", err)
	}
	rdb.Set(ctx, other.Stream(), "x", 0)
	if _, err := Enqueue(ctx, rdb, other, message(6, nil)); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Errorf("enqueue with a string at the stream key = %v, want WRONGTYPE", err)
	}
	if f := rdb.HGetAll(ctx, other.Job(jobID(5))).Val(); f["state"] != StateFailed || f["entry"] != "" {
		t.Errorf("a refused enqueue changed the index: %v", f)
	}
	if rdb.Exists(ctx, other.Job(jobID(6))).Val() != 0 {
		t.Error("a refused enqueue wrote an index")
	}
}

// Issue 12, item 7: enqueueing a job id whose index says failed runs the job again, like
// a replay: the enqueue retires the dead letter the index points at and the index says
// queued again, without a TTL, so the dead-letter stream and the index agree.
func TestEnqueueOfFailedJobRetiresItsDeadLetter(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 1)
	other := deadLetterOne(t, rdb, keys, 2)
	before := rdb.XLen(ctx, keys.Stream()).Val()
	id, err := Enqueue(ctx, rdb, keys, message(1, nil))
	if err != nil {
		t.Fatal(err)
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val() - before; n != 1 {
		t.Errorf("enqueue added %d entries, want 1", n)
	}
	if left := deadLetters(t, rdb, keys); len(left) != 1 || left[0].ID != other.ID {
		t.Errorf("dead letters %+v after re-enqueue of job 1, want only job 2's %s (job 1's %s retired)", left, other.ID, d.ID)
	}
	tenant, state, reason, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || tenant != "acme" || state != StateQueued || reason != "" {
		t.Errorf("JobState after re-enqueue = %q %q %q %v, want acme queued", tenant, state, reason, err)
	}
	if f := rdb.HMGet(ctx, keys.Job(jobID(1)), "dead_id", "failed_at").Val(); f[0] != nil || f[1] != nil {
		t.Errorf("index still records the failure: %v", f)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl != -1 {
		t.Errorf("index TTL %v after re-enqueue, want none while queued", ttl)
	}
	if _, err := Replay(ctx, rdb, keys, d.ID); !errors.Is(err, ErrDeadLetterNotFound) {
		t.Errorf("replay of the retired dead letter = %v (entry %s), want ErrDeadLetterNotFound", err, id)
	}
}

// Replay, Purge and TrimDead refuse keys that cannot name a queue, with Validate's error,
// before they reach Redis (where a broken hash tag is a CROSSSLOT error on a cluster).
func TestReplayRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := Replay(context.Background(), rdb, keys, "1700000000000-0")
		return err
	})
}

func TestPurgeRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		return Purge(context.Background(), rdb, keys, "1700000000000-0", time.Hour)
	})
}

func TestTrimDeadRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := TrimDead(context.Background(), rdb, keys, time.Now(), time.Hour)
		return err
	})
}

// Purge refuses a TTL of 0 or less, which would delete the job's index at once (its
// state, failed, is to be read for the TTL), and leaves the dead letter and the index
// alone.
func TestPurgeRefusesANonPositiveTTL(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 1)
	for _, ttl := range []time.Duration{0, -time.Second} {
		if err := Purge(ctx, rdb, keys, d.ID, ttl); err == nil || !strings.Contains(err.Error(), "not positive") {
			t.Errorf("Purge with ttl %v: %v, want a refusal", ttl, err)
		}
	}
	if len(deadLetters(t, rdb, keys)) != 1 {
		t.Error("the dead letter is gone after refused purges")
	}
	if _, state, _, err := JobState(ctx, rdb, keys, jobID(1)); err != nil || state != StateFailed {
		t.Errorf("JobState after refused purges = %q %v, want failed", state, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl != -1 {
		t.Errorf("index TTL after refused purges = %v, want none", ttl)
	}
}
