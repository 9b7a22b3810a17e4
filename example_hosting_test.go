package onceflow_test

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/outbox"
)

// Workers and relay in processes of their own, as `onceflow work --queue` and
// `onceflow relay` run them: RunWorkers commits the job and its effect, RunRelay sends
// the effect.
func ExampleClient_RunWorkers() {
	rdb, prefix, db, done := exampleStores(`SELECT 1`)
	defer done()
	sent := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(ctx context.Context, job *onceflow.Job[Refund]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("payments.refund", "refund:"+job.ID, job.Args)
			return nil
		})
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers,
		Senders: map[string]outbox.Sender{"payments.refund": outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
			sent <- m.Topic
			return nil
		})}})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = client.RunWorkers(ctx, onceflow.DefaultQueue) }() // the worker process
	go func() { _ = client.RunRelay(ctx) }()                          // the relay process

	if _, err := client.Enqueue(ctx, Refund{OrderID: "order-7", AmountCents: 500}, &onceflow.EnqueueOpts{Key: "refund-7"}); err != nil {
		panic(err)
	}
	fmt.Println("sent", <-sent)
	// Output: sent payments.refund
}

// Audit says what it read and what it found; a workflow's Audit adds its own tables.
func ExampleClient_Audit() {
	rdb, prefix, db, done := exampleStores(`SELECT 1`)
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	r, err := client.Audit(context.Background())
	if err != nil {
		panic(err)
	}
	fmt.Println(r.Checked, r.OK(), r.Violations)
	// Output: [queue default job_completions outbox] true []
}
