package queue

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/retry"
)

// runLog records a handler's runs: when each started and the attempt it saw.
type runLog struct {
	mu    sync.Mutex
	at    []time.Time
	tries []int64
}

func (l *runLog) add(j *Job) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.at = append(l.at, time.Now())
	l.tries = append(l.tries, j.Deliveries)
	return len(l.at)
}

func (l *runLog) snapshot() ([]time.Time, []int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.at), slices.Clone(l.tries)
}

// A failed run leaves the pending list at once: its job waits in the scheduled set
// (the index says scheduled, with its time) for a full-jitter delay, then runs again as
// attempt 2 on a new entry, long before ClaimIdle.
func TestFailureSchedulesTheNextAttemptAndReleasesTheEntry(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var log runLog
	release := make(chan struct{})
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: time.Hour, RetryBase: 400 * time.Millisecond, RetryMax: 400 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			if log.add(j) == 1 {
				return errors.New("blip")
			}
			<-release
			return nil
		})})
	ids := enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the first run's settlement", func() bool {
		at, _ := log.snapshot()
		return rdb.ZCard(ctx, keys.Scheduled()).Val() == 1 || len(at) > 1
	})
	if slices.Contains(pendingIDs(t, rdb, keys, DefaultGroup), ids[0]) {
		t.Errorf("the failed entry %s is still pending: it should have left the worker at once", ids[0])
	}
	testenv.WaitFor(t, 10*time.Second, "the second run", func() bool { _, tries := log.snapshot(); return len(tries) == 2 })
	close(release)
	at, tries := log.snapshot()
	if !slices.Equal(tries, []int64{1, 2}) {
		t.Errorf("attempts seen = %v, want [1 2]", tries)
	}
	if gap := at[1].Sub(at[0]); gap > 400*time.Millisecond+2*time.Second {
		t.Errorf("second attempt %v after the first, want within the 400ms retry cap (plus scheduling slack), not after ClaimIdle (1h)", gap)
	}
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	if n := rdb.ZCard(ctx, keys.Scheduled()).Val(); n != 0 {
		t.Errorf("%d jobs left in the scheduled set", n)
	}
	if n := rdb.HLen(ctx, keys.ScheduledData()).Val(); n != 0 {
		t.Errorf("%d entries left in the scheduled data", n)
	}
}

// While a job waits for its retry, its index says scheduled with the time, and
// JobState reports it; the entry that waits carries the attempt spent.
func TestScheduledJobIndexAndEntry(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, RetryBase: time.Hour, RetryMax: time.Hour,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			runs.Add(1)
			return retry.RetryAfter(time.Hour, errors.New("later"))
		})})
	enqueue(t, rdb, keys, message(2, nil))
	testenv.WaitFor(t, 10*time.Second, "the retry to be scheduled", func() bool { return rdb.ZCard(ctx, keys.Scheduled()).Val() == 1 })
	ix, err := ReadJobIndex(ctx, rdb, keys, jobID(2))
	if err != nil || ix.State != StateScheduled || ix.Entry != "" {
		t.Fatalf("index = %+v %v, want state scheduled without an entry", ix, err)
	}
	runAt, err := rdb.HGet(ctx, keys.Job(jobID(2)), "run_at").Int64()
	if err != nil || time.Until(time.UnixMilli(runAt)) < 50*time.Minute {
		t.Errorf("run_at %v %v, want about an hour from now (the Retry-After)", time.UnixMilli(runAt), err)
	}
	list, err := ListScheduled(ctx, rdb, keys, 10)
	if err != nil || len(list) != 1 || list[0].JobID != jobID(2) {
		t.Fatalf("ListScheduled = %+v %v", list, err)
	}
	raw, err := rdb.HGet(ctx, keys.ScheduledData(), list[0].Member).Result()
	if err != nil || !strings.Contains(raw, `"attempts","1"`) || !strings.Contains(raw, jobID(2)) {
		t.Errorf("scheduled entry %q %v, want it to carry attempts 1", raw, err)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("%d runs, want 1", n)
	}
}

