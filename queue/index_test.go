package queue

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

// Issue 12, item 8: a job that waits in the stream longer than the index TTL still
// answers its tenant and state (GET says queued, not 404); once it left the stream
// (acknowledged, then trimmed by the worker's maintenance) the index gets the TTL.
func TestJobIndexOutlivesTTLWhileQueued(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const ttl = time.Second // the workers' JobTTL
	enqueue(t, rdb, keys, message(1, nil))
	time.Sleep(ttl + ttl/2) // no worker: the job waits longer than the TTL
	tenant, state, _, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || tenant != "acme" || state != StateQueued {
		t.Fatalf("JobState of a job waiting longer than the index TTL = %q %q %v, want acme queued", tenant, state, err)
	}
	if pttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); pttl != -1 {
		t.Errorf("index TTL %v while queued, want none", pttl)
	}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, JobTTL: ttl, TrimInterval: 50 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	testenv.WaitFor(t, 10*time.Second, "the index TTL", func() bool {
		pttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val()
		return pttl > 0 && pttl <= ttl
	})
	testenv.WaitFor(t, 10*time.Second, "the index to expire", func() bool {
		_, _, _, err := JobState(ctx, rdb, keys, jobID(1))
		return errors.Is(err, ErrUnknownJob)
	})
}

// addOldDeadLetter writes a dead letter of job i with entry id ms-0 (its failure time)
// and the job index pointing at it, as the dead-letter script does.
func addOldDeadLetter(t *testing.T, rdb redis.UniversalClient, keys Keys, i int, ms int64) string {
	t.Helper()
	ctx := context.Background()
	id := strconv.FormatInt(ms, 10) + "-0"
	rec := append(message(i, nil).Values(), deadReason, "permanent: old", deadOriginalID, "1-0",
		deadFailedAt, strconv.FormatInt(ms, 10), deadDeliveries, "1")
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Dead(), ID: id, Values: rec}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, keys.Job(jobID(i)), "tenant", "acme", "state", StateFailed, "reason", "permanent: old",
		"dead_id", id, "failed_at", strconv.FormatInt(ms, 10)).Err(); err != nil {
		t.Fatal(err)
	}
	return id
}

// Issue 12, item 8: the worker's maintenance trims dead letters older than the retention
// (30 days by default) and gives their job indexes the TTL, so an index does not keep
// pointing at a dead letter that no longer exists; younger dead letters stay.
func TestWorkerTrimsDeadLettersOlderThanRetention(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	old := addOldDeadLetter(t, rdb, keys, 1, time.Now().Add(-31*24*time.Hour).UnixMilli())
	young := deadLetterOne(t, rdb, keys, 2)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, TrimInterval: 50 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	testenv.WaitFor(t, 5*time.Second, "the old dead letter to be trimmed", func() bool {
		return len(rdb.XRange(ctx, keys.Dead(), old, old).Val()) == 0
	})
	if d := deadLetters(t, rdb, keys); len(d) != 1 || d[0].ID != young.ID {
		t.Fatalf("dead letters %+v, want only the young one %s", d, young.ID)
	}
	_, state, _, err := JobState(ctx, rdb, keys, jobID(1))
	if err != nil || state != StateFailed {
		t.Errorf("trimmed job's state %q %v, want failed until its index expires", state, err)
	}
	if f := rdb.HGet(ctx, keys.Job(jobID(1)), "dead_id").Val(); f != "" {
		t.Errorf("trimmed job's index still points at dead letter %q", f)
	}
	if pttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); pttl <= 0 || pttl > DefaultJobTTL {
		t.Errorf("trimmed job's index TTL %v, want at most DefaultJobTTL", pttl)
	}
	if pttl := rdb.PTTL(ctx, keys.Job(jobID(2))).Val(); pttl != -1 {
		t.Errorf("dead-lettered job's index TTL %v, want none", pttl)
	}
}

// A job enqueued again while its first entry runs: removing the first entry from the
// stream leaves the index without a TTL (the second entry still waits); removing the
// second gives it the TTL.
func TestAckOfAnOlderEntryKeepsTheIndexOfAQueuedJob(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	first := enqueue(t, rdb, keys, message(1, nil))[0]
	release := []chan struct{}{make(chan struct{}), make(chan struct{})}
	var runs counter
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 1, JobTTL: time.Hour, TrimInterval: 50 * time.Millisecond, Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
		<-release[runs.inc("all")-1]
		return nil
	})})
	testenv.WaitFor(t, 10*time.Second, "the first run", func() bool { return runs.get("all") == 1 })
	second := enqueue(t, rdb, keys, message(1, nil))[0]
	close(release[0])
	testenv.WaitFor(t, 10*time.Second, "the first entry's acknowledgement and trim", func() bool {
		return !slices.Contains(pendingIDs(t, rdb, keys, DefaultGroup), first) && len(rdb.XRange(ctx, keys.Stream(), first, first).Val()) == 0
	})
	if pttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val(); pttl != -1 {
		t.Errorf("index TTL %v after the first entry's ack while the second waits, want none", pttl)
	}
	close(release[1])
	testenv.WaitFor(t, 10*time.Second, "the second run's acknowledgement", func() bool {
		return runs.get("all") == 2 && len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0
	})
	testenv.WaitFor(t, 5*time.Second, "the index TTL", func() bool {
		pttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val()
		return pttl > 0 && pttl <= time.Hour
	})
	if e := rdb.HGet(ctx, keys.Job(jobID(1)), "entry").Val(); e != second {
		t.Errorf("index entry %q, want the latest %s", e, second)
	}
}

