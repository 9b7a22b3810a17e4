package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

func history(t *testing.T, rdb redis.UniversalClient, keys Keys, id string) ([]HistoryEvent, int64) {
	t.Helper()
	ev, dropped, err := ReadHistory(context.Background(), rdb, keys, id)
	if err != nil {
		t.Fatal(err)
	}
	return ev, dropped
}

// waitEvents waits until the history of job id has n events.
func waitEvents(t *testing.T, rdb redis.UniversalClient, keys Keys, id string, n int) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("%d events in the history", n), func() bool {
		ev, _ := history(t, rdb, keys, id)
		return len(ev) == n
	})
}

func outcomes(ev []HistoryEvent) string {
	var s []string
	for _, e := range ev {
		s = append(s, e.Outcome)
	}
	return strings.Join(s, ",")
}

// A job that fails twice, is handed back once and then succeeds has four events, one
// per delivery, each with its entry, delivery number, consumer, times and outcome; the
// acknowledgement's event lands with the XACK.
func TestHistoryRecordsEachDeliveryAndItsOutcome(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "hist-1", MaxDeliveries: 5, RecordSuccesses: true, Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
		switch runs.Add(1) {
		case 1, 2:
			return fmt.Errorf("model timed out (run %d)", runs.Load())
		case 3:
			return Unavailable(errors.New("database down"))
		}
		return nil
	})})
	before := time.Now().Add(-time.Second)
	enqueue(t, rdb, keys, message(1, nil))
	waitEvents(t, rdb, keys, jobID(1), 4)
	w.stop(t)
	ev, dropped := history(t, rdb, keys, jobID(1))
	if got, want := outcomes(ev), "retry,retry,handed back,succeeded"; got != want {
		t.Fatalf("outcomes %s, want %s", got, want)
	}
	if dropped != 0 {
		t.Errorf("dropped %d", dropped)
	}
	entries := map[string]bool{}
	for i, e := range ev {
		if e.Seq != int64(i+1) {
			t.Errorf("event %d has seq %d", i, e.Seq)
		}
		if e.Consumer != "hist-1" || e.Delivery != 1 || e.Entry == "" {
			t.Errorf("event %d: consumer %q delivery %d entry %q", i, e.Consumer, e.Delivery, e.Entry)
		}
		if e.Start.Before(before) || e.End.Before(e.Start) || e.End.After(time.Now().Add(time.Second)) {
			t.Errorf("event %d: start %v end %v", i, e.Start, e.End)
		}
		entries[e.Entry] = true
	}
	// Each retry and hand-back re-adds the job as a new entry.
	if len(entries) != 4 {
		t.Errorf("%d distinct entries, want 4: %+v", len(entries), ev)
	}
	if !strings.Contains(ev[0].Detail, "model timed out (run 1)") || !strings.Contains(ev[2].Detail, "database down") {
		t.Errorf("details %q, %q", ev[0].Detail, ev[2].Detail)
	}
	if ev[3].Detail != "" {
		t.Errorf("success has detail %q", ev[3].Detail)
	}
}

// A delivery whose worker died (it read the entry and never settled it) leaves a gap:
// the next delivery of the same entry is number 2.
func TestHistoryShowsADeliveryThatNeverReported(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := rdb.XGroupCreateMkStream(ctx, keys.Stream(), DefaultGroup, "0").Err(); err != nil {
		t.Fatal(err)
	}
	id := enqueue(t, rdb, keys, message(2, nil))[0]
	// The dead worker: reads the entry, then nothing.
	if err := rdb.XReadGroup(ctx, readArgs(keys, "dead-worker", 1)).Err(); err != nil {
		t.Fatal(err)
	}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "live-worker", RecordSuccesses: true, ClaimIdle: 100 * time.Millisecond, ClaimInterval: 20 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	waitEvents(t, rdb, keys, jobID(2), 1) // the reclaimed run's
	ev, _ := history(t, rdb, keys, jobID(2))
	if e := ev[0]; e.Outcome != OutcomeSucceeded || e.Entry != id || e.Delivery != 2 || e.Consumer != "live-worker" {
		t.Errorf("event %+v, want the second delivery of %s succeeded on live-worker", e, id)
	}
}

