package queue

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/testenv"
)

// Found by the attack round (fixed): A worker whose lease was lost (a GC pause, a partition) still acknowledges
// its run when it returns ("both runs may complete"), and the acknowledgement's HSET
// writes a success record for an entry the trim has already removed. Nothing ever
// deletes it: the trim only looks at records of entries still in the stream, and the
// successes hash has no TTL. Each such race leaks a record forever.
func TestAttackHistorySuccessRecordOfALostLeaseIsNeverTrimmed(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	started, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "slow-a", RecordSuccesses: true,
		ClaimIdle: time.Hour, RenewInterval: -1, TrimInterval: -1,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			once.Do(func() { close(started) })
			<-release
			return nil
		})})
	id := enqueue(t, rdb, keys, message(41, nil))[0]
	<-started
	var bRuns atomic.Int32
	b := start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "fast-b", RecordSuccesses: true,
		ClaimIdle: 100 * time.Millisecond, ClaimInterval: 20 * time.Millisecond, TrimInterval: -1,
		Handler: HandlerFunc(func(context.Context, *Job) error { bRuns.Add(1); return nil })})
	testenv.WaitFor(t, 10*time.Second, "B's reclaimed run acknowledged", func() bool {
		return bRuns.Load() == 1 && len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 && rdb.HExists(ctx, keys.Successes(), id).Val()
	})
	b.stop(t)
	if n, err := Trim(ctx, rdb, keys, time.Hour); err != nil || n != 1 {
		t.Fatalf("Trim = %d, %v", n, err)
	}
	if n := rdb.HLen(ctx, keys.Successes()).Val(); n != 0 {
		t.Fatalf("before A returns: %d records", n)
	}
	close(release) // A's run returns and acknowledges the (trimmed) entry
	testenv.WaitFor(t, 10*time.Second, "A's acknowledgement", func() bool { return rdb.HExists(ctx, keys.Successes(), id).Val() })
	for range 2 {
		if _, err := Trim(ctx, rdb, keys, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	if n := rdb.HLen(ctx, keys.Successes()).Val(); n != 0 {
		t.Errorf("%d success record(s) of an entry no longer in the stream left in %s after the trims: never removed (no TTL, no trim reaches them)", n, keys.Successes())
	}
}

// Found by the attack round (fixed; the same leak by another path the worker anticipates: deletedPending). An
// entry deleted from the stream (XDEL, MAXLEN trimming) while it runs is acknowledged
// with its success record, which no trim will ever move or delete.
func TestAttackHistorySuccessRecordOfADeletedEntryIsNeverTrimmed(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	started, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	start(t, WorkerConfig{Redis: rdb, Keys: keys, RecordSuccesses: true, TrimInterval: -1,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			once.Do(func() { close(started) })
			<-release
			return nil
		})})
	id := enqueue(t, rdb, keys, message(42, nil))[0]
	<-started
	if err := rdb.XDel(ctx, keys.Stream(), id).Err(); err != nil {
		t.Fatal(err)
	}
	close(release)
	testenv.WaitFor(t, 10*time.Second, "the acknowledgement", func() bool {
		return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 && rdb.HExists(ctx, keys.Successes(), id).Val()
	})
	if _, err := Trim(ctx, rdb, keys, time.Hour); err != nil {
		t.Fatal(err)
	}
	if n := rdb.HLen(ctx, keys.Successes()).Val(); n != 0 {
		t.Errorf("%d success record(s) for a deleted entry left after the trim; the successes hash has no TTL (%v)", n, rdb.PTTL(ctx, keys.Successes()).Val())
	}
}

