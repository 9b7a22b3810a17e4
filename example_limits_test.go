package onceflow_test

import (
	"context"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// The model's calls go through the client's limiter: limits per model for every
// process, fair shares, and tenants' daily token budgets. A job whose call does not fit
// its tenant's budget waits, queued, without spending an attempt; JobState says why,
// and the limiter shows what the tenant spent.
func ExampleInspector_Limiter() {
	env := newModelExample(fakeserver.Config{}) // Redis, PostgreSQL and fake-llm for the example
	defer env.close()

	req := func(text string) *llm.Request {
		return &llm.Request{Model: "gpt-4.1-mini", MaxTokens: 100, Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise: " + text}}}
	}
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[summaryArgs](func(ctx context.Context, job *onceflow.Job[summaryArgs]) error {
		_, err := job.Complete(ctx, "summarise", req(job.Args.Text))
		return err // a call put off by the limiter: the job waits
	}))
	client, err := onceflow.NewClient(onceflow.Config{
		Redis: env.rdb, DB: env.db, Prefix: env.prefix, Workers: workers,
		Model: openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"}),
		// Every tenant may spend one call's reservation a day: its prompt's estimate and
		// its 100 tokens of output.
		Limits: limiter.Config{TenantTokenBudget: int64(llm.EstimateTokens(req("ticket one")))},
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- client.Run(ctx) }()
	defer func() { cancel(); <-done }()

	wait := func(tenant, id string, ok func(*onceflow.JobState) bool) *onceflow.JobState {
		for {
			if st, err := client.JobState(ctx, tenant, id); err == nil && ok(st) {
				return st
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	first, _ := client.Enqueue(ctx, summaryArgs{Text: "ticket one"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	wait("acme", first.JobID, func(st *onceflow.JobState) bool { return st.Status == onceflow.StatusDone })
	second, _ := client.Enqueue(ctx, summaryArgs{Text: "ticket two"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	st := wait("acme", second.JobID, func(st *onceflow.JobState) bool { return st.Waiting != "" })
	fmt.Println(st.Status, "-", st.Waiting[:strings.Index(st.Waiting, " (")])

	usage, err := client.Inspector().Limiter().Usage(ctx, time.Now(), "acme")
	if err != nil {
		log.Fatal(err)
	}
	for _, u := range usage {
		fmt.Printf("%s: budget used %d of %d tokens\n", u.Tenant, u.BudgetUsed, client.Inspector().Limiter().Budget(u.Tenant))
	}
	// Output:
	// queued - token budget of tenant acme is spent for today
	// acme: budget used 19 of 113 tokens
}
