package queue

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// On a Redis Cluster (3 primaries, 3 replicas, on loopback) a cluster client seeded with
// a node that does not hold the queue's slot enqueues and works jobs: every key of a
// queue carries its hash tag, so each script runs on the node that owns the slot, and
// the client follows MOVED to it. (Issue 18's first step: the queue's partitions come
// next.)
func TestQueueWorksOnARedisClusterFromAnyNode(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	keys := Keys{Prefix: testenv.Prefix(t), Queue: "clustered"}
	// Find a node that is not the primary of the queue's slot, and seed the client with it.
	probe := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	owner, err := probe.MasterForKey(ctx, keys.Stream())
	if err != nil {
		t.Fatal(err)
	}
	ownerAddr := owner.Options().Addr
	_ = probe.Close()
	seed := ""
	for _, a := range c.Addrs() {
		if a != ownerAddr {
			seed = a
			break
		}
	}
	rdb, err := connect.RedisCluster("redis://" + seed)
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	const n = 20
	for i := range n {
		if _, err := Enqueue(ctx, rdb, keys, Message{JobID: jobID(i + 1), Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatalf("enqueue %d through %s (the slot is on %s): %v", i, seed, ownerAddr, err)
		}
	}
	var ran atomic.Int64
	w, err := NewWorker(WorkerConfig{Redis: rdb, Keys: keys, Logger: slog.New(slog.DiscardHandler),
		Handler: HandlerFunc(func(context.Context, *Job) error { ran.Add(1); return nil })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx) }()
	testenv.WaitFor(t, 30*time.Second, "every job run", func() bool {
		st, err := ReadStats(ctx, rdb, keys, DefaultGroup)
		return ran.Load() == n && err == nil && st.Pending == 0
	})
	wcancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if ran.Load() != n {
		t.Fatalf("%d runs, want %d", ran.Load(), n)
	}
}
