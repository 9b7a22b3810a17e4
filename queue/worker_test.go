package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

// docs/queue.md, "Failure cases": a consumer dies right after XREADGROUP. Its message is not claimable before
// ClaimIdle, and afterwards a live worker claims it with times_delivered == 2.
func TestDeadConsumerMessageReclaimedAfterClaimIdle(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const claimIdle = 500 * time.Millisecond
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	enqueue(t, rdb, keys, message(1, nil))
	readAt := time.Now()
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "dead", Streams: []string{keys.Stream(), ">"}, Count: 1}).Result()
	if err != nil || len(res[0].Messages) != 1 {
		t.Fatalf("xreadgroup: %v %v", res, err)
	}
	// The consumer "dies" here. Nobody may claim the message yet.
	msgs, _, err := rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: keys.Stream(), Group: DefaultGroup, Consumer: "thief", MinIdle: claimIdle, Start: "0-0"}).Result()
	if err != nil || len(msgs) != 0 {
		t.Fatalf("claimable before ClaimIdle: %v %v", msgs, err)
	}

	type run struct {
		at         time.Time
		deliveries int64
	}
	runs := make(chan run, 10)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: claimIdle, ClaimInterval: 20 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			runs <- run{time.Now(), j.Deliveries}
			return nil
		})})
	var r run
	select {
	case r = <-runs:
	case <-time.After(10 * time.Second):
		t.Fatal("the dead consumer's message was never reclaimed")
	}
	if waited := r.at.Sub(readAt); waited < claimIdle-5*time.Millisecond {
		t.Errorf("reclaimed %v after the read, before ClaimIdle %v", waited, claimIdle)
	}
	if r.deliveries != 2 {
		t.Errorf("deliveries = %d, want 2", r.deliveries)
	}
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	select {
	case r := <-runs:
		t.Errorf("ran again: %+v", r)
	case <-time.After(200 * time.Millisecond):
	}
}

// docs/queue.md, "Failure cases": an always-failing handler with MaxDeliveries=3 runs
// exactly three times, seeing attempts 1, 2 and 3, and its third failure dead-letters the
// message, atomically with its XACK and the job index.
func TestAlwaysFailingJobRunsMaxDeliveriesTimesThenDeadLetters(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	var seen []int64
	var mu sync.Mutex
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 3, ClaimIdle: 150 * time.Millisecond, ClaimInterval: 20 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			runs.Add(1)
			mu.Lock()
			seen = append(seen, j.Deliveries)
			mu.Unlock()
			return errors.New("model unavailable")
		})})
	ids := enqueue(t, rdb, keys, message(7, nil))
	testenv.WaitFor(t, 10*time.Second, "a dead letter", func() bool { return len(deadLetters(t, rdb, keys)) > 0 })
	time.Sleep(400 * time.Millisecond) // more than two more claim cycles: nothing else may happen
	if n := runs.Load(); n != 3 {
		t.Errorf("handler ran %d times, want 3", n)
	}
	mu.Lock()
	if !slices.Equal(seen, []int64{1, 2, 3}) {
		t.Errorf("deliveries seen by the handler = %v, want [1 2 3]", seen)
	}
	mu.Unlock()
	dead := deadLetters(t, rdb, keys)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	d := dead[0]
	if d.Reason != "failed 3 attempts; last error: model unavailable" || d.Deliveries != 3 || d.JobID != jobID(7) || d.Tenant != "acme" || d.OriginalID == ids[0] || d.Message == nil || string(d.Message.Payload) != `{"n":7}` {
		t.Errorf("dead letter = %+v", d)
	}
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Errorf("still pending: %v", p)
	}
	tenant, state, reason, err := JobState(context.Background(), rdb, keys, jobID(7))
	if err != nil || tenant != "acme" || state != StateFailed || reason != "failed 3 attempts; last error: model unavailable" {
		t.Errorf("JobState = %q %q %q %v", tenant, state, reason, err)
	}
	if ttl := rdb.PTTL(context.Background(), keys.Job(jobID(7))).Val(); ttl != -1 {
		t.Errorf("failed job index TTL = %v, want none (it must outlive the dead letter)", ttl)
	}
	if got := rdb.HGet(context.Background(), keys.Job(jobID(7)), "dead_id").Val(); got != d.ID {
		t.Errorf("index dead_id = %q, want %q", got, d.ID)
	}
}

