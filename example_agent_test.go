package onceflow_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
)

type supportTicket struct {
	Order string `json:"order"`
}

func (supportTicket) Kind() string { return "example.support" }

type orderRef struct {
	Order string `json:"order" jsonschema:"the order id"`
}

// runExample runs client until the returned stop is called.
func runExample(client *onceflow.Client) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- client.Run(ctx) }()
	return func() { cancel(); <-done }
}

// An agent looks an order up and refunds it. Its first delivery dies after the loop;
// the second replays every turn and tool from their records: the model is not asked
// again, the lookup (whose answer changes at every read) is not read again, and the
// refund goes out once, with a key derived from its content.
func ExampleRunAgent() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &onceflowtest.ScriptedModel{RandomIDs: true, Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", orderRef{Order: "A-1"})}},
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("issue_refund", orderRef{Order: "A-1"})}},
		{Text: "Refunded."},
	}}
	var reads, refunds atomic.Int64
	lookup := onceflow.MustTool("lookup_order", "Look an order up.", func(ctx context.Context, key string, args orderRef) (string, error) {
		return fmt.Sprintf(`{"order":%q,"read_at":%d}`, args.Order, reads.Add(1)), nil
	})
	refund := onceflow.MustTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args orderRef) (string, error) {
		refunds.Add(1) // a payments API would get key as the Idempotency-Key
		return `{"status":"succeeded"}`, nil
	})
	answers := make(chan string, 2)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		res, err := onceflow.RunAgent(ctx, job, onceflow.AgentConfig{
			Request: &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "Refund order " + job.Args.Order}}},
			Tools:   []onceflow.AgentTool{lookup, refund},
		})
		if err != nil {
			return err
		}
		answers <- res.Answer
		if job.Delivery == 1 {
			return errors.New("the worker dies before it commits") // delivered again
		}
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Second, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond}}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	if _, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-answers)
	fmt.Println(<-answers)
	fmt.Println("model calls:", len(model.Requests()), "reads:", reads.Load(), "refunds:", refunds.Load())
	// Output:
	// Refunded.
	// Refunded.
	// model calls: 3 reads: 1 refunds: 1
}

// A recorded step: its first result is returned to every delivery of the job, so a
// read whose answer changes is read once.
func ExampleDo() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	var reads atomic.Int64
	got := make(chan string, 2)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		status, err := onceflow.Do(ctx, job, "read-status", func(ctx context.Context) (string, error) {
			return fmt.Sprintf("shipped (read #%d)", reads.Add(1)), nil
		})
		if err != nil {
			return err
		}
		got <- status
		if job.Delivery == 1 {
			return errors.New("the worker dies") // delivered again
		}
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers,
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Second, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond}}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	if _, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-got)
	fmt.Println(<-got)
	// Output:
	// shipped (read #1)
	// shipped (read #1)
}

// A model step's tool calls run through Job.Tool: each once per job, under a key that
// depends on the call's content only, which the tool sends downstream.
func ExampleJob_Tool() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &onceflowtest.ScriptedModel{RandomIDs: true, Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("issue_refund", orderRef{Order: "A-1"})}},
	}}
	keys := make(chan string, 2)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		step, err := job.Complete(ctx, "plan", &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Refund " + job.Args.Order}}})
		if err != nil {
			return err
		}
		for _, call := range job.ToolCalls(step) {
			if _, err := job.Tool(ctx, call, func(ctx context.Context, key string) (string, error) {
				keys <- key // the refund's Idempotency-Key
				return "refunded", nil
			}); err != nil {
				return err
			}
		}
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	res, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	waitDone(client, "", res.JobID)
	key := <-keys
	fmt.Println(len(key), key[:5])
	// Output:
	// 69 tool-
}

// A tool that honours no idempotency key runs at most once: its first delivery dies
// while the email is being sent, so the job is dead-lettered in doubt. An operator who
// checked the mail server says it went out; the job continues from that, and the email
// is not sent again.
func ExampleInspector_ResolveInDoubt() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("send_email", map[string]string{"to": "ada@example.com"})}},
	}}
	var sent atomic.Int64
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		step, err := job.Complete(ctx, "plan", &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Tell Ada about " + job.Args.Order}}})
		if err != nil {
			return err
		}
		_, err = job.ToolAtMostOnce(ctx, job.ToolCalls(step)[0], func(ctx context.Context, key string) (string, error) {
			if sent.Add(1) == 1 {
				panic("the process dies while the email is being sent")
			}
			return "sent", nil
		})
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	res, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	in := client.Inspector()
	var jobs []onceflow.InDoubtJob
	for len(jobs) == 0 {
		time.Sleep(20 * time.Millisecond)
		if jobs, err = in.InDoubt(context.Background(), 10); err != nil {
			log.Fatal(err)
		}
	}
	st, err := client.JobState(context.Background(), "", res.JobID)
	for err == nil && st.Status != onceflow.StatusInDoubt { // dead-lettered a moment after the intent is found
		time.Sleep(20 * time.Millisecond)
		st, err = client.JobState(context.Background(), "", res.JobID)
	}
	call := jobs[0].Calls[0]
	fmt.Println(st.Status, call.Tool, call.Arguments)
	if err := in.ResolveInDoubt(context.Background(), "", res.JobID, call.Key, onceflow.Resolution{Happened: true, Result: "sent (checked by hand)"}); err != nil {
		log.Fatal(err)
	}
	fmt.Println(waitDone(client, "", res.JobID).Status, "emails sent:", sent.Load())
	// Output:
	// in_doubt send_email {"to":"ada@example.com"}
	// done emails sent: 1
}

