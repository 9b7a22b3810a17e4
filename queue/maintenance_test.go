package queue

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

func streamIDs(t *testing.T, rdb redis.UniversalClient, keys Keys) []string {
	t.Helper()
	msgs, err := rdb.XRange(context.Background(), keys.Stream(), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range msgs {
		ids = append(ids, m.ID)
	}
	return ids
}

// Trim keeps every entry some group still has pending or has not read, and removes the
// rest; MAXLEN trimming would have deleted the pending entry.
func TestTrimNeverDeletesPendingOrUnreadEntries(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if n, err := Trim(ctx, rdb, keys, time.Hour); err != nil || n != 0 {
		t.Fatalf("trim of a missing stream: %d %v", n, err)
	}
	var ids []string
	for i := range 10 {
		ids = append(ids, enqueue(t, rdb, keys, message(i, nil))...)
	}
	if n, err := Trim(ctx, rdb, keys, time.Hour); err != nil || n != 0 {
		t.Fatalf("trim of a stream without groups: %d %v", n, err)
	}
	for _, g := range []string{"g1", "g2"} {
		if err := CreateGroup(ctx, rdb, keys, g); err != nil {
			t.Fatal(err)
		}
	}
	read := func(group string, n int64, ack int) {
		t.Helper()
		res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "c", Streams: []string{keys.Stream(), ">"}, Count: n}).Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range res[0].Messages[:ack] {
			rdb.XAck(ctx, keys.Stream(), group, m.ID)
		}
	}
	// g1: entries 0-6 read, 0-5 acknowledged, 6 pending, 7-9 unread.
	read("g1", 7, 6)
	// g2: entries 0-3 read and acknowledged, 4-9 unread.
	read("g2", 4, 4)
	n, err := Trim(ctx, rdb, keys, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if got := streamIDs(t, rdb, keys); n != 4 || !slices.Equal(got, ids[4:]) {
		t.Errorf("trimmed %d, left %v; want 4 trimmed, %v left (g2 has not read 4-9)", n, got, ids[4:])
	}
	read("g2", 100, 6) // g2 catches up
	n, err = Trim(ctx, rdb, keys, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if got := streamIDs(t, rdb, keys); n != 2 || !slices.Equal(got, ids[6:]) {
		t.Errorf("trimmed %d, left %v; want the pending entry 6 and the unread 7-9", n, got)
	}
	if p := pendingIDs(t, rdb, keys, "g1"); !slices.Equal(p, ids[6:7]) {
		t.Errorf("g1 pending %v", p)
	}
	// The pending entry can still be claimed and run: it was not deleted under the PEL.
	msgs, err := rdb.XClaim(ctx, &redis.XClaimArgs{Stream: keys.Stream(), Group: "g1", Consumer: "d", Messages: ids[6:7]}).Result()
	if err != nil || len(msgs) != 1 || msgs[0].Values[fieldJobID] != jobID(6) {
		t.Errorf("claiming the pending entry after trim: %v %v", msgs, err)
	}
}

// The worker's maintenance trims what it acknowledged.
func TestWorkerTrimsAcknowledgedEntries(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	for i := range 20 {
		enqueue(t, rdb, keys, message(i, nil))
	}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, TrimInterval: 50 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	testenv.WaitFor(t, 10*time.Second, "an empty stream", func() bool { return rdb.XLen(context.Background(), keys.Stream()).Val() == 0 })
}

// Consumer hygiene deletes idle consumers with nothing pending, never one with pending
// entries (XGROUP DELCONSUMER would drop them from the PEL), nor the caller.
func TestDeleteIdleConsumersKeepsThoseWithPendingEntries(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, rdb, keys, message(1, nil))
	if err := rdb.XReadGroup(ctx, readArgs(keys, "holder", 1)).Err(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"idle-empty", "self"} {
		if err := rdb.XGroupCreateConsumer(ctx, keys.Stream(), DefaultGroup, c).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if names, err := DeleteIdleConsumers(ctx, rdb, keys, DefaultGroup, "self", time.Hour); err != nil || len(names) != 0 {
		t.Fatalf("deleted %v %v with nobody idle for an hour", names, err)
	}
	time.Sleep(250 * time.Millisecond)
	if err := rdb.XGroupCreateConsumer(ctx, keys.Stream(), DefaultGroup, "fresh").Err(); err != nil {
		t.Fatal(err)
	}
	names, err := DeleteIdleConsumers(ctx, rdb, keys, DefaultGroup, "self", 200*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(names, []string{"idle-empty"}) {
		t.Errorf("deleted %v, want [idle-empty]", names)
	}
	var left []string
	for _, c := range rdb.XInfoConsumers(ctx, keys.Stream(), DefaultGroup).Val() {
		left = append(left, c.Name)
	}
	slices.Sort(left)
	if !slices.Equal(left, []string{"fresh", "holder", "self"}) {
		t.Errorf("consumers left %v", left)
	}
	if p := pendingIDs(t, rdb, keys, DefaultGroup); !slices.Equal(p, ids) {
		t.Errorf("pending %v, want %v", p, ids)
	}
}

// Redis 7.0 does not refresh a consumer's idle time on a read that returns nothing, so a
// live worker waiting on an empty stream looks idle and may be deleted. That is harmless
// because only consumers with nothing pending are deleted: the worker's next read
// recreates it and it goes on working.
func TestDeletingALiveIdleWorkerIsHarmless(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	var runs counter
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "live", Handler: HandlerFunc(func(_ context.Context, j *Job) error {
		runs.inc(j.JobID)
		return nil
	})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 5*time.Second, "the first job", func() bool { return runs.get(jobID(1)) == 1 })
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	time.Sleep(400 * time.Millisecond)
	names, err := DeleteIdleConsumers(ctx, rdb, keys, DefaultGroup, "other", 300*time.Millisecond)
	if err != nil || !slices.Equal(names, []string{"live"}) {
		t.Fatalf("deleted %v %v, want [live]", names, err)
	}
	enqueue(t, rdb, keys, message(2, nil))
	testenv.WaitFor(t, 5*time.Second, "a job after the deletion", func() bool { return runs.get(jobID(2)) == 1 })
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
}

func TestReadStatsCountsLengthPendingAndOldestIdle(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if s, err := ReadStats(ctx, rdb, keys, DefaultGroup); err != nil || s != (Stats{}) {
		t.Fatalf("stats of a missing queue: %+v %v", s, err)
	}
	enqueue(t, rdb, keys, message(1, nil), message(2, nil), message(3, nil))
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	if err := rdb.XReadGroup(ctx, readArgs(keys, "c", 2)).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	s, err := ReadStats(ctx, rdb, keys, DefaultGroup)
	if err != nil {
		t.Fatal(err)
	}
	if s.Length != 3 || s.Pending != 2 || s.OldestPendingIdle < 50*time.Millisecond || s.Dead != 0 {
		t.Errorf("stats %+v", s)
	}
}

func TestStalePendingListsOnlyEntriesIdleLongerThanAsked(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if got, err := StalePending(ctx, rdb, keys, DefaultGroup, 0, 10); err != nil || len(got) != 0 {
		t.Fatalf("stale entries of a missing queue: %v %v", got, err)
	}
	ids := enqueue(t, rdb, keys, message(1, nil), message(2, nil))
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	if err := rdb.XReadGroup(ctx, readArgs(keys, "old", 1)).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := rdb.XReadGroup(ctx, readArgs(keys, "new", 1)).Err(); err != nil {
		t.Fatal(err)
	}
	got, err := StalePending(ctx, rdb, keys, DefaultGroup, 200*time.Millisecond, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].ID != ids[0] || got[0].Consumer != "old" || got[0].Deliveries != 1 || got[0].Idle < 200*time.Millisecond {
		t.Errorf("stale entries %+v, want only %s of old", got, ids[0])
	}
}

// Trim releases the index of every job it removes, in batches (1,200 entries: three
// script calls), and only of those: a job still in the stream, or whose index points at a
// newer entry, keeps an index without TTL.
func TestTrimReleasesTheIndexesOfWhatItRemoves(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const n = 1200
	for i := range n {
		enqueue(t, rdb, keys, message(i, nil))
	}
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "c", Streams: []string{keys.Stream(), ">"}, Count: n}).Result()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range res[0].Messages[:n-1] { // the last one stays pending
		ids = append(ids, m.ID)
	}
	if err := rdb.XAck(ctx, keys.Stream(), DefaultGroup, ids...).Err(); err != nil {
		t.Fatal(err)
	}
	enqueue(t, rdb, keys, message(5, nil)) // job 5 enqueued again: its index names the new entry
	trimmed, err := Trim(ctx, rdb, keys, time.Hour)
	if err != nil || trimmed != n-1 {
		t.Fatalf("Trim = %d, %v; want %d", trimmed, err, n-1)
	}
	for _, i := range []int{0, 499, 500, 1000, n - 2} {
		if ttl := rdb.PTTL(ctx, keys.Job(jobID(i))).Val(); ttl <= 0 || ttl > time.Hour {
			t.Errorf("job %d's index TTL %v after its entry was trimmed, want at most 1h", i, ttl)
		}
	}
	for _, i := range []int{5, n - 1} {
		if ttl := rdb.PTTL(ctx, keys.Job(jobID(i))).Val(); ttl != -1 {
			t.Errorf("job %d's index TTL %v, want none (it is still in the stream)", i, ttl)
		}
	}
}

// EnqueueAt of a job (due in an hour), then Enqueue of the same id by the same tenant (a
// client's retry without RunAt): once the immediate entry ran and was trimmed, the
// index of the job still in the scheduled set does not expire (an index expires only
// after its job left the stream and the scheduled set), so JobState still finds it and
// the id stays the first tenant's.
func TestDelayedDuplicateKeepsItsIndexAfterTrim(t *testing.T) {
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

// Trim and DeleteIdleConsumers refuse keys that cannot name a queue, with Validate's
// error, before they reach Redis.
func TestTrimRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := Trim(context.Background(), rdb, keys, time.Hour)
		return err
	})
}

func TestDeleteIdleConsumersRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := DeleteIdleConsumers(context.Background(), rdb, keys, "workers", "me", time.Minute)
		return err
	})
}