// A failure's Retry-After (retry.RetryAfter, a provider's 429) sets the wait before the
// next attempt, not the jitter draw; the attempt is spent.
func TestRetryAfterSetsTheWait(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var log runLog
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: time.Hour, RetryBase: time.Millisecond, RetryMax: time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			if log.add(j) == 1 {
				return retry.RetryAfter(700*time.Millisecond, errors.New("429"))
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(3, nil))
	testenv.WaitFor(t, 10*time.Second, "the second run", func() bool { at, _ := log.snapshot(); return len(at) == 2 })
	at, tries := log.snapshot()
	if gap := at[1].Sub(at[0]); gap < 650*time.Millisecond {
		t.Errorf("second attempt %v after the first, want at least the 700ms Retry-After", gap)
	}
	if !slices.Equal(tries, []int64{1, 2}) {
		t.Errorf("attempts = %v, want [1 2] (a Retry-After spends an attempt)", tries)
	}
}

// A handler that snoozes runs again after the delay without spending an attempt: with
// MaxDeliveries 1, six snoozes then a success, never dead-lettered, each run attempt 1.
func TestSnoozeSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var log runLog
	var ok atomic.Bool
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 1,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			if log.add(j) <= 6 {
				return Snooze(30 * time.Millisecond)
			}
			ok.Store(true)
			return nil
		})})
	enqueue(t, rdb, keys, message(4, nil))
	testenv.WaitFor(t, 20*time.Second, "the job to succeed", ok.Load)
	_, tries := log.snapshot()
	if len(tries) != 7 || slices.ContainsFunc(tries, func(n int64) bool { return n != 1 }) {
		t.Errorf("attempts seen = %v, want seven runs of attempt 1", tries)
	}
	if d := deadLetters(t, rdb, keys); len(d) != 0 {
		t.Errorf("dead letters: %+v", d)
	}
}

// A limiter's wait (*retry.WaitError) is a snooze: no attempt is spent, the job waits in
// the scheduled set, and its index says what for while it waits (and no longer once it
// runs again).
func TestWaitErrorWaitsWithItsReason(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var log runLog
	var ok atomic.Bool
	release := make(chan struct{})
	const reason = "token budget of tenant acme is spent for today"
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 1,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			if log.add(j) <= 3 {
				return fmt.Errorf("model step: %w", &retry.WaitError{Delay: 400 * time.Millisecond, Reason: reason})
			}
			<-release
			ok.Store(true)
			return nil
		})})
	enqueue(t, rdb, keys, message(6, nil))
	testenv.WaitFor(t, 10*time.Second, "the first wait", func() bool {
		ix, err := ReadJobIndex(ctx, rdb, keys, jobID(6))
		return err == nil && ix.State == StateScheduled
	})
	ix, err := ReadJobIndex(ctx, rdb, keys, jobID(6))
	if err != nil || ix.Waiting != reason || ix.RunAt.IsZero() {
		t.Fatalf("index while waiting = %+v %v, want the reason and its time", ix, err)
	}
	testenv.WaitFor(t, 20*time.Second, "the fourth run", func() bool { a, _ := log.snapshot(); return len(a) == 4 })
	ix, err = ReadJobIndex(ctx, rdb, keys, jobID(6))
	if err != nil || ix.Waiting != "" || ix.State != StateQueued {
		t.Fatalf("index while running again = %+v %v, want queued without a reason", ix, err)
	}
	close(release)
	testenv.WaitFor(t, 10*time.Second, "the job to succeed", ok.Load)
	_, tries := log.snapshot()
	if len(tries) != 4 || slices.ContainsFunc(tries, func(n int64) bool { return n != 1 }) {
		t.Errorf("attempts seen = %v, want four runs of attempt 1 (a wait spends none, MaxDeliveries is 1)", tries)
	}
	if d := deadLetters(t, rdb, keys); len(d) != 0 {
		t.Errorf("dead letters: %+v", d)
	}
}