// A permanent error dead-letters after one run.
func TestPermanentErrorDeadLettersAfterOneRun(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: 100 * time.Millisecond, ClaimInterval: 20 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			runs.Add(1)
			return fmt.Errorf("summarise: %w", Permanent(errors.New("400 context_length_exceeded")))
		})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "a dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	time.Sleep(300 * time.Millisecond)
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	d := deadLetters(t, rdb, keys)[0]
	if d.Reason != "permanent: summarise: 400 context_length_exceeded" || d.Deliveries != 1 {
		t.Errorf("dead letter reason %q deliveries %d", d.Reason, d.Deliveries)
	}
	if _, state, _, _ := JobState(context.Background(), rdb, keys, jobID(1)); state != StateFailed {
		t.Errorf("state = %q", state)
	}
}

// docs/queue.md, "Failure cases": the same job id enqueued twice (the API died after XADD and the client
// retried). Both entries are delivered; an idempotent handler makes one effect.
func TestSameJobEnqueuedTwiceMakesOneEffect(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs counter
	effects := keys.Prefix + ":effects"
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
		runs.inc(j.JobID)
		// The handler's dedup: the first run for a job id records the effect.
		return rdb.HSetNX(ctx, effects, j.JobID, j.ID).Err()
	})})
	ids := enqueue(t, rdb, keys, message(1, nil), message(1, nil))
	if ids[0] == ids[1] {
		t.Fatalf("two enqueues, one entry id %s", ids[0])
	}
	testenv.WaitFor(t, 10*time.Second, "two runs", func() bool { return runs.get(jobID(1)) == 2 })
	testenv.WaitFor(t, 5*time.Second, "acks", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	if n := rdb.HLen(context.Background(), effects).Val(); n != 1 {
		t.Errorf("%d effects, want 1", n)
	}
}

// Malformed messages are dead-lettered at once with a reason naming the fault; the
// handler never sees them and they are not redelivered.
func TestMalformedMessagesDeadLetteredWithReason(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	// A claim idle short enough that a redelivery loop shows within the wait below, long
	// enough that a loaded machine dead-letters each entry before anyone may reclaim it.
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: time.Second, ClaimInterval: 50 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error { runs.Add(1); return nil })})
	good := message(1, nil).Values()
	with := func(field string, value any) []any {
		out := slices.Clone(good)
		for i := 0; i < len(out); i += 2 {
			if out[i] == field {
				if value == nil {
					return slices.Delete(out, i, i+2)
				}
				out[i+1] = value
				return out
			}
		}
		return append(out, field, value)
	}
	cases := map[string][]any{
		`missing field "job_id"`:       with("job_id", nil),
		"payload is not valid JSON":    with("payload", "{not json"),
		`unknown version "3"`:          with("v", "3"),
		"unknown field(s) priority":    with("priority", "high"),
		"payload is not a JSON object": with("payload", `["a"]`),
	}
	for _, vals := range cases {
		if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), Values: vals}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "dead letters", func() bool { return len(deadLetters(t, rdb, keys)) == len(cases) })
	time.Sleep(1500 * time.Millisecond) // past a claim idle: no redelivery loop
	dead := deadLetters(t, rdb, keys)
	if len(dead) != len(cases) {
		t.Fatalf("%d dead letters, want %d", len(dead), len(cases))
	}
	for want := range cases {
		found := false
		for _, d := range dead {
			if d.Reason == "malformed: "+want {
				found = true
				if d.Deliveries != 1 || d.Message != nil || len(d.Raw) == 0 {
					t.Errorf("dead letter %+v: want 1 delivery, no message, raw fields", d)
				}
			}
		}
		if !found {
			t.Errorf("no dead letter with reason %q", "malformed: "+want)
		}
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times on malformed messages", n)
	}
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Errorf("still pending: %v", p)
	}
	// A malformed message with a valid job id still marks that job failed.
	if _, state, reason, _ := JobState(ctx, rdb, keys, jobID(1)); state != StateFailed || !strings.HasPrefix(reason, "malformed: ") {
		t.Errorf("JobState = %q %q", state, reason)
	}
}

// A panicking handler is recovered and treated as a transient failure.
func TestPanicIsRecoveredAndRetried(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	reg := prometheus.NewRegistry()
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: 150 * time.Millisecond, ClaimInterval: 20 * time.Millisecond, Registerer: reg,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			runs.Add(1)
			if j.Deliveries == 1 {
				panic("nil map")
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the retry", func() bool { return runs.Load() == 2 })
	// The acks metric counts after XACK returns (the pending list may be empty before).
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return metricValue(t, reg, "onceflow_queue_acks_total") >= 1 })
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Errorf("still pending: %v", p)
	}
	if got := metricValue(t, reg, "onceflow_queue_handler_duration_seconds", "outcome", "panic"); got != 1 {
		t.Errorf("panic outcomes = %v, want 1", got)
	}
	if got := metricValue(t, reg, "onceflow_queue_acks_total"); got != 1 {
		t.Errorf("acks = %v, want 1", got)
	}
	if len(deadLetters(t, rdb, keys)) != 0 {
		t.Error("a panic dead-lettered the job")
	}
}