// A dead letter, its replay and the success after it are all in the history: a replay
// no longer erases the failure.
func TestHistoryKeepsTheFailureAcrossAReplayAndRecordsAPurge(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	d := deadLetterOne(t, rdb, keys, 3)
	newEntry, err := Replay(ctx, rdb, keys, d.ID)
	if err != nil {
		t.Fatal(err)
	}
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, RecordSuccesses: true, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	waitEvents(t, rdb, keys, jobID(3), 3)
	w.stop(t)
	ev, _ := history(t, rdb, keys, jobID(3))
	if got, want := outcomes(ev), "dead-lettered,replayed,succeeded"; got != want {
		t.Fatalf("outcomes %s, want %s", got, want)
	}
	if ev[0].DeadID != d.ID || !strings.Contains(ev[0].Detail, "bad input") {
		t.Errorf("dead-lettered event %+v, want dead %s and the reason", ev[0], d.ID)
	}
	if ev[1].DeadID != d.ID || ev[1].Entry != newEntry || ev[1].Delivery != 0 || ev[1].End.IsZero() {
		t.Errorf("replayed event %+v, want dead %s entry %s", ev[1], d.ID, newEntry)
	}
	if ev[2].Entry != newEntry {
		t.Errorf("success of entry %s, want the replayed %s", ev[2].Entry, newEntry)
	}

	d2 := deadLetterOne(t, rdb, keys, 4)
	if err := Purge(ctx, rdb, keys, d2.ID, time.Hour); err != nil {
		t.Fatal(err)
	}
	ev, _ = history(t, rdb, keys, jobID(4))
	if got, want := outcomes(ev), "dead-lettered,purged"; got != want || ev[1].DeadID != d2.ID {
		t.Fatalf("outcomes %s (%+v), want %s of %s", got, ev, want, d2.ID)
	}
}

// A job handed back again and again (a limiter keeps putting it off) keeps a bounded
// history: the newest events, and how many older ones were dropped.
func TestHistoryIsBounded(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	const n = 120
	start(t, WorkerConfig{Redis: rdb, Keys: keys, RecordSuccesses: true, Handler: HandlerFunc(func(context.Context, *Job) error {
		if runs.Add(1) <= n {
			return Unavailable(errors.New(strings.Repeat("x", 500)))
		}
		return nil
	})})
	enqueue(t, rdb, keys, message(5, nil))
	testenv.WaitFor(t, 30*time.Second, "the success", func() bool {
		ev, _ := history(t, rdb, keys, jobID(5))
		return len(ev) > 0 && ev[len(ev)-1].Outcome == OutcomeSucceeded
	})
	ev, dropped := history(t, rdb, keys, jobID(5))
	h, err := rdb.HGet(context.Background(), keys.Job(jobID(5)), "history").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(h) > historyMax {
		t.Errorf("history of %d bytes, bound %d", len(h), historyMax)
	}
	if dropped == 0 || int(dropped)+len(ev) != n+1 {
		t.Errorf("%d events kept and %d dropped, want %d in all", len(ev), dropped, n+1)
	}
	if ev[len(ev)-1].Seq != n+1 {
		t.Errorf("last seq %d, want %d", ev[len(ev)-1].Seq, n+1)
	}
}

// A job whose index is gone (expired) gets no history and no index back from an ack.
func TestHistoryNeverCreatesAnIndex(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	enqueue(t, rdb, keys, message(6, nil))
	if err := rdb.Del(ctx, keys.Job(jobID(6))).Err(); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Bool
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, RecordSuccesses: true, Handler: HandlerFunc(func(context.Context, *Job) error { ran.Store(true); return nil })})
	testenv.WaitFor(t, 10*time.Second, "the run and its ack", func() bool {
		return ran.Load() && len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0
	})
	w.stop(t)
	if n, err := rdb.Exists(ctx, keys.Job(jobID(6))).Result(); err != nil || n != 0 {
		t.Errorf("the ack wrote an index (exists %d, %v)", n, err)
	}
}