// TrimDead deletes dead letters older than its threshold, in batches, and releases the
// indexes that point at them; an index pointing elsewhere, and younger dead letters, are
// left alone.
func TestTrimDeadInBatches(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const old = 2*trimDeadBatch + 7
	base := time.Now().Add(-48 * time.Hour).UnixMilli()
	pipe := rdb.Pipeline()
	for i := range old {
		id := strconv.FormatInt(base+int64(i), 10) + "-0"
		rec := append(message(i, nil).Values(), deadReason, "permanent: old", deadOriginalID, "1-0", deadFailedAt, strconv.FormatInt(base+int64(i), 10), deadDeliveries, "1")
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: keys.Dead(), ID: id, Values: rec})
		dead := id
		if i == 3 {
			dead = "9999999999999-0" // the job failed again meanwhile: its index points elsewhere
		}
		pipe.HSet(ctx, keys.Job(jobID(i)), "tenant", "acme", "state", StateFailed, "dead_id", dead)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	young := deadLetterOne(t, rdb, keys, old+1)
	n, err := TrimDead(ctx, rdb, keys, time.Now().Add(-24*time.Hour), time.Minute)
	if err != nil || n != old {
		t.Fatalf("TrimDead = %d, %v; want %d", n, err, old)
	}
	if d := deadLetters(t, rdb, keys); len(d) != 1 || d[0].ID != young.ID {
		t.Fatalf("%d dead letters left, want only the young one", len(d))
	}
	for _, i := range []int{0, trimDeadBatch - 1, trimDeadBatch, old - 1} {
		if pttl := rdb.PTTL(ctx, keys.Job(jobID(i))).Val(); pttl <= 0 || pttl > time.Minute {
			t.Errorf("job %d: index TTL %v, want at most 1m", i, pttl)
		}
		if f := rdb.HGet(ctx, keys.Job(jobID(i)), "dead_id").Val(); f != "" {
			t.Errorf("job %d: index still points at %s", i, f)
		}
	}
	if pttl := rdb.PTTL(ctx, keys.Job(jobID(3))).Val(); pttl != -1 {
		t.Errorf("an index pointing at another dead letter got TTL %v, want none", pttl)
	}
	if pttl := rdb.PTTL(ctx, keys.Job(jobID(old+1))).Val(); pttl != -1 {
		t.Errorf("the young dead letter's index TTL %v, want none", pttl)
	}
	if n, err := TrimDead(ctx, rdb, keys, time.Now().Add(-24*time.Hour), time.Minute); err != nil || n != 0 {
		t.Errorf("second TrimDead = %d, %v; want 0", n, err)
	}
}

// A job id is one tenant's: an enqueue of it for another tenant (or none) is refused with
// ErrJobIDTaken before anything is written, and the index keeps its owner and entry;
// the owner enqueues it again, and an id without an index is anyone's.
func TestEnqueueRefusesAnotherTenantsJobID(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	first := enqueue(t, rdb, keys, message(1, nil))[0]
	for _, tenant := range []string{"globex", ""} {
		m := message(1, nil)
		m.Tenant, m.Kind = tenant, "k" // a message without a tenant needs a kind
		if _, err := Enqueue(ctx, rdb, keys, m); !errors.Is(err, ErrJobIDTaken) {
			t.Fatalf("enqueue of acme's job id for %q: %v, want ErrJobIDTaken", tenant, err)
		}
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val(); n != 1 {
		t.Fatalf("%d entries, want acme's only", n)
	}
	if f := rdb.HMGet(ctx, keys.Job(jobID(1)), "tenant", "entry").Val(); f[0] != "acme" || f[1] != first {
		t.Fatalf("index %v after the refusals, want acme's, entry %s", f, first)
	}
	enqueue(t, rdb, keys, message(1, nil))
	m := message(2, nil)
	m.Tenant = "globex"
	enqueue(t, rdb, keys, m)
	if n := rdb.XLen(ctx, keys.Stream()).Val(); n != 3 {
		t.Fatalf("%d entries, want 3", n)
	}
}