// A handler that ends its goroutine without returning (runtime.Goexit, which t.FailNow
// calls in a test's handler) neither crashes the worker nor costs it a slot: the job
// stays pending and is run again once reclaimed, and the worker, of one slot, goes on
// to the next job.
func TestHandlerThatExitsItsGoroutineLosesNeitherTheJobNorTheSlot(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	reg := prometheus.NewRegistry()
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 1, ClaimIdle: 150 * time.Millisecond, ClaimInterval: 20 * time.Millisecond, Registerer: reg,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			runs.Add(1)
			if j.JobID == message(1, nil).JobID && j.Deliveries == 1 {
				runtime.Goexit()
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(1, nil))
	enqueue(t, rdb, keys, message(2, nil))
	testenv.WaitFor(t, 10*time.Second, "both jobs acknowledged, the first after its run again", func() bool {
		return runs.Load() == 3 && metricValue(t, reg, "onceflow_queue_acks_total") == 2
	})
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Errorf("still pending: %v", p)
	}
	if got := metricValue(t, reg, "onceflow_queue_handler_duration_seconds", "outcome", "panic"); got != 1 {
		t.Errorf("panic outcomes = %v, want 1 (the run that exited)", got)
	}
	if len(deadLetters(t, rdb, keys)) != 0 {
		t.Error("a run that exited its goroutine dead-lettered the job")
	}
}

// The worker never holds more messages than it has free slots.
func TestReadsOnlyAsManyMessagesAsFreeSlots(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	release := make(chan struct{})
	var started atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 2, Handler: HandlerFunc(func(context.Context, *Job) error {
		started.Add(1)
		<-release
		return nil
	})})
	for i := range 6 {
		enqueue(t, rdb, keys, message(i, nil))
	}
	testenv.WaitFor(t, 10*time.Second, "two running jobs", func() bool { return started.Load() == 2 })
	time.Sleep(300 * time.Millisecond) // several read loops (Block 50ms)
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 2 {
		t.Errorf("%d entries delivered while 2 slots are busy, want 2", len(p))
	}
	if n := started.Load(); n != 2 {
		t.Errorf("%d handlers started with Concurrency 2", n)
	}
	close(release)
	testenv.WaitFor(t, 10*time.Second, "all jobs", func() bool { return started.Load() == 6 })
	testenv.WaitFor(t, 5*time.Second, "acks", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	_ = w
}

// Issue 3: 1,000 jobs with Concurrency 256 and a handler that sleeps 200ms all complete,
// once each, in a small fraction of the serial time.
func TestThousandJobsRunConcurrently(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	const jobs, concurrency, sleep = 1000, 256, 200 * time.Millisecond
	var runs counter
	var cur, peak atomic.Int32
	done := make(chan struct{})
	var finished atomic.Int32
	handler := HandlerFunc(func(ctx context.Context, j *Job) error {
		n := cur.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		runs.inc(j.JobID)
		time.Sleep(sleep)
		cur.Add(-1)
		if finished.Add(1) == jobs {
			close(done)
		}
		return nil
	})
	// Enqueue first, so the measurement is the worker's alone.
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := g; i < jobs; i += 8 {
				if _, err := Enqueue(context.Background(), rdb, keys, message(i, nil)); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	began := time.Now()
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: concurrency, Handler: handler})
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("only %d of %d jobs finished", finished.Load(), jobs)
	}
	elapsed := time.Since(began)
	serial := jobs * sleep
	t.Logf("%d jobs in %v; serial %v; ratio %.4f; peak concurrency %d", jobs, elapsed, serial, float64(elapsed)/float64(serial), peak.Load())
	// Ideal is ceil(1000/256) = 4 rounds of 200ms = 0.4% of serial; allow 25x for a busy machine.
	if ratio := float64(elapsed) / float64(serial); ratio > 0.1 {
		t.Errorf("took %.1f%% of the serial time, want under 10%%", ratio*100)
	}
	if p := peak.Load(); p > concurrency {
		t.Errorf("peak concurrency %d above %d", p, concurrency)
	}
	if n := w.spawned.Load(); n > concurrency {
		t.Errorf("%d handler goroutines started for Concurrency %d", n, concurrency)
	}
	for i := range jobs {
		if n := runs.get(jobID(i)); n != 1 {
			t.Fatalf("job %d ran %d times", i, n)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "acks", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
}

// With a no-op handler, reads, delivery counts and acks are batched: far fewer than one
// Redis round trip per job (a per-message loop needs at least two).
func TestBatchedRoundTripsPerJob(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	const jobs = 2000
	pipe := rdb.Pipeline()
	for i := range jobs {
		pipe.XAdd(context.Background(), &redis.XAddArgs{Stream: keys.Stream(), Values: message(i, nil).Values()})
	}
	if _, err := pipe.Exec(context.Background()); err != nil {
		t.Fatal(err)
	}
	var rt roundtrip.Counter
	rdb.AddHook(&rt)
	var n atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 64, Handler: HandlerFunc(func(context.Context, *Job) error {
		n.Add(1)
		return nil
	})})
	testenv.WaitFor(t, 30*time.Second, "all jobs", func() bool { return n.Load() == jobs })
	w.stop(t) // flushes the last acks
	if g := w.spawned.Load(); g > 64 {
		t.Errorf("%d handler goroutines started for Concurrency 64", g)
	}
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Fatalf("%d still pending", len(p))
	}
	perJob := float64(rt.Redis()) / jobs
	t.Logf("%d round trips for %d jobs: %.3f per job", rt.Redis(), jobs, perJob)
	if perJob > 0.5 {
		t.Errorf("%.3f Redis round trips per job, want well under 1", perJob)
	}
}