// A job waits for a signal without holding a worker: it parks in its queue's
// scheduled set until Client.Signal wakes it, then runs again from the start, its
// recorded steps replayed, and gets the payload.
func ExampleWaitSignal() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	var checks atomic.Int64
	got := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		if _, err := onceflow.Do(ctx, job, "check", func(ctx context.Context) (int64, error) { return checks.Add(1), nil }); err != nil {
			return err
		}
		payment, err := onceflow.WaitSignal(ctx, job, "payment", time.Hour)
		if err != nil {
			return err // while the signal has not come: the job parks, holding no worker
		}
		got <- string(payment)
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	res, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	st, _ := client.JobState(context.Background(), "", res.JobID)
	for st == nil || st.Waiting == "" {
		time.Sleep(20 * time.Millisecond)
		st, _ = client.JobState(context.Background(), "", res.JobID)
	}
	fmt.Println(st.Status, st.Waiting)
	if err := client.Signal(context.Background(), "", res.JobID, "payment", map[string]int{"cents": 1250}); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-got, "checks:", checks.Load())
	// Output:
	// queued signal payment
	// {"cents":1250} checks: 1
}

// A refund above a threshold needs an operator's approval: the agent's job parks until
// someone approves (Client.Approve, the operator UI's /ui/approvals), then the refund
// runs once.
func ExampleClient_Approve() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("issue_refund", orderRef{Order: "A-1"})}},
		{Text: "Refunded."},
	}}
	var refunds atomic.Int64
	refund := onceflow.NeedsApproval(
		onceflow.MustTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args orderRef) (string, error) {
			refunds.Add(1)
			return `{"status":"succeeded"}`, nil
		}),
		func(args orderRef) bool { return true }, // every refund, here
	)
	answers := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		res, err := onceflow.RunAgent(ctx, job, onceflow.AgentConfig{
			Request: &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Refund order " + job.Args.Order}}},
			Tools:   []onceflow.AgentTool{refund},
		})
		if err != nil {
			return err // waiting for the decision: the job parks
		}
		answers <- res.Answer
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	if _, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil); err != nil {
		log.Fatal(err)
	}
	var pending []onceflow.Approval
	for len(pending) == 0 {
		time.Sleep(20 * time.Millisecond)
		if pending, err = client.Inspector().Approvals(context.Background(), "", false, 10); err != nil {
			log.Fatal(err)
		}
	}
	a := pending[0]
	fmt.Println("asked:", a.Tool, a.Arguments, "refunds:", refunds.Load())
	if err := client.Approve(context.Background(), a.Tenant, a.JobID, a.Key, "ops@example.com", "checked"); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-answers, "refunds:", refunds.Load())
	// Output:
	// asked: issue_refund {"order":"A-1"} refunds: 0
	// Refunded. refunds: 1
}

// A job's progress and its answer's text, as Server-Sent Events: a client reads them
// as they come, and one that reconnects with Last-Event-ID resumes where it was.
func ExampleEventsHandler() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", orderRef{Order: "A-1"})}},
		{Text: "Order A-1 shipped yesterday."},
	}}
	lookup := onceflow.MustTool("lookup_order", "Look an order up.", func(ctx context.Context, key string, args orderRef) (string, error) {
		return `{"status":"shipped"}`, nil
	})
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		_, err := onceflow.RunAgent(ctx, job, onceflow.AgentConfig{Stream: true, Tools: []onceflow.AgentTool{lookup},
			Request: &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Where is " + job.Args.Order + "?"}}}})
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model})
	if err != nil {
		log.Fatal(err)
	}
	tenantOf := func(r *http.Request) (string, error) { return "", nil } // your API keys decide
	mux := http.NewServeMux()
	mux.Handle("GET /v1/jobs/{job_id}/events", onceflow.EventsHandler(client, tenantOf, onceflow.EventsConfig{}))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	defer runExample(client)()
	res, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	resp, err := http.Get(srv.URL + "/v1/jobs/" + res.JobID + "/events")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if event, ok := strings.CutPrefix(sc.Text(), "event: "); ok {
			fmt.Print(event, " ")
		}
	}
	fmt.Println()
	// Output:
	// tool text end
}
