package queue

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// deadLetterOne runs a worker whose handler fails job i permanently and returns the dead
// letter.
func deadLetterOne(t *testing.T, rdb *redis.Client, keys Keys, i int) DeadLetter {
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
	rdb     *redis.Client
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
	newID, err := Replay(ctx, rdb, keys, d.ID, time.Hour)
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
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl <= 0 || ttl > time.Hour {
		t.Errorf("index TTL after replay = %v, want about 1h", ttl)
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
	if _, err := Replay(ctx, rdb, keys, d.ID, time.Hour); !errors.Is(err, ErrDeadLetterNotFound) {
		t.Errorf("second replay = %v, want ErrDeadLetterNotFound", err)
	}
}

// Issue 3: replay of a job that meanwhile succeeded (a duplicate delivery of the same
// job id completed after the dead letter). The replay runs it again and the handler's
// idempotency makes it a no-op: still one effect.
func TestReplayOfJobThatMeanwhileSucceeded(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 1)
	h := &effectHandler{rdb: rdb, effects: keys.Prefix + ":effects"}
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: h})
	enqueue(t, rdb, keys, message(1, nil)) // the duplicate that succeeds
	testenv.WaitFor(t, 10*time.Second, "the duplicate to succeed", func() bool { return h.runs.Load() == 1 })
	if _, err := Replay(ctx, rdb, keys, d.ID, time.Hour); err != nil {
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
			_, err := Replay(ctx, rdb, keys, d.ID, time.Hour)
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
func TestPurge(t *testing.T) {
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
	if _, err := Replay(ctx, rdb, keys, d.ID, time.Hour); !errors.Is(err, ErrDeadLetterNotFound) {
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
	if _, err := Replay(ctx, rdb, keys, d.ID, time.Hour); !errors.Is(err, ErrMalformed) {
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
	d1 := deadLetterOne(t, rdb, keys, 1)
	deadLetterOne(t, rdb, keys, 2)
	d3 := deadLetterOne(t, rdb, keys, 1)
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
	id, err := EnqueueTTL(ctx, rdb, keys, m, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	tenant, state, _, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || tenant != "acme" || state != StateQueued {
		t.Errorf("JobState = %q %q %v", tenant, state, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl <= 0 || ttl > time.Minute {
		t.Errorf("index TTL %v", ttl)
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
}

// Enqueueing a job id that has failed keeps its index alive as long as its dead letter.
func TestEnqueueOfFailedJobKeepsIndexWithoutTTL(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	deadLetterOne(t, rdb, keys, 1)
	if _, err := Enqueue(ctx, rdb, keys, message(1, nil)); err != nil {
		t.Fatal(err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); ttl != -1 {
		t.Errorf("index TTL %v after re-enqueue of a failed job, want none", ttl)
	}
}