// Reclaimed entries are claimed and get their delivery counts in one script per batch
// (reclaimScript): no XAUTOCLAIM whose XPENDING can then fail, leaving the claimed
// entries unrun with a delivery spent.
func TestReclaimClaimsAndCountsInOneStep(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	const n = 40
	for i := range n {
		enqueue(t, rdb, keys, message(i, nil))
	}
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "dead", Streams: []string{keys.Stream(), ">"}, Count: n}).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(120 * time.Millisecond)
	cmds := &cmdCounter{}
	rdb.AddHook(cmds)
	var mu sync.Mutex
	deliveries := map[int64]int{}
	var done atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 64, ClaimIdle: 100 * time.Millisecond, Handler: HandlerFunc(func(_ context.Context, j *Job) error {
		mu.Lock()
		deliveries[j.Deliveries]++
		mu.Unlock()
		done.Add(1)
		return nil
	})})
	testenv.WaitFor(t, 10*time.Second, "all reclaimed jobs", func() bool { return done.Load() == n })
	mu.Lock()
	defer mu.Unlock()
	if deliveries[2] != n {
		t.Errorf("deliveries seen = %v, want all %d at 2", deliveries, n)
	}
	if x, p := cmds.c.get("xautoclaim"), cmds.c.get("xpending"); x != 0 || p != 0 {
		t.Errorf("%d XAUTOCLAIM and %d XPENDING calls outside a script for one reclaimed batch, want 0 (one script)", x, p)
	}
}

// Graceful shutdown: jobs that finish within ShutdownTimeout are acknowledged; jobs still
// running are cancelled and handed back at once, as new entries any worker reads next,
// without spending an attempt; jobs never read stay in the stream unread.
func TestShutdownLosesNothingAndAcksNothingUnfinished(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var started, finished, cancelled sync.Map
	var nStarted atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 4, ShutdownTimeout: 700 * time.Millisecond,
		Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
			started.Store(j.ID, true)
			nStarted.Add(1)
			var p struct{ Finish bool }
			_ = json.Unmarshal(j.Payload, &p)
			if p.Finish {
				time.Sleep(300 * time.Millisecond) // finishes within the shutdown timeout
				finished.Store(j.ID, true)
				return nil
			}
			<-ctx.Done() // runs until the shutdown timeout cancels it
			cancelled.Store(j.ID, true)
			return ctx.Err()
		})})
	var ids []string
	for i := range 10 {
		ids = append(ids, enqueue(t, rdb, keys, message(i, map[string]bool{"finish": i%2 == 0}))...)
	}
	testenv.WaitFor(t, 10*time.Second, "four running jobs", func() bool { return nStarted.Load() == 4 })
	began := time.Now()
	w.stop(t)
	if took := time.Since(began); took < 700*time.Millisecond {
		t.Errorf("Run returned after %v, before the shutdown timeout, with jobs running", took)
	}
	var wantBack []string
	for _, id := range ids[:4] {
		if _, ok := started.Load(id); !ok {
			t.Fatalf("entry %s of the first four did not start", id)
		}
		_, fin := finished.Load(id)
		_, can := cancelled.Load(id)
		if fin == can {
			t.Errorf("entry %s: finished %v, cancelled %v", id, fin, can)
		}
		if can {
			wantBack = append(wantBack, id)
		}
	}
	if n := nStarted.Load(); n != 4 {
		t.Errorf("%d jobs started, want 4 (no reads after the signal)", n)
	}
	if got := pendingIDs(t, rdb, keys, DefaultGroup); len(got) != 0 {
		t.Errorf("pending after shutdown = %v, want none (the unfinished %v handed back)", got, wantBack)
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val(); n != 10+int64(len(wantBack)) {
		t.Errorf("stream length %d, want %d", n, 10+len(wantBack))
	}
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "next", Streams: []string{keys.Stream(), ">"}, Count: 100}).Result()
	if err != nil || len(res[0].Messages) != 6+len(wantBack) {
		t.Fatalf("undelivered entries after shutdown: %v %v, want %d", res, err, 6+len(wantBack))
	}
	// The handed-back jobs are the unfinished ones, with no attempt spent.
	back := map[string]bool{}
	for _, m := range res[0].Messages[6:] {
		msg, err := ParseMessage(m.Values)
		if err != nil || msg.Attempts != 0 {
			t.Errorf("handed-back entry %v: %+v %v, want no attempt spent", m.Values, msg, err)
		}
		back[msg.JobID] = true
	}
	for i, id := range ids[:4] {
		if slices.Contains(wantBack, id) && !back[jobID(i)] {
			t.Errorf("the unfinished job %s (entry %s) was not handed back: %v", jobID(i), id, back)
		}
	}
	if len(back) != len(wantBack) {
		t.Errorf("handed back %v, want %d distinct jobs", back, len(wantBack))
	}
}

