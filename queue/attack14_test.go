package queue

// Attack tests on issue 14's work (attempt budget, scheduled set, snooze, delayed jobs,
// completion before burial, MaxRunTime). Each test states what is wrong and what was
// expected; they fail on the code they were written against, and are left failing for
// the fix.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

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

// FINDING (operator, PostgreSQL down): a job whose budget is spent is not buried while
// the handler cannot tell whether it completed (Completer errs: its store is down). It
// is handed back instead, but the hand-back re-adds the entry with the attempts it had
// BEFORE the failure that spent the budget (scheduleScript wrote nothing on
// 'exhausted'), so the next delivery is not "spent" any more: the handler runs the job
// again, and again after every hand-back, for as long as the store is down. A job
// with MaxDeliveries 1 that always fails ran many times during one outage.
//
// Expected: a spent job waiting for its completion check is only asked again (Completed),
// never run again: exactly MaxDeliveries runs, however long the store is down.
func TestAttack14SpentJobIsNotRunAgainWhileCompletionIsUnknown(t *testing.T) {
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

// FINDING (operator, Redis down longer than settleTimeout): a handler reports its
// dependency down (ErrUnavailable, which must spend no attempt), but the hand-back
// cannot reach Redis for 30s (settleTimeout) and gives up; the entry stays pending, is
// reclaimed after the restart and counted as a delivery that never reported, so the
// outage spends an attempt. With MaxDeliveries 1 the job is dead-lettered "failed 1
// attempts (the last never reported: its worker died)" though it never failed and the
// worker never died.
//
// Expected: an outage spends no attempt, however long: the job runs again after Redis
// is back, and is not dead-lettered.
func TestAttack14LongRedisOutageDuringHandBackSpendsNoAttempt(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a 35s Redis outage")
	}
	t.Parallel()
	srv, rdb := privateRedis(t)
	keys := Keys{Prefix: "attack14", Queue: "summaries"}
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
	time.Sleep(35 * time.Second) // longer than the 30s the first version retried a settlement for
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

// FINDING (operator, one worker, a handler that ignores its context past MaxRunTime):
// the worker's own reclaim scan claims the entry whose lease it let go, sees it is
// still running it, undoes the claim leaving the entry reclaimable at once, and does
// the same on the next scan: the warning "reclaimed an entry this worker is still
// running" is logged on every ClaimInterval for as long as the handler hangs (and
// onceflow_queue_reclaimed_total grows with it).
//
// Expected: the hung entry is reported once (or a few times), not in a loop.
func TestAttack14HungRunIsNotReportedInALoop(t *testing.T) {
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
}

// FINDING (attacker, stale delayed duplicate): EnqueueAt of a job, then Enqueue of the
// same id (a client retrying without RunAt). The enqueue (lua/enqueue.lua) leaves the
// index's "scheduled" field pointing at the delayed member. The immediate run fails
// permanently and the job is dead-lettered (index failed, dead_id). Then the mover moves the delayed member,
// finds the index still names it, and sets state queued: the index now says queued while
// the dead letter it points at (dead_id) still exists, breaking the invariant
// lua/enqueue.lua documents ("a job is never queued in the index while the dead letter it
// points at exists").
//
// Expected: once the dead letter exists, a later move of a stale member either retires
// the dead letter (as an enqueue does) or leaves the index saying failed.
func TestAttack14StaleDelayedDuplicateDoesNotHideADeadLetter(t *testing.T) {
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

// FINDING (attacker, forged attempts): ParseMessage accepts any positive decimal that
// fits an int, up to math.MaxInt64. process adds the delivery count to it (int64
// overflow) when the entry was delivered more than once, so the "spent" check
// (attempts + deliveries - 1 >= MaxDeliveries) wraps negative and the handler RUNS a
// job whose entry claims its budget is spent many times over, and sees a negative
// Job.Deliveries.
//
// Expected: an attempts value that big is either refused as malformed (dead-lettered
// with a reason) or treated as spent; the handler never sees a negative delivery count.
func TestAttack14ForgedHugeAttemptsNeverRunsTheHandler(t *testing.T) {
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

// FINDING (attacker, far-future RunAt): EnqueueAt takes at.UnixMilli(), which wraps for
// times past year ~292 million: a job asked to run "never" (or a garbage far-future
// time) is scored in the past and runs at once.
//
// Expected: a RunAt that cannot be represented is refused (ErrMalformed) or clamped to
// the latest representable time; it never runs earlier than asked.
func TestAttack14FarFutureRunAtDoesNotRunAtOnce(t *testing.T) {
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

// FINDING (attacker, tenant isolation through a delayed duplicate): EnqueueAt of a job
// (due in an hour), then Enqueue of the same id by the same tenant (a client's retry
// without RunAt). The immediate entry runs and is acknowledged; the trim then gives the
// job index JobTTL because its "entry" is the trimmed one, although the job is still in
// the scheduled set (the enqueue set "entry" and left "scheduled" and "run_at"). Once the
// index expires, the delayed job has no index: JobState says unknown, and another
// tenant's enqueue of the id is accepted (ErrJobIDTaken no longer holds) while the first
// tenant's job still waits to run.
//
// Expected: the index of a job that is still scheduled never expires (as the trim's
// invariant says: "an index expires only after its job left the stream", and the
// scheduled set), so the id stays the first tenant's.
func TestAttack14DelayedDuplicateKeepsItsIndexAfterTrim(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error { runs.Add(1); return nil })})
	m := message(7, nil)
	if _, err := EnqueueAt(ctx, rdb, keys, m, time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	enqueue(t, rdb, keys, m)
	testenv.WaitFor(t, 10*time.Second, "the immediate run's ack", func() bool {
		return runs.Load() == 1 && len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0
	})
	if _, err := Trim(ctx, rdb, keys, 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if n := rdb.ZCard(ctx, keys.Scheduled()).Val(); n != 1 {
		t.Fatalf("%d scheduled, want the delayed job still waiting", n)
	}
	if rdb.Exists(ctx, keys.Job(m.JobID)).Val() == 0 {
		t.Errorf("the job index expired while the job is still scheduled")
	}
	evil := m
	evil.Tenant = "mallory"
	if _, err := Enqueue(ctx, rdb, keys, evil); !errors.Is(err, ErrJobIDTaken) {
		t.Errorf("another tenant's enqueue of a job id still scheduled for %q: %v, want ErrJobIDTaken", m.Tenant, err)
	}
}

// A run that passed MaxRunTime and still returned nil succeeded: its effects are
// committed, so it is acknowledged (docs/queue.md, "Handler outcomes"; the first
// version of the docs said a failed attempt whatever it returned, which the attack on
// issue 14 found the code did not do; the docs were wrong). One that returned an error
// is a failed attempt even when the error is Unavailable.
func TestAttack14OverrunRunIsAFailedAttemptWhateverItReturned(t *testing.T) {
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

// FINDING (attacker, a huge error): the index's last_error is clipped to
// maxLastErrorLen (512 bytes), but the dead-letter reason of a job whose last attempt
// failed is "failed N attempts; last error: " + the whole error: a handler error that
// carries a big response body (1 MiB here) is stored whole in the dead letter and the
// index's reason (which the API's GET returns as the job's error), and logged whole.
//
// Expected: the reason is clipped as last_error is.
func TestAttack14DeadLetterReasonIsClipped(t *testing.T) {
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

// FINDING (operator, one worker, a handler that ignores its context): MaxRunTime is
// documented to bound one run ("A handler that ignores its context ... loses its lease,
// and another worker takes the job over ClaimIdle later"). With a single worker (one
// `onceflow run` process, a common deployment) there is no other worker: the worker
// reclaims its own hung entry, refuses to run it twice, and undoes the claim, for ever.
// The job never runs again while the hung handler lives (here: 5s after MaxRunTime 100ms
// + ClaimIdle 300ms), whatever its budget says.
//
// Expected: past MaxRunTime + ClaimIdle the job's next attempt runs (on this worker if
// no other takes it), the hung run counted as a failed attempt; or, if that is not
// wanted, the docs say that a single worker never retries a hung run.
func TestAttack14HungRunIsRetriedWithOneWorker(t *testing.T) {
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
	time.Sleep(5 * time.Second)
	if at, tries := log.snapshot(); len(at) < 2 {
		t.Errorf("runs with attempts %v in 5s, want a second run (attempt 2) after MaxRunTime + ClaimIdle", tries)
	}
}

// FINDING (operator, SIGTERM while Redis is down): at the shutdown timeout the handlers
// are cancelled and each returning job is handed back, a settlement that retries for up
// to settleTimeout (30s) while Redis does not answer. Run waits only the short grace
// (min(ShutdownTimeout, 5s)) for that, then calls handBackAbandoned for every entry still
// tracked, which includes the ones that honoured the cancellation and are only
// settling; it settles them one after the other, each again for up to 30s. With N jobs
// in flight a SIGTERM during a Redis outage takes about N x 30s (4 jobs: two minutes or
// more; 64, the default Concurrency: over half an hour) before Run returns.
//
// Expected: Run returns within about ShutdownTimeout + grace + one settleTimeout, however
// many jobs were in flight (their entries stay pending and are reclaimed, as when
// settling fails).
func TestAttack14ShutdownDuringRedisOutageIsBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a 35s Redis outage")
	}
	t.Parallel()
	srv, rdb := privateRedis(t)
	keys := Keys{Prefix: "attack14", Queue: "summaries"}
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
