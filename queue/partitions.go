package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Budget is a concurrency budget shared by the Workers of one queue's partitions
// (WorkerConfig.Budget): at most its size of their handlers run at once, whichever
// partitions their jobs come from. A Worker whose partition is idle waits for new
// messages holding one slot of it, not its share, so the partitions that have a backlog
// use the rest. It also sums the partitions' sampled gauges (stream length, pending,
// dead letters, scheduled), which the Workers of one queue report under one label.
//
// Create it with NewBudget; it is safe for concurrent use.
type Budget struct {
	slots chan struct{}

	mu    sync.Mutex
	stats map[int]Stats // by partition
}

// NewBudget returns a budget of n slots (at least 1).
func NewBudget(n int) *Budget {
	return &Budget{slots: make(chan struct{}, max(n, 1)), stats: make(map[int]Stats)}
}

// Size returns the budget's number of slots.
func (b *Budget) Size() int { return cap(b.slots) }

// report records partition p's sample and returns every partition's sum.
func (b *Budget) report(p int, s Stats) Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.stats[p] = s
	var total Stats
	for _, st := range b.stats {
		total = total.Add(st)
	}
	return total
}

// registerPartitionsScript raises the recorded partitions of a queue, never lowers them
// (lua/register_partitions.lua).
var registerPartitionsScript = scripts.MustScript("lua/register_partitions.lua")

// RegisterPartitions records that queue keys.Queue has n partitions, unless more were
// recorded before, and returns the recorded count: the partitions its Workers must
// consume. Lowering a queue's partitions leaves jobs in the higher ones (queued,
// scheduled, dead letters); the Workers of a process started with the lower count still
// consume those, since they read this record. One round trip; safe to retry (it only
// raises a maximum). The record is never lowered by onceflow: an operator who has
// emptied the higher partitions may lower it (docs/queue.md, "Partitions").
func RegisterPartitions(ctx context.Context, rdb redis.Scripter, keys Keys, n int) (int, error) {
	if n < 1 || n > MaxPartitions {
		return 0, fmt.Errorf("queue: %d partitions: want 1 to %d", n, MaxPartitions)
	}
	if err := keys.Validate(); err != nil {
		return 0, err
	}
	got, err := registerPartitionsScript.Run(ctx, rdb, []string{PartitionsKey(keys.Prefix)}, keys.Queue, n).Int()
	if err != nil {
		return 0, fmt.Errorf("queue: register the partitions of %s: %w", keys.Queue, err)
	}
	return min(max(got, n), MaxPartitions), nil
}

// KnownPartitions returns the most partitions queue keys.Queue was registered with, at
// least n: those that may hold its jobs. A record that is not a count (written by hand)
// counts as none: n. One round trip.
func KnownPartitions(ctx context.Context, rdb redis.Cmdable, keys Keys, n int) (int, error) {
	v, err := rdb.HGet(ctx, PartitionsKey(keys.Prefix), keys.Queue).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return max(n, 1), fmt.Errorf("queue: read the partitions of %s: %w", keys.Queue, err)
	}
	got, _ := strconv.Atoi(v)
	return min(max(got, n, 1), MaxPartitions), nil
}