// EnqueueAt: the job waits in the scheduled set with its index saying scheduled, runs
// once at its time (not before), and its index then says queued.
func TestEnqueueAtRunsAtItsTime(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var log runLog
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(_ context.Context, j *Job) error { log.add(j); return nil })})
	at := time.Now().Add(1500 * time.Millisecond)
	if _, err := EnqueueAt(ctx, rdb, keys, message(5, nil), at); err != nil {
		t.Fatal(err)
	}
	ix, err := ReadJobIndex(ctx, rdb, keys, jobID(5))
	if err != nil || ix.State != StateScheduled || ix.Tenant != "acme" {
		t.Fatalf("index before its time = %+v %v", ix, err)
	}
	testenv.WaitFor(t, 10*time.Second, "the run", func() bool { a, _ := log.snapshot(); return len(a) == 1 })
	runs, _ := log.snapshot()
	if runs[0].Before(at.Add(-20 * time.Millisecond)) { // Redis' clock is this machine's
		t.Errorf("ran at %v, before its time %v", runs[0], at)
	}
	time.Sleep(300 * time.Millisecond)
	if a, _ := log.snapshot(); len(a) != 1 {
		t.Errorf("%d runs, want 1", len(a))
	}
	if ix, err := ReadJobIndex(ctx, rdb, keys, jobID(5)); err != nil || ix.State != StateQueued || ix.Entry == "" {
		t.Errorf("index after the move = %+v %v, want queued with its entry", ix, err)
	}
	// EnqueueAt checks the job id's tenant as Enqueue does, and writes nothing then.
	other := message(5, nil)
	other.Tenant = "globex"
	if _, err := EnqueueAt(ctx, rdb, keys, other, time.Now()); !errors.Is(err, ErrJobIDTaken) {
		t.Errorf("EnqueueAt of another tenant's job id: %v, want ErrJobIDTaken", err)
	}
	if n := rdb.ZCard(ctx, keys.Scheduled()).Val(); n != 0 {
		t.Errorf("refused EnqueueAt left %d scheduled jobs", n)
	}
}

// The scheduled set keeps every byte of an entry: a payload with escapes, non-ASCII
// and control characters comes back from the mover exactly as enqueued.
func TestScheduledEntryKeepsEveryByte(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	m := message(6, nil)
	m.Payload = []byte(`{"s":"\u0000\t\"quoted\" \\ / é ✓ 🙂 \ud83d\ude42","n":1.5e3,"a":[],"o":{}}`)
	m.Kind = "k.v-1:x"
	m.TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	if _, err := EnqueueAt(ctx, rdb, keys, m, time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	moved, _, err := MoveDue(ctx, rdb, keys, 10)
	if err != nil || moved != 1 {
		t.Fatalf("MoveDue = %d %v", moved, err)
	}
	res, err := rdb.XRange(ctx, keys.Stream(), "-", "+").Result()
	if err != nil || len(res) != 1 {
		t.Fatalf("stream = %v %v", res, err)
	}
	got, err := ParseMessage(res[0].Values)
	if err != nil {
		t.Fatal(err)
	}
	if string(got.Payload) != string(m.Payload) || got.Kind != m.Kind || got.TraceParent != m.TraceParent || got.JobID != m.JobID ||
		!got.EnqueuedAt.Equal(m.EnqueuedAt) {
		t.Errorf("moved message = %+v\nwant %+v", got, m)
	}
}

// Movers racing on one due job move it once.
func TestConcurrentMoversMoveOnce(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const jobs = 50
	for i := range jobs {
		if _, err := EnqueueAt(ctx, rdb, keys, message(100+i, nil), time.Now().Add(-time.Millisecond)); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	var total atomic.Int64
	for range 8 {
		wg.Go(func() {
			n, _, err := MoveDue(ctx, rdb, keys, 1000)
			if err != nil {
				t.Error(err)
			}
			total.Add(int64(n))
		})
	}
	wg.Wait()
	if n, l := total.Load(), rdb.XLen(ctx, keys.Stream()).Val(); n != jobs || l != jobs {
		t.Errorf("moved %d, stream has %d, want %d each", n, l, jobs)
	}
}

// completer is a handler that reports completion.
type completer struct {
	HandlerFunc
	done  func(*Job) (bool, error)
	asked atomic.Int32
}

func (c *completer) Completed(_ context.Context, j *Job) (bool, error) {
	c.asked.Add(1)
	return c.done(j)
}

// spendAll makes the entry of job i look as the issue found it: delivered MaxDeliveries
// times (XCLAIM RETRYCOUNT), never acknowledged, idle past ClaimIdle.
func spendAll(t *testing.T, rdb redis.UniversalClient, keys Keys, i, max int) string {
	t.Helper()
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	id := enqueue(t, rdb, keys, message(i, nil))[0]
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "dead", Streams: []string{keys.Stream(), ">"}, Count: 1}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Do(ctx, "XCLAIM", keys.Stream(), DefaultGroup, "dead", 0, id, "IDLE", 3_600_000, "RETRYCOUNT", max, "JUSTID").Err(); err != nil {
		t.Fatal(err)
	}
	return id
}

// A job whose budget is spent by deliveries that never reported (its worker committed
// and died before XACK, MaxDeliveries times) is not dead-lettered when the handler
// says it completed: it is acknowledged without running again.
func TestCompletedJobIsNeverDeadLettered(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	h := &completer{HandlerFunc: func(context.Context, *Job) error { runs.Add(1); return nil },
		done: func(*Job) (bool, error) { return true, nil }}
	spendAll(t, rdb, keys, 7, 3)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 3, ClaimIdle: 50 * time.Millisecond, Handler: h})
	testenv.WaitFor(t, 10*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	if d := deadLetters(t, rdb, keys); len(d) != 0 {
		t.Errorf("dead letters %+v, want none: the job completed", d)
	}
	if h.asked.Load() != 1 || runs.Load() != 0 {
		t.Errorf("asked %d, ran %d, want asked once and not run", h.asked.Load(), runs.Load())
	}
}

