package onceflow_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
)

// A step in the batch lane: its job parks while the request waits for a batch (here a
// provider's batch API in memory), and resumes with the batch's answer, recorded in the
// ledger; the synchronous model is not asked.
func ExampleInBatch() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	answers := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		st, err := job.Complete(ctx, "summary", &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}},
			onceflow.InBatch(25*time.Hour))
		if err != nil {
			return err // the wait parks the job until the batch answers
		}
		answers <- st.Response.Content
		return nil
	}))
	sync := &modelsByName{answers: map[string]string{"gpt-4.1-mini": "a synchronous answer"}}
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: sync, NoLimits: true,
		Batch: onceflow.BatchConfig{API: &batchAPI{}, MaxAge: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	if _, err := client.Enqueue(context.Background(), shadowedTicket{Text: "the nightly report"}, nil); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-answers)
	fmt.Println(sync.count("gpt-4.1-mini"), "synchronous calls")
	// Output:
	// batched: the nightly report
	// 0 synchronous calls
}

// An operator's look at the batch lane, then a batch cancelled at the provider: the
// request it held is made in the synchronous lane, once, and its job goes on.
func ExampleClient_CancelBatch() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	answers := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		st, err := job.Complete(ctx, "summary", &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}},
			onceflow.InBatch(25*time.Hour))
		if err != nil {
			return err
		}
		answers <- st.Response.Content
		return nil
	}))
	sync := &modelsByName{answers: map[string]string{"gpt-4.1-mini": "a synchronous answer"}}
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: sync, NoLimits: true,
		Batch: onceflow.BatchConfig{API: &batchAPI{hold: true}, MaxAge: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	ctx := context.Background()
	if _, err := client.Enqueue(ctx, shadowedTicket{Text: "the nightly report"}, nil); err != nil {
		log.Fatal(err)
	}
	var lane *onceflow.BatchLane
	for lane == nil || len(lane.Batches) == 0 || lane.Batches[0].State != "submitted" {
		time.Sleep(20 * time.Millisecond)
		if lane, err = client.Inspector().Batches(ctx, 10); err != nil {
			log.Fatal(err)
		}
	}
	b := lane.Batches[0]
	fmt.Println(b.Model, b.State, b.Items, "request")
	if _, err := client.CancelBatch(ctx, b.BatchID); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-answers)
	// Output:
	// gpt-4.1-mini submitted 1 request
	// a synchronous answer
}

// The batch lane as an operator sees it (`onceflow batches list`): a request waiting
// for its batch, which goes out once the oldest request has waited MaxAge.
func ExampleInspector_Batches() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		_, err := job.Complete(ctx, "summary", &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}},
			onceflow.InBatch(25*time.Hour))
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: &modelsByName{}, NoLimits: true,
		Batch: onceflow.BatchConfig{API: &batchAPI{}, MaxAge: time.Hour, PollInterval: 20 * time.Millisecond}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	ctx := context.Background()
	if _, err := client.Enqueue(ctx, shadowedTicket{Text: "the nightly report"}, nil); err != nil {
		log.Fatal(err)
	}
	var lane *onceflow.BatchLane
	for lane == nil || lane.Pending["gpt-4.1-mini"] == 0 {
		time.Sleep(20 * time.Millisecond)
		if lane, err = client.Inspector().Batches(ctx, 10); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println(lane.Pending["gpt-4.1-mini"], "request of gpt-4.1-mini waits;", len(lane.Batches), "batches")
	// Output:
	// 1 request of gpt-4.1-mini waits; 0 batches
}