// Run recreates the consumer group when someone deletes the stream under it.
func TestRecreatesDeletedGroup(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error { runs.Add(1); return nil })})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the first job", func() bool { return runs.Load() == 1 })
	if err := rdb.Del(context.Background(), keys.Stream()).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	enqueue(t, rdb, keys, message(2, nil))
	testenv.WaitFor(t, 10*time.Second, "a job after the stream was deleted", func() bool { return runs.Load() == 2 })
}

// A pending entry deleted from the stream (here by XDEL) is reported by XAUTOCLAIM;
// the worker logs and counts it rather than losing it silently.
func TestDeletedWhilePendingIsCounted(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, rdb, keys, message(1, nil))
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "dead", Streams: []string{keys.Stream(), ">"}, Count: 1}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.XDel(ctx, keys.Stream(), ids[0]).Err(); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: 50 * time.Millisecond, Registerer: reg,
		Handler: HandlerFunc(func(context.Context, *Job) error { t.Error("handler ran for a deleted entry"); return nil })})
	testenv.WaitFor(t, 10*time.Second, "the deleted entry to be counted", func() bool {
		return metricValue(t, reg, "onceflow_queue_deleted_while_pending_total") == 1
	})
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Errorf("still pending: %v", p)
	}
}

func TestNewWorkerValidates(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	h := HandlerFunc(func(context.Context, *Job) error { return nil })
	cases := map[string]WorkerConfig{
		"Redis is required":           {Keys: keys, Handler: h},
		"Handler is required":         {Redis: rdb, Keys: keys},
		"prefix is empty":             {Redis: rdb, Handler: h},
		"must be shorter":             {Redis: rdb, Keys: keys, Handler: h, ClaimIdle: time.Second, RenewInterval: time.Second},
		"contains a brace":            {Redis: rdb, Keys: Keys{Prefix: "p", Queue: "a}b"}, Handler: h},
		"Concurrency -1":              {Redis: rdb, Keys: keys, Handler: h, Concurrency: -1},
		"must not contain whitespace": {Redis: rdb, Keys: keys, Handler: h, Consumer: "a b"},
	}
	for want, cfg := range cases {
		if _, err := NewWorker(cfg); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("NewWorker: %v, want an error containing %q", err, want)
		}
	}
	w, err := NewWorker(WorkerConfig{Redis: rdb, Keys: keys, Handler: h, RenewInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	if w.cfg.Concurrency != 64 || w.cfg.ClaimIdle != 2*time.Minute || w.cfg.MaxDeliveries != 5 || w.cfg.Group != "workers" || w.cfg.RenewInterval != -1 {
		t.Errorf("defaults: %+v", w.cfg)
	}
	if a, b := ConsumerName(), ConsumerName(); a == b || strings.ContainsAny(a, " \t") {
		t.Errorf("consumer names %q, %q", a, b)
	}
}

func TestRunTwice(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	r := start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	testenv.WaitFor(t, 5*time.Second, "the first Run", r.started.Load)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.Run(ctx); !errors.Is(err, ErrWorkerStarted) {
		t.Errorf("second Run = %v", err)
	}
}

func TestCreateGroupIsIdempotent(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if err := CreateGroup(ctx, rdb, keys, "g"); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if n := len(rdb.XInfoGroups(ctx, keys.Stream()).Val()); n != 1 {
		t.Errorf("%d groups", n)
	}
	err := rdb.XGroupCreate(ctx, keys.Stream(), "g", "0").Err()
	if !isBusyGroup(err) || isBusyGroup(errors.New("BUSYGROUP lookalike")) || isBusyGroup(nil) {
		t.Errorf("isBusyGroup misclassifies %v", err)
	}
}

// A worker started while Redis is unreachable keeps retrying and still stops cleanly.
func TestRunWithRedisDownStopsOnCancel(t *testing.T) {
	t.Parallel()
	rdb, err := connect.Redis(fmt.Sprintf("redis://127.0.0.1:%d/0", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	r := start(t, WorkerConfig{Redis: rdb, Keys: Keys{Prefix: "p", Queue: "q"}, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	time.Sleep(300 * time.Millisecond)
	r.stop(t)
}

// The worker rides out a Redis restart: it logs, backs off and carries on.
func TestWorkerSurvivesRedisRestart(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	keys := Keys{Prefix: "restart", Queue: "summaries"}
	var runs counter
	reg := prometheus.NewRegistry()
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Registerer: reg, Handler: HandlerFunc(func(_ context.Context, j *Job) error {
		runs.inc(j.JobID)
		return nil
	})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the first job", func() bool { return runs.get(jobID(1)) == 1 })
	srv.Stop()
	testenv.WaitFor(t, 10*time.Second, "a counted read error", func() bool { return metricValue(t, reg, "onceflow_queue_redis_errors_total", "op", "read") > 0 })
	srv.Start()
	enqueue(t, rdb, keys, message(2, nil))
	testenv.WaitFor(t, 20*time.Second, "a job after the restart", func() bool { return runs.get(jobID(2)) == 1 })
	if runs.get(jobID(1)) != 1 {
		t.Errorf("job 1 ran %d times", runs.get(jobID(1)))
	}
}

// msgCounter is a slog.Handler that counts records by message and forwards them to next.
type msgCounter struct {
	next slog.Handler
	mu   *sync.Mutex
	n    map[string]int
}

func newMsgCounter(next slog.Handler) *msgCounter {
	return &msgCounter{next: next, mu: &sync.Mutex{}, n: map[string]int{}}
}

func (h *msgCounter) Enabled(ctx context.Context, l slog.Level) bool { return true }

func (h *msgCounter) Handle(ctx context.Context, r slog.Record) error {
	h.mu.Lock()
	h.n[r.Message]++
	h.mu.Unlock()
	return h.next.Handle(ctx, r)
}

func (h *msgCounter) WithAttrs(as []slog.Attr) slog.Handler {
	return &msgCounter{next: h.next.WithAttrs(as), mu: h.mu, n: h.n}
}

func (h *msgCounter) WithGroup(g string) slog.Handler {
	return &msgCounter{next: h.next.WithGroup(g), mu: h.mu, n: h.n}
}

func (h *msgCounter) count(prefix string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	total := 0
	for m, n := range h.n {
		if strings.HasPrefix(m, prefix) {
			total += n
		}
	}
	return total
}

// A handler reports its dependency down (ErrUnavailable, which spends no attempt) and
// Redis stays down longer than a settlement attempt's 5 s timeout, through several of
// its retries and many times ClaimIdle: the outage spends no attempt. With
// MaxDeliveries 1 the job runs again once Redis is back and is not dead-lettered as
// "failed 1 attempts (the last never reported)".
func TestLongRedisOutageDuringHandBackSpendsNoAttempt(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out an 8 s Redis outage")
	}
	t.Parallel()
	srv, rdb := privateRedis(t)
	keys := Keys{Prefix: "outage", Queue: "summaries"}
	down := make(chan struct{})
	var runs atomic.Int32
	var lastDeliveries atomic.Int64
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 1, ClaimIdle: 500 * time.Millisecond,
		Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
			lastDeliveries.Store(j.Deliveries)
			if runs.Add(1) == 1 {
				<-down
				return fmt.Errorf("redis: %w", ErrUnavailable)
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(2, nil))
	testenv.WaitFor(t, 10*time.Second, "the first run", func() bool { return runs.Load() == 1 })
	srv.Stop()
	close(down)
	time.Sleep(8 * time.Second) // settle's retries go on as long as the worker runs
	srv.Start()
	testenv.WaitFor(t, 60*time.Second, "the job to run again or be dead-lettered", func() bool {
		if runs.Load() >= 2 {
			return true
		}
		n, err := rdb.XLen(context.Background(), keys.Dead()).Result()
		return err == nil && n > 0
	})
	if d := deadLetters(t, rdb, keys); len(d) != 0 {
		t.Errorf("dead-lettered after an outage: %q (runs %d), want the job to run again: an outage spends no attempt", d[0].Reason, runs.Load())
	}
	if runs.Load() < 2 {
		t.Errorf("%d runs, want a second run after Redis came back", runs.Load())
	}
}

// A handler that ignores its context past MaxRunTime, on a worker that is the only one
// (one `onceflow run` process, a common deployment).
func TestHungRun(t *testing.T) {
	t.Parallel()
	// The worker's reclaim scan finds the entry whose lease it let go still running here:
	// "reclaimed an entry this worker is still running" is logged a few times, not on every
	// ClaimInterval for as long as the handler hangs.
	t.Run("is reported a few times, not on every reclaim scan", func(t *testing.T) {
		t.Parallel()
		rdb, keys := setup(t)
		logs := newMsgCounter(testenv.Logger(t).Handler())
		stuck := make(chan struct{})
		var runs atomic.Int32
		start(t, WorkerConfig{Redis: rdb, Keys: keys, Logger: slog.New(logs), MaxRunTime: 100 * time.Millisecond,
			ClaimIdle: 300 * time.Millisecond, RenewInterval: 50 * time.Millisecond, ClaimInterval: 50 * time.Millisecond,
			Handler: HandlerFunc(func(context.Context, *Job) error {
				runs.Add(1)
				<-stuck
				return nil
			})})
		t.Cleanup(func() { close(stuck) })
		enqueue(t, rdb, keys, message(3, nil))
		testenv.WaitFor(t, 10*time.Second, "the run", func() bool { return runs.Load() == 1 })
		time.Sleep(4 * time.Second)
		if n := logs.count("reclaimed an entry this worker is still running"); n > 3 {
			t.Errorf("the hung run was reported %d times in 4s, want at most a few: it is logged on every reclaim scan", n)
		}
	})
	// Past MaxRunTime + ClaimIdle the job's next attempt runs on this worker (no other takes
	// it), the hung run counted as a failed attempt, rather than the worker undoing its own
	// claim for ever.
	t.Run("is retried on the same worker", func(t *testing.T) {
		t.Parallel()
		rdb, keys := setup(t)
		stuck := make(chan struct{})
		var log runLog
		start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxRunTime: 100 * time.Millisecond, ClaimIdle: 300 * time.Millisecond,
			RenewInterval: 50 * time.Millisecond, ClaimInterval: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
			Handler: HandlerFunc(func(_ context.Context, j *Job) error {
				if log.add(j) == 1 {
					<-stuck
				}
				return nil
			})})
		t.Cleanup(func() { close(stuck) })
		enqueue(t, rdb, keys, message(10, nil))
		testenv.WaitFor(t, 10*time.Second, "a second run (attempt 2) after MaxRunTime + ClaimIdle", func() bool { at, _ := log.snapshot(); return len(at) >= 2 })
	})
}

// An entry whose attempts field is forged huge (any positive decimal that fits an int)
// is refused as malformed (dead-lettered with a reason) or treated as spent: the
// "spent" check (attempts + deliveries - 1 >= MaxDeliveries) never overflows into
// running the handler, which never sees a negative Job.Deliveries.
func TestForgedHugeAttemptsNeverRunTheHandler(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	m := message(5, nil)
	values := append(m.Values(), fieldAttempts, strconv.FormatInt(math.MaxInt64, 10))
	id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), Values: values}).Result()
	if err != nil {
		t.Fatal(err)
	}
	// Delivered once to a consumer that died: the next delivery is its second.
	if err := rdb.XReadGroup(ctx, readArgs(keys, "dead", 1)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Do(ctx, "XCLAIM", keys.Stream(), DefaultGroup, "dead", 0, id, "IDLE", 3_600_000, "RETRYCOUNT", 1, "JUSTID").Err(); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	var seen atomic.Int64
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: 50 * time.Millisecond, Handler: HandlerFunc(func(_ context.Context, j *Job) error {
		runs.Add(1)
		seen.Store(j.Deliveries)
		return nil
	})})
	testenv.WaitFor(t, 10*time.Second, "the entry to be settled", func() bool {
		return runs.Load() > 0 || len(deadLetters(t, rdb, keys)) > 0
	})
	if n := runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times with Job.Deliveries = %d for an entry claiming %d attempts, want it never run (dead-lettered as spent or malformed)", n, seen.Load(), int64(math.MaxInt64))
	}
}