// The same job, not completed, is dead-lettered with its attempts; when completion is
// unknown (the store is down) it is handed back rather than buried on a guess.
func TestSpentJobDeadLetteredOnlyWhenKnownIncomplete(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var unknown atomic.Bool
	unknown.Store(true)
	h := &completer{HandlerFunc: func(context.Context, *Job) error { return nil },
		done: func(*Job) (bool, error) {
			if unknown.Load() {
				return false, errors.New("postgres down")
			}
			return false, nil
		}}
	spendAll(t, rdb, keys, 8, 3)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 3, ClaimIdle: 50 * time.Millisecond, Handler: h})
	testenv.WaitFor(t, 10*time.Second, "the question", func() bool { return h.asked.Load() >= 1 })
	time.Sleep(200 * time.Millisecond)
	if d := deadLetters(t, rdb, keys); len(d) != 0 {
		t.Fatalf("dead-lettered while completion was unknown: %+v", d)
	}
	unknown.Store(false)
	testenv.WaitFor(t, 15*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	d := deadLetters(t, rdb, keys)[0]
	if d.Deliveries != 3 || !strings.Contains(d.Reason, "failed 3 attempts") {
		t.Errorf("dead letter = %+v, want 3 attempts in its reason", d)
	}
}

// A run longer than MaxRunTime is cancelled and counts as a failed attempt; a handler
// that ignores the cancellation is abandoned ClaimIdle/2 later (its lease no longer
// renewed), its job's next attempt scheduled as a failed attempt's, so the job runs
// again even while the hung handler holds its slot.
func TestMaxRunTimeBoundsARun(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var log runLog
	stuck := make(chan struct{})
	h := HandlerFunc(func(ctx context.Context, j *Job) error {
		switch log.add(j) {
		case 1: // honours its context
			<-ctx.Done()
			return ctx.Err()
		case 2: // ignores it
			<-stuck
			return nil
		}
		return nil
	})
	cfg := WorkerConfig{Redis: rdb, Keys: keys, MaxRunTime: 150 * time.Millisecond, ClaimIdle: 400 * time.Millisecond,
		RenewInterval: 50 * time.Millisecond, ClaimInterval: 20 * time.Millisecond, Handler: h}
	a := cfg
	a.Consumer = "a"
	start(t, a)
	b := cfg
	b.Consumer = "b"
	start(t, b)
	t.Cleanup(func() { close(stuck) }) // before the workers stop (cleanups run last first)
	enqueue(t, rdb, keys, message(9, nil))
	testenv.WaitFor(t, 20*time.Second, "a third run", func() bool { at, _ := log.snapshot(); return len(at) == 3 })
	at, tries := log.snapshot()
	// Run 1 overran (attempt spent): run 2 is attempt 2; it hung, was abandoned (attempt
	// spent), and run 3 is attempt 3.
	if !slices.Equal(tries, []int64{1, 2, 3}) {
		t.Errorf("attempts = %v, want [1 2 3]", tries)
	}
	if gap := at[2].Sub(at[1]); gap < 350*time.Millisecond {
		t.Errorf("takeover %v after the hung run started, want after MaxRunTime + ClaimIdle/2 (350ms)", gap)
	}
}

