package queue

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// Issue 12, item 8: a job that waits in the stream longer than the index TTL still
// answers its tenant and state (GET says queued, not 404); once it is acknowledged the
// index gets the TTL.
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
	start(t, WorkerConfig{Redis: rdb, Keys: keys, JobTTL: ttl, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	testenv.WaitFor(t, 10*time.Second, "the index TTL", func() bool {
		pttl := rdb.PTTL(ctx, keys.Job(jobID(1))).Val()
		return pttl > 0 && pttl <= ttl
	})
	testenv.WaitFor(t, 10*time.Second, "the index to expire", func() bool {
		_, _, _, err := JobState(ctx, rdb, keys, jobID(1))
		return errors.Is(err, ErrUnknownJob)
	})
}

// A job enqueued again while its first entry runs: acknowledging the first entry leaves
// the index without a TTL (the second entry still waits); acknowledging the second gives
// it the TTL.
func TestAckOfAnOlderEntryKeepsTheIndexOfAQueuedJob(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	first := enqueue(t, rdb, keys, message(1, nil))[0]
	release := []chan struct{}{make(chan struct{}), make(chan struct{})}
	var runs counter
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 1, JobTTL: time.Hour, Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
		<-release[runs.inc("all")-1]
		return nil
	})})
	testenv.WaitFor(t, 10*time.Second, "the first run", func() bool { return runs.get("all") == 1 })
	second := enqueue(t, rdb, keys, message(1, nil))[0]
	close(release[0])
	testenv.WaitFor(t, 10*time.Second, "the first entry's acknowledgement", func() bool {
		return !slices.Contains(pendingIDs(t, rdb, keys, DefaultGroup), first)
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
