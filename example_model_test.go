package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

type summaryArgs struct {
	Text string `json:"text"`
}

func (summaryArgs) Kind() string { return "example.summary" }

// A Worker calls the model as one step of its job. Its first delivery dies after the
// call; the queue delivers the job again, and the step's recorded answer comes back
// from the ledger: one model call.
func ExampleJob_Complete() {
	env := newModelExample(fakeserver.Config{}) // Redis, PostgreSQL and fake-llm for the example
	defer env.close()

	answers := make(chan string, 2)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[summaryArgs](func(ctx context.Context, job *onceflow.Job[summaryArgs]) error {
		step, err := job.Complete(ctx, "summarise", &llm.Request{
			Model:    "gpt-4.1-mini",
			Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise:\n" + job.Args.Text}},
		})
		if err != nil {
			return err // as it is: an outage hands the job back, a 400 dead-letters it
		}
		answers <- step.Response.Content
		if job.Delivery == 1 {
			return errors.New("the worker dies before it finishes") // delivered again
		}
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{
		Redis: env.rdb, DB: env.db, Prefix: env.prefix, Workers: workers,
		Model:  openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"}),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Second}},
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- client.Run(ctx) }()
	defer func() { cancel(); <-done }()

	if _, err := client.Enqueue(ctx, summaryArgs{Text: "The quarter went well."}, nil); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-answers)
	fmt.Println(<-answers)
	fmt.Println("model calls:", env.model.Stats().Requests)
	// Output:
	// Summary d249a61d: The quarter went well. (4 words)
	// Summary d249a61d: The quarter went well. (4 words)
	// model calls: 1
}

// A Worker streams a step's answer, passing the text on as it arrives. The final chunk
// comes once the answer is recorded; Step then holds the whole answer.
func ExampleJob_Stream() {
	env := newModelExample(fakeserver.Config{})
	defer env.close()

	finished := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[summaryArgs](func(ctx context.Context, job *onceflow.Job[summaryArgs]) error {
		stream := job.Stream(ctx, "draft", &llm.Request{
			Model:    "gpt-4.1-mini",
			Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise:\n" + job.Args.Text}},
		})
		var text strings.Builder
		for chunk, err := range stream.All() {
			if err != nil {
				return err // after a drop: delivered again, and the ledger decides
			}
			text.WriteString(chunk.Content) // pass it on: a progress row, a websocket
		}
		finished <- fmt.Sprintf("%s (%s)", text.String(), stream.Step().Response.FinishReason)
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{
		Redis: env.rdb, DB: env.db, Prefix: env.prefix, Workers: workers,
		Model: openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"}),
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- client.Run(ctx) }()
	defer func() { cancel(); <-done }()

	if _, err := client.Enqueue(ctx, summaryArgs{Text: "Shipping was late twice."}, nil); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-finished)
	// Output: Summary f7127dbd: Shipping was late twice. (4 words) (stop)
}

type ticketTurn struct {
	Ticket string `json:"ticket"`
}

func (ticketTurn) Kind() string { return "example.ticket" }

// An agent's turn with a refund tool: the model (fake-llm told which tool to call)
// asks for a refund, and the Worker sends it to the payments service with ToolKey as
// its Idempotency-Key. The first delivery dies after the refund went out; the second
// sends it again with the same key, and the payments service refunds once.
func ExampleStep_ToolKey() {
	env := newModelExample(fakeserver.Config{
		ToolChoice: fakeserver.CallTool("issue_refund", json.RawMessage(`{"order_id":"A-17","amount_cents":1299}`)),
	})
	defer env.close()
	payments := newPayments() // honours Idempotency-Key: one refund per key
	defer payments.Close()

	sent := make(chan string, 2)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[ticketTurn](func(ctx context.Context, job *onceflow.Job[ticketTurn]) error {
		step, err := job.Complete(ctx, "agent", &llm.Request{
			Model:    "gpt-4.1-mini",
			Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Ticket}},
			Tools: []llm.Tool{{Name: "issue_refund", Parameters: json.RawMessage(
				`{"type":"object","properties":{"order_id":{"type":"string"},"amount_cents":{"type":"integer"}}}`)}},
		})
		if err != nil {
			return err
		}
		for _, call := range step.Response.ToolCalls {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, payments.URL, strings.NewReader(call.Arguments))
			req.Header.Set("Idempotency-Key", step.ToolKey(call))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			sent <- call.Name + " " + call.Arguments
		}
		if job.Delivery == 1 {
			return errors.New("the worker dies after the refund went out")
		}
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{
		Redis: env.rdb, DB: env.db, Prefix: env.prefix, Workers: workers,
		Model:  openai.New(openai.Config{BaseURL: env.modelURL, APIKey: "fake"}),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Second}},
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- client.Run(ctx) }()
	defer func() { cancel(); <-done }()

	if _, err := client.Enqueue(ctx, ticketTurn{Ticket: "Order A-17 arrived broken."}, nil); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-sent)
	fmt.Println(<-sent)
	fmt.Println("refund requests:", payments.requests(), "refunds:", payments.refunds())
	// Output:
	// issue_refund {"order_id":"A-17","amount_cents":1299}
	// issue_refund {"order_id":"A-17","amount_cents":1299}
	// refund requests: 2 refunds: 1
}

// payments is a payment service that honours Idempotency-Key.
type payments struct {
	*httptest.Server
	mu   sync.Mutex
	n    int
	keys map[string]bool
}

func newPayments() *payments {
	p := &payments{keys: map[string]bool{}}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.n++
		p.keys[r.Header.Get("Idempotency-Key")] = true
	}))
	return p
}

func (p *payments) requests() int { p.mu.Lock(); defer p.mu.Unlock(); return p.n }
func (p *payments) refunds() int  { p.mu.Lock(); defer p.mu.Unlock(); return len(p.keys) }

// modelExample is what the model examples run against: the test Redis and PostgreSQL
// (exampleStores) and fake-llm over HTTP.
type modelExample struct {
	rdb      *redis.Client
	prefix   string
	db       *pgxpool.Pool
	model    *fakeserver.Server
	modelURL string
	close    func()
}

func newModelExample(fcfg fakeserver.Config) *modelExample {
	e := &modelExample{}
	var done func()
	e.rdb, e.prefix, e.db, done = exampleStores("SELECT 1")
	fcfg.Logger = slog.New(slog.DiscardHandler)
	model, err := fakeserver.New(fcfg)
	must(err)
	srv := httptest.NewServer(model)
	e.model, e.modelURL = model, srv.URL+"/v1"
	e.close = func() { model.Close(); srv.Close(); done() }
	return e
}