// A handler that ignores the shutdown's cancellation does not keep its job: after the
// grace its job is handed back anyway (a new entry, no attempt spent), so another worker
// runs it without waiting for ClaimIdle.
func TestAbandonedHandlerIsHandedBackAnyway(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	stuck := make(chan struct{})
	started := make(chan struct{}, 1)
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: time.Hour, ShutdownTimeout: 200 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error { started <- struct{}{}; <-stuck; return nil })})
	t.Cleanup(func() { close(stuck) })
	enqueue(t, rdb, keys, message(1, nil))
	<-started
	w.stop(t)
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Errorf("pending after the stop: %v, want none", p)
	}
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "next", Streams: []string{keys.Stream(), ">"}, Count: 10}).Result()
	if err != nil || len(res[0].Messages) != 1 {
		t.Fatalf("undelivered after the stop: %v %v, want the handed-back job", res, err)
	}
	if m, err := ParseMessage(res[0].Messages[0].Values); err != nil || m.JobID != jobID(1) || m.Attempts != 0 {
		t.Errorf("handed-back entry %+v %v, want job 1 with no attempt spent", m, err)
	}
}

// A job whose budget is spent is not buried while the handler cannot tell whether it
// completed (Completer errs: its store is down): it is handed back with the attempts the
// failure spent, so it is only asked again (Completed), never run again: exactly
// MaxDeliveries runs, however long the store is down.
func TestSpentJobIsNotRunAgainWhileCompletionIsUnknown(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var unknown atomic.Bool
	unknown.Store(true)
	var runs atomic.Int32
	h := &completer{
		HandlerFunc: func(context.Context, *Job) error { runs.Add(1); return errors.New("boom") },
		done: func(*Job) (bool, error) {
			if unknown.Load() {
				return false, errors.New("postgres down")
			}
			return false, nil
		}}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 1, ClaimIdle: time.Hour, Handler: h})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the completion question", func() bool { return h.asked.Load() >= 1 })
	time.Sleep(2 * time.Second) // the store stays down a while
	unknown.Store(false)
	testenv.WaitFor(t, 20*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	if n := runs.Load(); n != 1 {
		t.Errorf("the handler ran %d times (asked %d times whether it completed), want 1: MaxDeliveries is 1 and a spent job waiting for its completion check must not run again", n, h.asked.Load())
	}
}

