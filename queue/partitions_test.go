package queue

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// Partition 0's keys are an unpartitioned queue's (a queue that goes from one partition
// to several keeps its jobs where they are), and every other partition has a hash tag of
// its own.
func TestPartitionZeroIsTheUnpartitionedQueueAndEveryOtherHasItsOwnTag(t *testing.T) {
	t.Parallel()
	k := Keys{Prefix: "p", Queue: "q"}
	if got := k.InPartition(0).Stream(); got != "p:{q}:stream" {
		t.Fatalf("partition 0 stream %q, want p:{q}:stream", got)
	}
	if got := k.InPartition(2).Job("j"); got != "p:{q:2}:job:j" {
		t.Fatalf("partition 2 job key %q, want p:{q:2}:job:j", got)
	}
	if got := k.InPartition(2).Name(); got != "q:2" {
		t.Fatalf("partition 2 name %q, want q:2", got)
	}
	if n := len(k.Partitions(0)); n != 1 {
		t.Fatalf("Partitions(0) gave %d, want 1", n)
	}
	for _, p := range []int{-1, MaxPartitions} {
		if err := k.InPartition(p).Validate(); err == nil {
			t.Fatalf("partition %d validated", p)
		}
	}
}

// PartitionOf spreads job ids evenly and gives the same answer every time; one
// partition is always 0.
func TestPartitionOfSpreadsJobs(t *testing.T) {
	t.Parallel()
	const n, jobs = 3, 3000
	counts := make([]int, n)
	for i := range jobs {
		id := jobID(i)
		p := PartitionOf(id, n)
		if p != PartitionOf(id, n) || p < 0 || p >= n {
			t.Fatalf("PartitionOf(%s) = %d, then %d", id, p, PartitionOf(id, n))
		}
		if PartitionOf(id, 1) != 0 || PartitionOf(id, 0) != 0 {
			t.Fatal("one partition must be partition 0")
		}
		counts[p]++
	}
	for p, c := range counts {
		if c < jobs/n*85/100 || c > jobs/n*115/100 {
			t.Fatalf("partition %d has %d of %d jobs: %v, want about %d each", p, c, jobs, counts, jobs/n)
		}
	}
}

// The record of a queue's partitions only grows, and a queue never partitioned has none.
func TestRegisterPartitionsKeepsTheMost(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "q"}
	for _, step := range []struct{ register, want int }{{1, 1}, {4, 4}, {2, 4}, {1, 4}} {
		got, err := RegisterPartitions(ctx, rdb, keys, step.register)
		if err != nil || got != step.want {
			t.Fatalf("RegisterPartitions(%d) = %d, %v; want %d", step.register, got, err, step.want)
		}
	}
	if n, err := KnownPartitions(ctx, rdb, Keys{Prefix: prefix, Queue: "never"}, 1); n != 1 || err != nil {
		t.Fatalf("a queue never partitioned: %d, %v; want 1", n, err)
	}
	if ex, _ := rdb.HExists(ctx, PartitionsKey(prefix), "never").Result(); ex {
		t.Fatal("registering one partition wrote a record")
	}
	if _, err := RegisterPartitions(ctx, rdb, keys, MaxPartitions+1); err == nil {
		t.Fatal("more than MaxPartitions registered")
	}
}

// The two ways a process's workers share a queue's budget: one worker of all the
// partitions (as the Client starts them), and one worker per partition on a shared Budget
// (as the Client adds partitions recorded after it started).
var budgetShapes = []struct {
	name         string
	perPartition bool
}{{"one worker", false}, {"a worker per partition", true}}

// partitionWorkers starts workers of the parts partitions of keys with a budget of size
// slots (one worker of them all, or one per partition sharing a Budget), running h,
// reads blocking for block, and stops them at the end of the test.
func partitionWorkers(t *testing.T, rdb redis.UniversalClient, keys Keys, parts, size int, perPartition bool, block time.Duration, h HandlerFunc) {
	t.Helper()
	budget := NewBudget(size)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	cfgs := []WorkerConfig{{Keys: keys, Partitions: parts, Budget: budget}}
	if perPartition {
		cfgs = nil
		for _, k := range keys.Partitions(parts) {
			cfgs = append(cfgs, WorkerConfig{Keys: k, Budget: budget})
		}
	}
	for _, cfg := range cfgs {
		k := cfg.Keys
		cfg.Redis, cfg.Handler, cfg.Block, cfg.Logger = rdb, h, block, slog.New(slog.DiscardHandler)
		w, err := NewWorker(cfg)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			if err := w.Run(ctx); err != nil {
				t.Errorf("partition %d: %v", k.Partition, err)
			}
		})
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// The partitions of a queue share one budget: together they never run more than its
// size at once, and a backlog in one partition uses the slots the idle partitions do
// not: each idle one waits for work holding one slot at most. (A reader that took every
// free slot into its blocking read of an idle stream held them for the whole Block, 5s
// here, while the backlog waited: the busy partition reached its share within 2.5s in 4
// of 6 runs.)
func TestPartitionsShareOneBudget(t *testing.T) {
	t.Parallel()
	for _, shape := range budgetShapes {
		t.Run(shape.name, func(t *testing.T) {
			t.Parallel()
			testPartitionsShareOneBudget(t, shape.perPartition)
		})
	}
}