func TestParseHistorySkipsWhatItCannotRead(t *testing.T) {
	t.Parallel()
	h := "1 {\"outcome\":\"retry\",\"entry\":\"1-0\",\"n\":1,\"start\":1000,\"end\":2000,\"wait\":30}\n" +
		"garbage\n2 not-json\n-3 {\"outcome\":\"x\"}\n4 {\"entry\":\"2-0\"}\n5 {\"outcome\":\"succeeded\",\"n\":2}"
	ev := ParseHistory(h)
	if len(ev) != 2 || ev[0].Seq != 1 || ev[1].Seq != 5 {
		t.Fatalf("parsed %+v", ev)
	}
	if ev[0].Wait != 30*time.Millisecond || !ev[0].Start.Equal(time.UnixMilli(1000)) || !ev[0].End.Equal(time.UnixMilli(2000)) {
		t.Errorf("first event %+v", ev[0])
	}
}

func FuzzParseHistory(f *testing.F) {
	f.Add("1 {\"outcome\":\"retry\"}\n2 {\"outcome\":\"succeeded\",\"n\":3,\"wait\":-5}")
	f.Add("")
	f.Add("\n\n 9")
	f.Fuzz(func(t *testing.T, h string) {
		for _, e := range ParseHistory(h) {
			if e.Seq <= 0 || e.Outcome == "" || e.Wait < 0 {
				t.Fatalf("parsed %+v", e)
			}
		}
	})
}

// historyRecord writes JSON by hand: whatever the strings, encoding/json reads back
// what went in (invalid UTF-8 replaced, as encoding/json would).
func FuzzHistoryRecordIsJSON(f *testing.F) {
	f.Add("1-0", "worker-a", "model said \"no\"\n\tand \\ left", int64(3))
	f.Add("", "", "\x00\x1f\xff\xfe", int64(0))
	f.Fuzz(func(t *testing.T, entry, consumer, detail string, n int64) {
		start := time.UnixMilli(1_700_000_000_000)
		rec := historyRecord(delivery{id: entry, deliveries: n, started: start}, consumer, OutcomeRetry, detail, start.Add(time.Second))
		var w historyWire
		if err := json.Unmarshal([]byte(rec), &w); err != nil {
			t.Fatalf("%s: %v", rec, err)
		}
		valid := func(s string) string { return strings.ToValidUTF8(s, "\ufffd") }
		if w.Entry != valid(entry) || w.Consumer != valid(clipTo(consumer, historyDetailMax)) || w.Detail != valid(clipTo(detail, historyDetailMax)) ||
			w.Delivery != n || w.Outcome != OutcomeRetry || w.Start != start.UnixMilli() || w.End != start.UnixMilli()+1000 {
			t.Fatalf("%s read back as %+v", rec, w)
		}
		if strings.Contains(rec, "\n") {
			t.Fatalf("a record with a newline breaks the history's lines: %q", rec)
		}
	})
}

// A success is written with the XACK into the queue's successes hash, and the trim
// moves it into the job's index as it removes the entry: the history shows it before
// and after, and the successes hash does not grow.
func TestHistorySuccessMovesIntoTheIndexAtTheTrim(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "trim-1", RecordSuccesses: true, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	id := enqueue(t, rdb, keys, message(7, nil))[0]
	testenv.WaitFor(t, 10*time.Second, "the success record", func() bool { return rdb.HExists(ctx, keys.Successes(), id).Val() })
	w.stop(t)
	before, _ := history(t, rdb, keys, jobID(7))
	if outcomes(before) != OutcomeSucceeded || before[0].Entry != id || before[0].Consumer != "trim-1" {
		t.Fatalf("before the trim: %+v", before)
	}
	if n, err := Trim(ctx, rdb, keys, time.Hour); err != nil || n != 1 {
		t.Fatalf("Trim = %d, %v", n, err)
	}
	if n := rdb.HLen(ctx, keys.Successes()).Val(); n != 0 {
		t.Errorf("%d records left in the successes hash", n)
	}
	after, _ := history(t, rdb, keys, jobID(7))
	if len(after) != 1 || after[0] != before[0] {
		t.Errorf("after the trim: %+v, before %+v", after, before)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID(7))).Val(); ttl <= 0 {
		t.Errorf("the index has no TTL after the trim: %v", ttl)
	}
}

