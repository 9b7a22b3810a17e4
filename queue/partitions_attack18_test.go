package queue

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// Found by the attack round of issue 18, failed before its fix: a shared Budget smaller than (or equal to) the number of partitions starves a
// backlog. Each idle partition's reader takes one slot into its blocking XREADGROUP and
// holds it for the whole Block; with 4 partitions and a budget of 2, the idle readers
// (3 of them) hold the 2 slots nearly all the time, and the busy partition runs about one
// job per Block. 20 instant jobs, which one unpartitioned worker of Concurrency 2 runs in
// milliseconds, take ~10-20 s here. NewClient accepts Partitions > Concurrency (and a
// malformed/over-large P:partitions record, clamped to 256 readers, does the same to the
// default Concurrency 64).
func TestAttack18BudgetStarvesBacklogWhenPartitionsOutnumberSlots(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "starve"}
	const parts, size, jobs = 4, 2, 20
	var ran atomic.Int64
	// The Client's workers use DefaultBlock (1s).
	partitionWorkers(t, rdb, keys, parts, size, DefaultBlock, func(ctx context.Context, j *Job) error {
		ran.Add(1)
		return nil
	})
	time.Sleep(300 * time.Millisecond) // the idle readers are blocking
	busy := keys.InPartition(parts - 1)
	start := time.Now()
	for i := range jobs {
		if _, err := Enqueue(ctx, rdb, busy, Message{JobID: jobID(i + 1), Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(4 * time.Second)
	for ran.Load() < jobs && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := ran.Load(); n < jobs {
		t.Fatalf("after %v only %d of %d instant jobs of the busy partition ran: %d idle partitions' readers hold the budget of %d in their blocking reads",
			time.Since(start).Round(time.Millisecond), n, jobs, parts-1, size)
	}
}

// Found by the attack round of issue 18, failed before its fix: a P:partitions record that is not an integer (an operator's hand-written HSET,
// which docs/queue.md tells them to do, e.g. "4 " or "") makes KnownPartitions fail, so
// every reader of it fails: `onceflow dlq` refuses to run, JobState of an id not in its
// own partition answers an error (503) instead of ErrJobNotFound. RegisterPartitions
// treats the same value as 0 and overwrites it: the two disagree. KnownPartitions should
// treat it as RegisterPartitions does (or the configured count), not fail.
func TestAttack18KnownPartitionsMalformedRecord(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "q"}
	for _, v := range []string{"abc", "4 ", "", "2.0"} {
		if err := rdb.HSet(ctx, PartitionsKey(prefix), "q", v).Err(); err != nil {
			t.Fatal(err)
		}
		n, err := KnownPartitions(ctx, rdb, keys, 2)
		if err != nil || n < 2 {
			t.Errorf("record %q: KnownPartitions = %d, %v; want at least the configured 2, no error", v, n, err)
		}
	}
}

// Guard (attack round of issue 18): an over-large record is clamped to MaxPartitions by both readers (a worker
// never starts more than 256 readers), and a negative one is overwritten by the next
// registration.
func TestAttack18PartitionsRecordOutOfRange(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "q"}
	rdb.HSet(ctx, PartitionsKey(prefix), "q", "999999")
	if n, err := RegisterPartitions(ctx, rdb, keys, 2); err != nil || n != MaxPartitions {
		t.Fatalf("record 999999: RegisterPartitions = %d, %v; want %d", n, err, MaxPartitions)
	}
	if n, err := KnownPartitions(ctx, rdb, keys, 2); err != nil || n != MaxPartitions {
		t.Fatalf("record 999999: KnownPartitions = %d, %v; want %d", n, err, MaxPartitions)
	}
	rdb.HSet(ctx, PartitionsKey(prefix), "q", "-1")
	if n, err := RegisterPartitions(ctx, rdb, keys, 3); err != nil || n != 3 {
		t.Fatalf("record -1: RegisterPartitions = %d, %v; want 3", n, err)
	}
	if v, _ := rdb.HGet(ctx, PartitionsKey(prefix), "q").Result(); v != "3" {
		t.Fatalf("record after registering 3 over -1: %q", v)
	}
}
