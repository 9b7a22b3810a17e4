package onceflow_test

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// Ledger reads the llm_calls row of a step by its key: the recorded answer every later
// delivery of the job gets instead of a second model call.
func ExampleInspector_Ledger() {
	env := newModelExample(fakeserver.Config{}) // Redis, PostgreSQL and fake-llm for the example
	defer env.close()
	keys := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[summaryArgs](func(ctx context.Context, job *onceflow.Job[summaryArgs]) error {
		step, err := job.Complete(ctx, "summarise", &llm.Request{Model: "gpt-4.1-mini",
			Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise:\n" + job.Args.Text}}})
		if err != nil {
			return err
		}
		// The answer is recorded with the job's Commit (or, without one, when the
		// delivery ends).
		err = job.Commit(ctx, func(c *onceflow.Commit) error { c.Result(step.Response.Content); return nil })
		keys <- step.Key
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: env.rdb, DB: env.db, Prefix: env.prefix, Workers: workers,
		Model: openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"}), Provider: "openai"})
	must(err)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()
	_, err = client.Enqueue(ctx, summaryArgs{Text: "Two parcels, one refund."}, nil)
	must(err)

	row, err := client.Inspector().Ledger().Get(ctx, <-keys)
	must(err)
	fmt.Println(row.State, row.Provider, row.Model, "attempts:", row.Attempt)
	// Output: succeeded openai gpt-4.1-mini attempts: 1
}

// ModelBreaker is open while the model's quota is exhausted or its calls keep failing
// (the queues then take no work); report it in a readiness check.
func ExampleInspector_ModelBreaker() {
	env := newModelExample(fakeserver.Config{})
	defer env.close()
	client, err := onceflow.NewClient(onceflow.Config{Redis: env.rdb, DB: env.db, Prefix: env.prefix,
		Model: openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"})})
	must(err)
	b := client.Inspector().ModelBreaker()
	fmt.Println(b.Name(), "open:", b.Err() != nil)
	// Output: llm open: false
}

// ToolKeys says, for each tool call of a step's answer, its key and the id the ledger
// first saw for it.
func ExampleStep_ToolKeys() {
	env := newModelExample(fakeserver.Config{
		ToolChoice: fakeserver.CallTool("issue_refund", json.RawMessage(`{"order_id":"A-17","amount_cents":1299}`)),
	})
	defer env.close()
	out := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[ticketTurn](func(ctx context.Context, job *onceflow.Job[ticketTurn]) error {
		step, err := job.Complete(ctx, "agent", &llm.Request{Model: "gpt-4.1-mini",
			Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Ticket}},
			Tools:    []llm.Tool{{Name: "issue_refund", Parameters: json.RawMessage(`{"type":"object"}`)}}})
		if err != nil {
			return err
		}
		for _, tk := range step.ToolKeys() {
			out <- fmt.Sprintf("%s %s key from ToolKey: %v", tk.Call.Name, tk.Call.Arguments, tk.Key == step.ToolKey(tk.Call))
		}
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: env.rdb, DB: env.db, Prefix: env.prefix, Workers: workers,
		Model: openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"})})
	must(err)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()
	_, err = client.Enqueue(ctx, ticketTurn{Ticket: "Order A-17 arrived broken."}, nil)
	must(err)
	fmt.Println(<-out)
	// Output: issue_refund {"order_id":"A-17","amount_cents":1299} key from ToolKey: true
}
