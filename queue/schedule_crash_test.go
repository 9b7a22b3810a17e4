package queue

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/retry"
)

// The crash tests run a worker in a child process (this test binary, running
// TestCrashHelperProcess) that kills itself with SIGKILL at one step of a job's way
// between the stream and the scheduled set (crashPoint), then check with a fresh worker
// that the job runs exactly once more: never lost, never run twice.

const (
	envHelper = "QUEUE_CRASH_HELPER"
	envPoint  = "QUEUE_CRASH_POINT"
	envPrefix = "QUEUE_CRASH_PREFIX"
)

// effectKey counts the job's effects (one INCR per successful run).
func effectKey(keys Keys) string { return keys.Key("effects") }

// TestCrashHelperProcess is the child's body; it does nothing in a normal test run.
func TestCrashHelperProcess(t *testing.T) {
	if os.Getenv(envHelper) != "1" {
		t.Skip("child process of the crash tests")
	}
	// The parent's Redis: the cluster when the suite runs on one (setup).
	var rdb redis.UniversalClient
	if seeds := os.Getenv("ONCEFLOW_TEST_REDIS_CLUSTER"); seeds != "" {
		c, err := connect.RedisCluster(testenv.ClusterURL(seeds))
		if err != nil {
			t.Fatal(err)
		}
		rdb = c
	} else {
		opt, err := redis.ParseURL(os.Getenv("ONCEFLOW_REDIS_URL"))
		if err != nil {
			t.Fatal(err)
		}
		rdb = redis.NewClient(opt)
	}
	keys := Keys{Prefix: os.Getenv(envPrefix), Queue: "summaries"}
	point := os.Getenv(envPoint)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if point != "sigterm" {
		crashPoint = func(step string) {
			if step == point {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {} // the signal arrives
			}
		}
	}
	w, err := NewWorker(WorkerConfig{Redis: rdb, Keys: keys, Consumer: "child", ClaimIdle: time.Hour,
		RetryBase: 50 * time.Millisecond, RetryMax: 50 * time.Millisecond, ShutdownTimeout: 300 * time.Millisecond,
		Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
			if point == "sigterm" {
				rdb.Set(context.Background(), keys.Key("started"), "1", 0)
				<-ctx.Done() // a long job: the shutdown cuts it
				return ctx.Err()
			}
			if j.Deliveries == 1 {
				// An explicit delay: a full-jitter draw may be 0, which re-adds the job to
				// the stream at once, without the scheduled set.
				return retry.RetryAfter(50*time.Millisecond, errors.New("the first attempt fails"))
			}
			// A later attempt may reach this child before it dies (right after the move,
			// its blocked read gets the new entry): it never completes here.
			<-ctx.Done()
			return ctx.Err()
		})})
	if err != nil {
		t.Fatal(err)
	}
	_ = w.Run(ctx)
}

// child starts the crash helper for point on keys.
func child(t *testing.T, keys Keys, point string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), envHelper+"=1", envPoint+"="+point, envPrefix+"="+keys.Prefix)
	cmd.Stdout, cmd.Stderr = testenv.Writer(t), testenv.Writer(t)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

// waitExit waits for cmd to exit and returns its state.
func waitExit(t *testing.T, cmd *exec.Cmd, within time.Duration) *os.ProcessState {
	t.Helper()
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
		return cmd.ProcessState
	case <-time.After(within):
		t.Fatalf("the child did not exit within %v", within)
		return nil
	}
}

// A worker killed at each step of a retry's way through the scheduled set: after the
// failed run but before its settlement (the entry stays pending, and is reclaimed),
// right after the settlement (the job is in the set), between the mover's read and its
// move, and right after the move (the job is in the stream again). In every case a
// fresh worker runs the job exactly once more, as attempt 2, and nothing is left behind.
func TestCrashAtEachStepOfTheMove(t *testing.T) {
	t.Parallel()
	for _, point := range []string{"settle.before", "settle.after", "move.read", "move.after"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			rdb, keys := setup(t)
			ctx := context.Background()
			if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
				t.Fatal(err)
			}
			enqueue(t, rdb, keys, message(1, nil))
			cmd := child(t, keys, point)
			st := waitExit(t, cmd, 30*time.Second)
			if ws, ok := st.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("the child exited with %v, want killed at %s", st, point)
			}
			if n, _ := rdb.Get(ctx, effectKey(keys)).Int(); n != 0 {
				t.Fatalf("%d effects before the restart, want 0", n)
			}
			// A child killed right after the move may have read the new entry first (its
			// blocked XREADGROUP is served by the XADD): that delivery never reported and
			// spends an attempt too.
			want := int64(2)
			if point != "settle.before" { // there the failed first entry is pending
				want += int64(len(pendingIDs(t, rdb, keys, DefaultGroup)))
			}
			var log runLog
			start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "fresh", ClaimIdle: 300 * time.Millisecond, ClaimInterval: 20 * time.Millisecond,
				Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
					log.add(j)
					return rdb.Incr(ctx, effectKey(keys)).Err()
				})})
			testenv.WaitFor(t, 20*time.Second, "the job's effect", func() bool { n, _ := rdb.Get(ctx, effectKey(keys)).Int(); return n >= 1 })
			time.Sleep(time.Second) // several claim and move rounds: nothing more may run
			if n, _ := rdb.Get(ctx, effectKey(keys)).Int(); n != 1 {
				t.Errorf("%d effects, want exactly 1", n)
			}
			if _, tries := log.snapshot(); len(tries) != 1 || tries[0] != want {
				t.Errorf("fresh worker's runs = %v, want one run, attempt %d", tries, want)
			}
			testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
			if z, h := rdb.ZCard(ctx, keys.Scheduled()).Val(), rdb.HLen(ctx, keys.ScheduledData()).Val(); z != 0 || h != 0 {
				t.Errorf("scheduled set %d, data %d: want both empty", z, h)
			}
			if d := deadLetters(t, rdb, keys); len(d) != 0 {
				t.Errorf("dead letters: %+v", d)
			}
		})
	}
}