// EnqueueAt of a job, then Enqueue of the same id (a client retrying without RunAt),
// whose immediate run fails permanently and is dead-lettered: a later move of the
// stale delayed member never sets the index queued while the dead letter it points at
// (dead_id) exists (the enqueue's invariant): it retires the dead letter, as an enqueue
// does, or leaves the index failed.
func TestStaleDelayedDuplicateDoesNotHideADeadLetter(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	release := make(chan struct{})
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error {
		if runs.Add(1) == 1 {
			return fmt.Errorf("bad input: %w", ErrPermanent)
		}
		<-release
		return nil
	})})
	t.Cleanup(func() { close(release) })
	m := message(4, nil)
	if _, err := EnqueueAt(ctx, rdb, keys, m, time.Now().Add(1500*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	enqueue(t, rdb, keys, m)
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	testenv.WaitFor(t, 10*time.Second, "the delayed duplicate's run", func() bool { return runs.Load() == 2 })
	ix, err := ReadJobIndex(ctx, rdb, keys, m.JobID)
	if err != nil {
		t.Fatal(err)
	}
	deadID, _ := rdb.HGet(ctx, keys.Job(m.JobID), "dead_id").Result()
	exists := false
	if deadID != "" {
		if r, err := rdb.XRange(ctx, keys.Dead(), deadID, deadID).Result(); err == nil && len(r) == 1 {
			exists = true
		}
	}
	if ix.State == StateQueued && exists {
		t.Errorf("index says %s (entry %s) while the dead letter it points at (%s) exists: the mover re-queued a job whose index points at a dead letter", ix.State, ix.Entry, deadID)
	}
}

// A RunAt that cannot be represented in milliseconds (past year ~292 million, where
// UnixMilli wraps) is refused (ErrMalformed) or clamped to the latest representable
// time: a job asked to run "never" never runs earlier than asked.
func TestFarFutureRunAtDoesNotRunAtOnce(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	at := time.Unix(1<<62, 0)
	m := message(6, nil)
	member, err := EnqueueAt(ctx, rdb, keys, m, at)
	if err != nil {
		return // refused: fine
	}
	score, err := rdb.ZScore(ctx, keys.Scheduled(), member).Result()
	if err != nil {
		t.Fatal(err)
	}
	if due := time.UnixMilli(int64(score)); due.Before(time.Now().Add(24 * time.Hour)) {
		t.Errorf("a job asked to run at %v is due at %v (score %v): the Unix millisecond time wrapped", at.UTC(), due.UTC(), score)
	}
}

// A job this worker scheduled far ahead does not stop its mover from polling: a job
// another process schedules sooner (EnqueueAt) runs at its time, within
// ScheduleInterval.
func TestMoverPollsWhileItsOwnJobsAreDueLater(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var log runLog
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ScheduleInterval: 100 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			if j.JobID == jobID(1) {
				return &retry.WaitError{Delay: time.Hour, Reason: "a signal"}
			}
			log.add(j)
			return nil
		})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the first job to wait", func() bool {
		ix, err := ReadJobIndex(ctx, rdb, keys, jobID(1))
		return err == nil && ix.State == StateScheduled
	})
	if _, err := EnqueueAt(ctx, rdb, keys, message(2, nil), time.Now().Add(300*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 5*time.Second, "the job scheduled sooner by another process to run", func() bool { a, _ := log.snapshot(); return len(a) == 1 })
}

// Wake makes a waiting job due now; a wake that comes while the job runs, before it
// waits, makes its wait end at once; another tenant cannot wake the job.
func TestWakeEndsAWaitAndIsNotLostWhileTheJobRuns(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var log runLog
	running := make(chan struct{}, 4)
	proceed := make(chan struct{}, 4)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ScheduleInterval: 100 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			n := log.add(j)
			if n == 2 { // the second run is woken before it waits
				running <- struct{}{}
				<-proceed
			}
			if n <= 2 {
				return &retry.WaitError{Delay: time.Hour, Reason: "a signal"}
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(3, nil))
	testenv.WaitFor(t, 10*time.Second, "the job to wait", func() bool {
		ix, err := ReadJobIndex(ctx, rdb, keys, jobID(3))
		return err == nil && ix.State == StateScheduled
	})
	if _, err := Wake(ctx, rdb, keys, "globex", jobID(3)); !errors.Is(err, ErrUnknownJob) {
		t.Fatalf("another tenant's wake: %v, want ErrUnknownJob", err)
	}
	if waiting, err := Wake(ctx, rdb, keys, "acme", jobID(3)); err != nil || !waiting {
		t.Fatalf("Wake = %v, %v; want the waiting job woken", waiting, err)
	}
	<-running
	if waiting, err := Wake(ctx, rdb, keys, "acme", jobID(3)); err != nil || waiting {
		t.Fatalf("Wake of a running job = %v, %v; want a mark, not a wake", waiting, err)
	}
	proceed <- struct{}{}
	testenv.WaitFor(t, 5*time.Second, "the third run, the wake mark having ended the second wait", func() bool { a, _ := log.snapshot(); return len(a) == 3 })
	if ix, _ := ReadJobIndex(ctx, rdb, keys, jobID(3)); ix.State == StateScheduled {
		t.Fatalf("index %+v: still waiting", ix)
	}
}

// Wake, WakeFor and MoveDue refuse keys that cannot name a queue, with Validate's error,
// before they reach Redis.
func TestWakeForRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := WakeFor(context.Background(), rdb, keys, "acme", jobID(1), "signal payment")
		return err
	})
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := Wake(context.Background(), rdb, keys, "acme", jobID(1))
		return err
	})
}

func TestMoveDueRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, _, err := MoveDue(context.Background(), rdb, keys, 10)
		return err
	})
}
