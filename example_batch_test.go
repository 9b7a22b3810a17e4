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