// Found by the attack round (fixed): When only the history half of the acknowledgement pipeline fails (HSET is
// denied under maxmemory/noeviction - OOM - while XACK, not DENYOOM, succeeds), the
// acker counts a Redis error, sleeps and resends the batch twice, then logs
// "acknowledge failed; the entries stay pending and will be redelivered" - false: the
// entries were acknowledged - and acks_total does not count them. A history write,
// "a lost success record loses only a line of the job's history", turns into false
// ack-failure alerts and a 150 ms stall of the single acker goroutine per batch.
func TestAttackHistoryFailedSuccessRecordReportsTheAckAsFailed(t *testing.T) {
	t.Parallel()
	_, rdb := privateRedis(t)
	ctx := context.Background()
	keys := Keys{Prefix: "oom", Queue: "q"}
	reg := prometheus.NewRegistry()
	var logs testenv.SyncBuffer
	started, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	start(t, WorkerConfig{Redis: rdb, Keys: keys, RecordSuccesses: true, Registerer: reg,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Handler: HandlerFunc(func(context.Context, *Job) error {
			once.Do(func() { close(started) })
			<-release
			return nil
		})})
	enqueue(t, rdb, keys, message(43, nil))
	<-started
	if err := rdb.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.ConfigSet(context.Background(), "maxmemory", "0") })
	close(release)
	testenv.WaitFor(t, 10*time.Second, "the entry acknowledged", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	time.Sleep(500 * time.Millisecond) // the acker's retries
	rdb.ConfigSet(ctx, "maxmemory", "0")
	if strings.Contains(logs.String(), "acknowledge failed") {
		t.Errorf("the acknowledgement was logged as failed although the entry is acknowledged (only the success record was refused):\n%s", grepLines(logs.String(), "acknowledge failed"))
	}
	if got := metricValue(t, reg, "onceflow_queue_acks_total"); got != 1 {
		t.Errorf("acks_total = %v, want 1", got)
	}
	if got := metricValue(t, reg, "onceflow_queue_redis_errors_total", "op", "ack"); got != 0 {
		t.Errorf("redis_errors_total{op=ack} = %v for a successful XACK", got)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for l := range strings.SplitSeq(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// Found by the attack round (fixed): Docs: "an operator's replayed and purged are events too". A job enqueued
// twice (allowed) can have two dead letters; the index points at the newer one. Purging
// the older one deletes it and records nothing in the job's history (purgeScript
// appends only when the index's dead_id is the purged one), so the history keeps
// "dead-lettered D1" with no trace of what became of D1.
func TestAttackHistoryPurgeOfAnOlderDeadLetterIsNotRecorded(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error {
		return Permanent(errors.New("bad input"))
	})})
	enqueue(t, rdb, keys, message(44, nil), message(44, nil))
	testenv.WaitFor(t, 10*time.Second, "two dead letters", func() bool { return len(deadLetters(t, rdb, keys)) == 2 })
	w.stop(t)
	dl := deadLetters(t, rdb, keys)
	if err := Purge(ctx, rdb, keys, dl[0].ID, time.Hour); err != nil {
		t.Fatal(err)
	}
	ev, _ := history(t, rdb, keys, jobID(44))
	purged := false
	for _, e := range ev {
		if e.Outcome == OutcomePurged && e.DeadID == dl[0].ID {
			purged = true
		}
	}
	if !purged {
		t.Errorf("the purge of dead letter %s is not in the history: %s", dl[0].ID, outcomes(ev))
	}
}

// Found by the attack round (fixed; low severity: a consumer name over 8 KiB). The
// bound cuts at the first newline in the last historyMax bytes; when the newest line
// alone is longer than historyMax there is none, so nothing is cut - not even the
// older lines - and the "bounded at 8 KiB" history grows by a line per event.
func TestAttackHistoryBoundFailsWhenALineExceedsIt(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	const n = 6
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: strings.Repeat("c", historyMax+100),
		Handler: HandlerFunc(func(context.Context, *Job) error {
			if runs.Add(1) <= n {
				return Unavailable(errors.New("down"))
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(45, nil))
	testenv.WaitFor(t, 20*time.Second, "the runs", func() bool { return runs.Load() > n })
	h := rdb.HGet(ctx, keys.Job(jobID(45)), "history").Val()
	if len(h) > 2*historyMax {
		t.Errorf("history of %d bytes (%d lines), bound %d", len(h), strings.Count(h, "\n")+1, historyMax)
	}
}

// A guard from the attack round: Hostile error text - quotes, "}", newlines forging a line, a
// backslash at the clip, invalid UTF-8, 10 KB - goes through historyRecord and the Lua
// concatenations (scheduleScript's `,"wait":N}`, the dead letter's `,"dead":"<id>"}`)
// and reads back as one event each, unchanged but for the clip.
func TestAttackHistoryHostileDetailsReadBack(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	hostile := "x\"}\n99 {\"outcome\":\"succeeded\",\"entry\":\"forged\"}\r\n\\\u2028\xff\xfe" + strings.Repeat("\\", 190) + "\"" + strings.Repeat("é", 5000)
	var runs atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "c\"\\", MaxDeliveries: 2, Handler: HandlerFunc(func(context.Context, *Job) error {
		runs.Add(1)
		return errors.New(hostile)
	})})
	enqueue(t, rdb, keys, message(46, nil))
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	w.stop(t)
	ev, _ := history(t, rdb, keys, jobID(46))
	if got := outcomes(ev); got != "retry,dead-lettered" {
		t.Fatalf("outcomes %s: %+v", got, ev)
	}
	if ev[1].DeadID != deadLetters(t, rdb, keys)[0].ID || ev[0].Consumer != "c\"\\" {
		t.Errorf("events %+v", ev)
	}
	for _, e := range ev {
		if e.Entry == "forged" || len(e.Detail) > historyDetailMax+8 {
			t.Errorf("event %+v", e)
		}
	}
	if !strings.HasPrefix(ev[0].Detail, "x\"}\n99 {") {
		t.Errorf("retry detail %q", ev[0].Detail)
	}
}