// A run that passed MaxRunTime and still returned nil succeeded: its effects are
// committed, so it is acknowledged (docs/queue.md, "Handler outcomes"). One that
// returned an error is a failed attempt even when the error is Unavailable.
func TestOverrunRunSucceedsWithNilAndFailsWithAnError(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var log runLog
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxRunTime: 100 * time.Millisecond, ClaimIdle: time.Hour,
		Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
			switch log.add(j) {
			case 1: // ignores its context, then reports success
				time.Sleep(300 * time.Millisecond)
				return nil
			case 2: // overruns, then says a dependency is down
				<-ctx.Done()
				return Unavailable(ctx.Err())
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(8, nil), message(9, nil))
	testenv.WaitFor(t, 10*time.Second, "three runs", func() bool { at, _ := log.snapshot(); return len(at) >= 3 })
	time.Sleep(time.Second)
	_, tries := log.snapshot()
	if !slices.Equal(tries, []int64{1, 1, 2}) {
		t.Errorf("runs saw attempts %v, want [1 1 2]: the overrun success acknowledged, the overrun Unavailable a failed attempt", tries)
	}
}

// The dead-letter reason of a job whose last attempt failed ("failed N attempts; last
// error: ...") is clipped as the index's last_error is: a handler error that carries a
// big response body (1 MiB here) is not stored whole in the dead letter, in the index's
// reason (which the API's GET returns) or in the log.
func TestDeadLetterReasonIsClipped(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	huge := strings.Repeat("x", 1<<20)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 1, Logger: slog.New(slog.DiscardHandler),
		Handler: HandlerFunc(func(context.Context, *Job) error { return errors.New("provider said: " + huge) })})
	enqueue(t, rdb, keys, message(9, nil))
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	d := deadLetters(t, rdb, keys)[0]
	_, _, reason, err := JobState(context.Background(), rdb, keys, jobID(9))
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Reason) > 4*maxLastErrorLen || len(reason) > 4*maxLastErrorLen {
		t.Errorf("dead-letter reason is %d bytes, the index's %d, want them clipped near %d like last_error", len(d.Reason), len(reason), maxLastErrorLen)
	}
}