func testPartitionsShareOneBudget(t *testing.T, perPartition bool) {
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "shared"}
	const parts, size = 3, 8
	var running, peak, ran atomic.Int64
	release := make(chan struct{})
	partitionWorkers(t, rdb, keys, parts, size, perPartition, 5*time.Second, func(ctx context.Context, j *Job) error {
		n := running.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
		running.Add(-1)
		ran.Add(1)
		return nil
	})
	// A backlog in partition 0 only.
	busy := keys.InPartition(0)
	for i := range 3 * size {
		if _, err := Enqueue(ctx, rdb, busy, Message{JobID: jobID(i + 1), Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	want := int64(size - (parts - 1))
	// Well within one Block of the idle partitions' readers.
	testenv.WaitFor(t, 2500*time.Millisecond, fmt.Sprintf("%d handlers of the busy partition running at once", want), func() bool {
		return running.Load() >= want
	})
	if p := peak.Load(); p > size {
		t.Fatalf("%d handlers at once, over the budget of %d", p, size)
	}
	// Then jobs in every partition: still never more than the budget.
	for i := range 3 * size {
		k := keys.InPartition(i % parts)
		if _, err := Enqueue(ctx, rdb, k, Message{JobID: jobID(1000 + i), Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	close(release)
	testenv.WaitFor(t, 30*time.Second, "every job", func() bool { return ran.Load() == 6*size })
	if p := peak.Load(); p > size || p < want {
		t.Fatalf("peak %d handlers at once: want %d to %d", p, want, size)
	}
}

// On a Redis Cluster (3 primaries) the partitions of a queue land on different nodes,
// and one worker of them all runs every job of every partition.
func TestPartitionsSpreadOverARedisCluster(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rdb, err := connect.RedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	keys := Keys{Prefix: testenv.Prefix(t), Queue: "spread"}
	const parts, jobs = 6, 120
	nodes := map[string]int{}
	for _, k := range keys.Partitions(parts) {
		owner, err := rdb.MasterForKey(ctx, k.Stream())
		if err != nil {
			t.Fatal(err)
		}
		nodes[owner.Options().Addr]++
	}
	if len(nodes) < 2 {
		t.Fatalf("%d partitions on %d node(s) %v: want them spread", parts, len(nodes), nodes)
	}
	for i := range jobs {
		id := jobID(i + 1)
		k := keys.InPartition(PartitionOf(id, parts))
		if _, err := Enqueue(ctx, rdb, k, Message{JobID: id, Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	seen := map[string]int{}
	partitionWorkers(t, rdb, keys, parts, 16, false, 200*time.Millisecond, func(_ context.Context, j *Job) error {
		mu.Lock()
		seen[j.JobID]++
		mu.Unlock()
		return nil
	})
	testenv.WaitFor(t, 30*time.Second, "every job run and acknowledged", func() bool {
		mu.Lock()
		n := len(seen)
		mu.Unlock()
		st, err := ReadStatsOf(ctx, rdb, keys.Partitions(parts), DefaultGroup)
		return n == jobs && err == nil && st.Pending == 0 && st.Dead == 0
	})
	mu.Lock()
	defer mu.Unlock()
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("job %s ran %d times", id, n)
		}
	}
	t.Logf("%d partitions on nodes %v", parts, nodes)
}

// A shared Budget smaller than (or equal to) the number of partitions does not starve a
// backlog: the idle partitions' reads do not hold the budget's slots in their blocking
// XREADGROUP (4 partitions, a budget of 2: 20 instant jobs run in well under a Block each,
// as one unpartitioned worker of Concurrency 2 runs them).
func TestBudgetSmallerThanThePartitionsDoesNotStarveABacklog(t *testing.T) {
	t.Parallel()
	for _, shape := range budgetShapes {
		t.Run(shape.name, func(t *testing.T) {
			t.Parallel()
			testBudgetSmallerThanThePartitions(t, shape.perPartition)
		})
	}
}

func testBudgetSmallerThanThePartitions(t *testing.T, perPartition bool) {
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "starve"}
	const parts, size, jobs = 4, 2, 20
	var ran atomic.Int64
	// The Client's workers use DefaultBlock.
	partitionWorkers(t, rdb, keys, parts, size, perPartition, DefaultBlock, func(ctx context.Context, j *Job) error {
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

// The P:partitions record, which docs/queue.md tells operators to write by hand (HSET),
// is read alike by KnownPartitions and RegisterPartitions, whatever it holds.
func TestPartitionsRecordIsReadAlikeWhateverItHolds(t *testing.T) {
	t.Parallel()
	// A record that is not an integer ("4 " or "") does not make KnownPartitions fail (and
	// with it `onceflow dlq` and JobState of an id outside its partition): it reads it as
	// RegisterPartitions does.
	t.Run("a malformed one is read as registration reads it", func(t *testing.T) {
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
	})
	// An over-large record is clamped to MaxPartitions by both readers (a worker never
	// starts more than 256 readers), and a negative one is overwritten by the next
	// registration.
	t.Run("one out of range is clamped or overwritten", func(t *testing.T) {
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
	})
}

// RegisterPartitions refuses keys that cannot name a queue, with Validate's error,
// before it records anything.
func TestRegisterPartitionsRefusesAnInvalidQueueName(t *testing.T) {
	t.Parallel()
	refusesInvalidKeys(t, func(rdb redis.UniversalClient, keys Keys) error {
		_, err := RegisterPartitions(context.Background(), rdb, keys, 2)
		return err
	})
}
