package onceflow_test

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow"
)

// A Worker that waits for something snoozes: the job runs again after the delay,
// holding no worker meanwhile, and spends no attempt (its Delivery stays 1).
func ExampleSnooze() {
	rdb, prefix, _, done := exampleStores("SELECT 1")
	defer done()
	ran := make(chan string, 4)
	ready := time.Now().Add(300 * time.Millisecond) // the thumbnail service's window opens
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Resize](func(ctx context.Context, job *onceflow.Job[Resize]) error {
		if wait := time.Until(ready); wait > 0 {
			ran <- fmt.Sprintf("delivery %d: not yet", job.Delivery)
			return onceflow.Snooze(wait)
		}
		ran <- fmt.Sprintf("delivery %d: resized", job.Delivery)
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = client.Run(ctx) }()
	if _, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 64}, nil); err != nil {
		panic(err)
	}
	fmt.Println(<-ran)
	fmt.Println(<-ran)
	// Output:
	// delivery 1: not yet
	// delivery 1: resized
}

// EnqueueOpts.RunAt delays a job: until its time it waits in the queue's scheduled set,
// and JobState says queued, with the time.
func ExampleEnqueueOpts_runAt() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	at := time.Now().Add(time.Hour).Truncate(time.Millisecond)
	res, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 64},
		&onceflow.EnqueueOpts{Tenant: "acme", RunAt: at})
	if err != nil {
		panic(err)
	}
	st, err := client.JobState(ctx, "acme", res.JobID)
	if err != nil {
		panic(err)
	}
	fmt.Println(st.Status, st.RunAt.Equal(at))
	// Output: queued true
}