// Without RecordSuccesses (the default) a success writes nothing but its XACK; the
// failures before it are in the history all the same.
func TestHistoryWithoutRecordSuccessesKeepsOnlyTheFailures(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Handler: HandlerFunc(func(context.Context, *Job) error {
		if runs.Add(1) == 1 {
			return errors.New("first run fails")
		}
		return nil
	})})
	enqueue(t, rdb, keys, message(8, nil))
	testenv.WaitFor(t, 10*time.Second, "the second run acknowledged", func() bool {
		return runs.Load() == 2 && len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0
	})
	w.stop(t)
	ev, _ := history(t, rdb, keys, jobID(8))
	if outcomes(ev) != OutcomeRetry {
		t.Errorf("history %+v, want the retry only", ev)
	}
	if n := rdb.Exists(ctx, keys.Successes()).Val(); n != 0 {
		t.Errorf("a success record was written")
	}
}

// A success record written for an entry the stream no longer holds is removed by the
// trim: the successes hash has no TTL, so a record no trim reaches would be kept for
// ever.
func TestHistorySuccessRecordOfAnEntryNoLongerInTheStreamIsRemoved(t *testing.T) {
	t.Parallel()
	// A worker whose lease was lost (a GC pause, a partition) still acknowledges its run
	// when it returns ("both runs may complete"), after the trim removed the entry.
	t.Run("a lost lease's", func(t *testing.T) {
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
	})
	// An entry deleted from the stream (XDEL, MAXLEN trimming) while it runs is
	// acknowledged with its success record.
	t.Run("a deleted entry's", func(t *testing.T) {
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
	})
}

// When only the history half of the acknowledgement pipeline fails (HSET denied under
// maxmemory/noeviction, OOM, while XACK, not DENYOOM, succeeds), the entries are
// acknowledged and counted in acks_total, and nothing logs "acknowledge failed" or
// counts a Redis error of the ack: a lost success record loses only a line of the
// job's history, never a false ack-failure alert or a stall of the acker.
func TestHistoryFailedSuccessRecordDoesNotFailTheAck(t *testing.T) {
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

// "An operator's replayed and purged are events too" (docs): a job enqueued twice can
// have two dead letters, and the index points at the newer one; purging the older one
// is recorded in the job's history too, which would otherwise keep "dead-lettered D1"
// with no trace of what became of D1.
func TestHistoryRecordsThePurgeOfAnOlderDeadLetter(t *testing.T) {
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

// The history stays bounded (historyMax, 8 KiB) when its newest line alone is longer
// than the bound (a consumer name over 8 KiB), where there is no newline in the last
// historyMax bytes to cut at.
func TestHistoryBoundHoldsWhenALineExceedsIt(t *testing.T) {
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

// Hostile error text (quotes, "}", newlines forging a line, a backslash at the clip,
// invalid UTF-8, 10 KB) goes through historyRecord and the scripts' concatenations (the
// wait's `,"wait":N}`, the dead letter's `,"dead":"<id>"}`) and reads back as one event
// each, unchanged but for the clip.
func TestHistoryHostileDetailsReadBack(t *testing.T) {
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

// ReadHistory refuses keys that cannot name a queue, with Validate's error, before it
// reaches Redis.
func TestReadHistoryRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, _, err := ReadHistory(context.Background(), rdb, keys, jobID(1))
		return err
	})
}
