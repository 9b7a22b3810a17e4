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

// A relay process needs no workers: a Client with the senders only sends the effects
// that the worker processes commit.
func ExampleClient_RunRelay() {
	rdb, prefix, db, done := exampleStores(`SELECT 1`)
	defer done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// The worker process.
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(ctx context.Context, job *onceflow.Job[Refund]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("payments.refund", "refund:"+job.ID, job.Args)
			return nil
		})
	}))
	worker, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	go func() { _ = worker.RunWorkers(ctx) }()

	// The relay process.
	sent := make(chan string, 1)
	relay, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix,
		Senders: map[string]outbox.Sender{"payments.": outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
			sent <- m.Topic + " " + string(m.Payload)
			return nil
		})}})
	if err != nil {
		panic(err)
	}
	go func() { _ = relay.RunRelay(ctx) }()

	if _, err := worker.Enqueue(ctx, Refund{OrderID: "order-8", AmountCents: 900}, &onceflow.EnqueueOpts{Key: "refund-8"}); err != nil {
		panic(err)
	}
	fmt.Println(<-sent)
	// Output: payments.refund {"email": "", "order_id": "order-8", "amount_cents": 900}
}

// A workflow's Audit reads its own tables with the client's pool.
func ExampleInspector_DB() {
	rdb, prefix, db, done := exampleStores(`CREATE TABLE tickets (id text PRIMARY KEY)`)
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	var n int64
	if err := client.Inspector().DB().QueryRow(context.Background(), `SELECT count(*) FROM tickets`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("tickets:", n)
	// Output: tickets: 0
}