// SIGTERM while Redis is down: at the shutdown timeout the handlers are cancelled and
// each returning job is handed back, a settlement that retries while Redis does not
// answer. Run returns within about ShutdownTimeout + grace + one abandonTimeout however
// many jobs were in flight (not one after another), their entries left pending to be
// reclaimed.
func TestShutdownDuringRedisOutageIsBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a Redis outage of seconds")
	}
	t.Parallel()
	srv, rdb := privateRedis(t)
	keys := Keys{Prefix: "outage", Queue: "summaries"}
	var running atomic.Int32
	w, err := NewWorker(WorkerConfig{Redis: rdb, Keys: keys, Concurrency: 4, ShutdownTimeout: 200 * time.Millisecond,
		Block: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
		Handler: HandlerFunc(func(ctx context.Context, _ *Job) error {
			running.Add(1)
			<-ctx.Done() // honours the cancellation
			return ctx.Err()
		})})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		enqueue(t, rdb, keys, message(40+i, nil))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }() // not joined on failure: it may outlive the test by minutes
	testenv.WaitFor(t, 10*time.Second, "four runs", func() bool { return running.Load() == 4 })
	srv.Stop()
	cancel()
	start := time.Now()
	const bound = 20 * time.Second // 200ms + 200ms grace + the 5s hand-back bound (abandonTimeout), with margin
	select {
	case <-done:
	case <-time.After(bound):
		t.Errorf("Run has not returned %v after the signal with 4 jobs in flight and Redis down; want about one abandonTimeout (%v)", time.Since(start).Round(time.Second), abandonTimeout)
	}
}