// SIGTERM to a worker running a long job: once its shutdown timeout passes, the job is
// handed back as a new entry and another worker (whose ClaimIdle is an hour: this is not
// a reclaim) starts it within seconds, as attempt 1.
func TestSIGTERMHandsTheJobToAnotherWorker(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	enqueue(t, rdb, keys, message(1, nil))
	cmd := child(t, keys, "sigterm")
	testenv.WaitFor(t, 20*time.Second, "the long job to start in the child", func() bool { return rdb.Exists(ctx, keys.Key("started")).Val() == 1 })
	started := make(chan *Job, 1)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "other", ClaimIdle: time.Hour,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error { started <- j; return nil })})
	sent := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case j := <-started:
		took := time.Since(sent)
		t.Logf("SIGTERM to the job running on another worker: %v (shutdown timeout 300ms)", took.Round(time.Millisecond))
		if j.Deliveries != 1 || j.Attempts != 0 {
			t.Errorf("the other worker saw attempt %d (recorded %d), want 1: a hand-back spends no attempt", j.Deliveries, j.Attempts)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no other worker started the job within 15s of SIGTERM")
	}
	if st := waitExit(t, cmd, 15*time.Second); !st.Success() {
		t.Errorf("the child exited with %v after SIGTERM, want 0", st)
	}
}

// Redis killed with SIGKILL right after each script of the move (appendfsync always, as
// docs/operations.md recommends): after the restart the job is in exactly one place,
// because AOF logs each script's writes as one transaction.
func TestRedisKilledAfterEachScriptKeepsTheJobInOnePlace(t *testing.T) {
	t.Parallel()
	srv, rdb := privateRedis(t)
	ctx := context.Background()
	keys := Keys{Prefix: "crash", Queue: "summaries"}
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	msg := message(1, nil)
	id := enqueue(t, rdb, keys, msg)[0]
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "c", Streams: []string{keys.Stream(), ">"}, Count: 1}).Err(); err != nil {
		t.Fatal(err)
	}
	restart := func() {
		srv.Kill()
		srv.Start()
		testenv.WaitFor(t, 20*time.Second, "redis back", func() bool { return rdb.Ping(ctx).Err() == nil })
	}
	// A failure's settlement: out of the stream's pending list, into the set.
	res, err := settle(ctx, rdb, keys, DefaultGroup, "c", id, &msg, settlement{spend: 1, budget: 5, lastError: "boom", delay: time.Hour})
	if err != nil || !res.owned || res.delay != time.Hour {
		t.Fatalf("settle = %+v %v", res, err)
	}
	restart()
	if p, z := len(pendingIDs(t, rdb, keys, DefaultGroup)), rdb.ZCard(ctx, keys.Scheduled()).Val(); p != 0 || z != 1 {
		t.Fatalf("after a crash following the settlement: %d pending, %d scheduled; want 0 and 1", p, z)
	}
	// Make it due, move it, crash.
	if err := rdb.ZAdd(ctx, keys.Scheduled(), redis.Z{Score: 1, Member: msg.JobID + " " + id}).Err(); err != nil {
		t.Fatal(err)
	}
	if n, _, err := MoveDue(ctx, rdb, keys, 10); err != nil || n != 1 {
		t.Fatalf("MoveDue = %d %v", n, err)
	}
	restart()
	if z, h := rdb.ZCard(ctx, keys.Scheduled()).Val(), rdb.HLen(ctx, keys.ScheduledData()).Val(); z != 0 || h != 0 {
		t.Errorf("after a crash following the move: %d scheduled, %d data; want none", z, h)
	}
	res2, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "c", Streams: []string{keys.Stream(), ">"}, Count: 10}).Result()
	if err != nil || len(res2) != 1 || len(res2[0].Messages) != 1 {
		t.Fatalf("undelivered after the move: %v %v, want the one moved entry", res2, err)
	}
	got, err := ParseMessage(res2[0].Messages[0].Values)
	if err != nil || got.JobID != msg.JobID || got.Attempts != 1 {
		t.Errorf("moved entry = %+v %v, want the job with 1 attempt spent", got, err)
	}
}
