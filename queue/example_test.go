package queue_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// A producer enqueues a job with an id derived from the request; a worker runs it. The
// handler must be idempotent: the same job may be delivered more than once.
func Example() {
	ctx := context.Background()
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL")) // no hidden retries of XADD
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	keys := queue.Keys{Prefix: fmt.Sprintf("example%d", time.Now().UnixNano()), Queue: "summaries"}
	defer tidy(rdb, keys.Prefix)

	_, err = queue.Enqueue(ctx, rdb, keys, queue.Message{
		JobID:   "6f1c3a8e-2b5d-5e7f-9a1b-3c4d5e6f7a8b", // a UUIDv5 of the request's idempotency scope
		Tenant:  "acme",
		Payload: json.RawMessage(`{"text":"Quarterly numbers are up."}`),
	})
	if err != nil {
		panic(err)
	}

	done := make(chan struct{})
	w, err := queue.NewWorker(queue.WorkerConfig{
		Redis: rdb,
		Keys:  keys,
		Handler: queue.HandlerFunc(func(ctx context.Context, job *queue.Job) error {
			fmt.Printf("job %s for %s, delivery %d: %s\n", job.JobID, job.Tenant, job.Deliveries, job.Payload)
			close(done)
			return nil // acknowledged; return retry.Permanent(err) to dead-letter instead
		}),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	stopped := make(chan error)
	go func() { stopped <- w.Run(ctx) }()
	<-done
	cancel() // graceful: waits for running jobs, flushes acknowledgements
	fmt.Println("stopped:", <-stopped)
	// Output:
	// job 6f1c3a8e-2b5d-5e7f-9a1b-3c4d5e6f7a8b for acme, delivery 1: {"text":"Quarterly numbers are up."}
	// stopped: <nil>
}

// An operator's view of the dead-letter stream: list, then replay or purge.
func ExampleReplay() {
	ctx := context.Background()
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL")) // no hidden retries of XADD
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	keys := queue.Keys{Prefix: fmt.Sprintf("example%d", time.Now().UnixNano()), Queue: "summaries"}
	defer tidy(rdb, keys.Prefix)

	// Dead-letter one job: its handler fails permanently.
	jobID := "0b6f9d2e-8c1a-5f3b-a4d7-e2c9b8a7f6d5"
	if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: jobID, Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
		panic(err)
	}
	w, _ := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error {
			return retry.Permanent(fmt.Errorf("400 context_length_exceeded"))
		})})
	wctx, cancel := context.WithCancel(ctx)
	stopped := make(chan error)
	go func() { stopped <- w.Run(wctx) }()
	for {
		if dead, _, _ := queue.ListDead(ctx, rdb, keys, "", 10); len(dead) == 1 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-stopped // the worker is gone: the replayed job stays queued

	dead, _, err := queue.ListDead(ctx, rdb, keys, "", 100)
	if err != nil {
		panic(err)
	}
	for _, d := range dead {
		fmt.Println(d.JobID, d.Deliveries, d.Reason)
		if _, err := queue.Replay(ctx, rdb, keys, d.ID); err != nil {
			panic(err)
		}
	}
	_, state, _, _ := queue.JobState(ctx, rdb, keys, jobID)
	fmt.Println("after replay:", state)
	// Output:
	// 0b6f9d2e-8c1a-5f3b-a4d7-e2c9b8a7f6d5 1 permanent: 400 context_length_exceeded
	// after replay: queued
}

// tidy removes the keys an example made under prefix.
func tidy(rdb *redis.Client, prefix string) {
	ctx := context.Background()
	if keys, _ := rdb.Keys(ctx, prefix+":*").Result(); len(keys) > 0 {
		rdb.Del(ctx, keys...)
	}
}

// A queue of 3 partitions: every producer puts a job in the partition of its id
// (PartitionOf), records the count (RegisterPartitions), and one Worker consumes all 3
// with one budget of slots (WorkerConfig.Partitions), reading the partitions one Redis
// node holds in one round trip.
func ExampleWorkerConfig_partitions() {
	ctx := context.Background()
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	keys := queue.Keys{Prefix: fmt.Sprintf("example%d", time.Now().UnixNano()), Queue: "summaries"}
	defer tidy(rdb, keys.Prefix)

	const partitions = 3
	if _, err := queue.RegisterPartitions(ctx, rdb, keys, partitions); err != nil {
		panic(err)
	}
	ids := []string{ // UUIDs, derived from each request's idempotency scope
		"6f1c3a8e-2b5d-5e7f-9a1b-3c4d5e6f7a81", "6f1c3a8e-2b5d-5e7f-9a1b-3c4d5e6f7a82",
		"6f1c3a8e-2b5d-5e7f-9a1b-3c4d5e6f7a83", "6f1c3a8e-2b5d-5e7f-9a1b-3c4d5e6f7a84",
	}
	var placed []int
	for _, id := range ids {
		p := queue.PartitionOf(id, partitions) // the same in every process
		placed = append(placed, p)
		if _, err := queue.Enqueue(ctx, rdb, keys.InPartition(p), queue.Message{JobID: id, Tenant: "acme", Payload: json.RawMessage(`{}`)}); err != nil {
			panic(err)
		}
	}

	ran := make(chan string, len(ids))
	w, err := queue.NewWorker(queue.WorkerConfig{
		Redis:      rdb,
		Keys:       keys, // partition 0 and, with Partitions, the ones after it
		Partitions: partitions,
		Handler: queue.HandlerFunc(func(ctx context.Context, job *queue.Job) error {
			ran <- job.JobID
			return nil
		}),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		panic(err)
	}
	fmt.Println("partitions:", placed)
	run, cancel := context.WithCancel(ctx)
	stopped := make(chan error)
	go func() { stopped <- w.Run(run) }()
	seen := map[string]bool{}
	for range ids {
		seen[<-ran] = true
	}
	cancel()
	fmt.Println("ran:", len(seen), "stopped:", <-stopped)
	n, err := queue.KnownPartitions(ctx, rdb, keys, 1) // what a worker configured with 1 consumes
	fmt.Println("known partitions:", n, err)
	// Output:
	// partitions: [0 1 2 1]
	// ran: 4 stopped: <nil>
	// known partitions: 3 <nil>
}