// replyTree decodes fuzz bytes into a Redis reply as go-redis returns a script's: nested
// []any of strings, int64s and nils.
func replyTree(data []byte, depth int) (any, []byte) {
	if len(data) == 0 {
		return nil, data
	}
	b, data := data[0], data[1:]
	switch b % 4 {
	case 0:
		n := min(int(b>>2)%8, len(data))
		return string(data[:n]), data[n:]
	case 1:
		return int64(b>>2) - 20, data
	case 2:
		if depth > 4 {
			return nil, data
		}
		out := make([]any, int(b>>2)%6)
		for i := range out {
			out[i], data = replyTree(data, depth+1)
		}
		return out, data
	}
	return nil, data
}

// parseReclaim takes any reply without panicking, and what it accepts pairs each
// claimed entry with one delivery count.
func FuzzParseReclaim(f *testing.F) {
	f.Add([]byte{4*4 + 2, 0, 2 + 4, 4*2 + 2, 4 + 0, 'a', 4*2 + 2, 4 * 3, '1', '-', '1', 2, 2, 4*1 + 2, 5})
	f.Add([]byte{2})
	f.Add([]byte{4*4 + 2, 1, 3, 3, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		tree, _ := replyTree(data, 0)
		res, _ := tree.([]any)
		cursor, msgs, deleted, counts, err := parseReclaim(res)
		if err != nil {
			if cursor != "" || msgs != nil || deleted != nil || counts != nil {
				t.Fatalf("parseReclaim failed (%v) but returned %q %v %v %v", err, cursor, msgs, deleted, counts)
			}
			return
		}
		if len(msgs) != len(counts) {
			t.Fatalf("%d entries with %d counts", len(msgs), len(counts))
		}
	})
}
