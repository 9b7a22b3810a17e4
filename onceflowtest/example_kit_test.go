package onceflowtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// The fake model calls the tool it is told to, and counts the requests: a test of an
// agent's refund branch. NoToolCalls (or a func of the request) tests the other.
func ExampleNewFakeLLM() {
	t := newExampleT()
	defer t.cleanup()

	model := onceflowtest.NewFakeLLM(t, fakeserver.Config{
		ToolChoice: fakeserver.CallTool("issue_refund", json.RawMessage(`{"order_id":"A-17","amount_cents":1299}`))})
	resp, err := model.Client().Complete(context.Background(), &llm.Request{
		Messages: []llm.Message{{Role: llm.RoleUser, Content: "Broken. Money back, please."}},
		Tools:    []llm.Tool{{Name: "issue_refund", Parameters: json.RawMessage(`{"type":"object"}`)}}})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println(resp.ToolCalls[0].Name, resp.ToolCalls[0].Arguments, model.Requests())
	// Output: issue_refund {"order_id":"A-17","amount_cents":1299} 1
}

// A test's own schema, migrated, and a counting query on it.
func ExamplePostgres() {
	t := newExampleT()
	defer t.cleanup()

	db, _ := onceflowtest.Postgres(t) // pass your migrations.Source values to add your tables
	fmt.Println(onceflowtest.OutboxRows(t, db, ""), onceflowtest.Count(t, db, `SELECT count(*) FROM job_completions`))
	// Output: 0 0
}

// A program of your own as a real process: built once, started on the test's stores,
// and killed with SIGKILL (here examples/minimal, once its effect went out: the row
// and the completion were committed before).
func ExampleBuild() {
	t := newExampleT()
	defer t.cleanup()

	bin := onceflowtest.Build(t, "../examples/minimal")
	_, prefix := onceflowtest.Redis(t)
	db, dsn := onceflowtest.Postgres(t)
	p := onceflowtest.Start(t, bin, []string{"ONCEFLOW_REDIS_URL=" + onceflowtest.RedisURL(t),
		"ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix})
	onceflowtest.WaitFor(t, 30*time.Second, "the welcome", func() bool { return strings.Contains(p.Stdout(), "send email.welcome") })
	p.Kill()
	fmt.Println(onceflowtest.OutboxRows(t, db, "email.welcome"), onceflowtest.Completions(t, db, "welcome"))
	// Output: 1 1
}

// A Redis of the test's own whose writes the test holds: a worker blocks on its
// acknowledgement there, for a test to kill it after its commit.
func ExampleRedisServer_PauseWrites() {
	t := newExampleT()
	defer t.cleanup()

	r := onceflowtest.PrivateRedis(t)
	resume := r.PauseWrites(t)
	written := make(chan error)
	go func() { written <- r.Client.Set(context.Background(), "k", "v", 0).Err() }()
	select {
	case <-written:
		fmt.Println("written while paused")
	case <-time.After(100 * time.Millisecond):
		fmt.Println("held")
	}
	resume()
	fmt.Println(<-written)
	// Output:
	// held
	// <nil>
}

// A key prefix of the test's own on the shared Redis: give it to Config.Prefix (or to
// a subprocess, with RedisURL); its keys are deleted at cleanup.
func ExampleRedis() {
	t := newExampleT()
	defer t.cleanup()

	rdb, prefix := onceflowtest.Redis(t)
	ctx := context.Background()
	rdb.Set(ctx, prefix+":greeting", "hello", 0)
	fmt.Println(rdb.Get(ctx, prefix+":greeting").Val(), onceflowtest.RedisURL(t) != "")
	// Output: hello true
}

// The sink counts POSTs per Idempotency-Key: two sends of one effect are two
// deliveries and one key, which a receiver honouring the key applies once.
func ExampleNewSink() {
	t := newExampleT()
	defer t.cleanup()

	sink := onceflowtest.NewSink(t)
	sender := sink.Sender(t, webhook.PayloadOnly)
	refund := outbox.Message{Topic: "payments.refund", DedupeKey: "refund-A-17", Payload: json.RawMessage(`{"cents":1299}`)}
	for range 2 {
		if err := sender.Send(context.Background(), refund); err != nil {
			t.Fatal(err)
		}
	}
	fmt.Println(sink.Total(), sink.Count("refund-A-17"), sink.Keys(), string(sink.Deliveries()[0].Body))
	// Output: 2 2 [refund-A-17] {"cents":1299}
}

// Hold stalls the model's answers: the test acts while a caller waits for one.
func ExampleFakeLLM_Hold() {
	t := newExampleT()
	defer t.cleanup()

	model := onceflowtest.NewFakeLLM(t, fakeserver.Config{})
	model.Hold()
	answered := make(chan error)
	go func() {
		_, err := model.Client().Complete(context.Background(), &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "hi"}}})
		answered <- err
	}()
	model.WaitRequests(t, 1, 10*time.Second) // the request arrived and waits
	model.Release()
	fmt.Println(<-answered, model.Requests())
	// Output: <nil> 1
}

// Pending counts the jobs a worker holds and has not acknowledged.
func ExamplePending() {
	t := newExampleT()
	defer t.cleanup()

	release := make(chan struct{})
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Greeting](func(ctx context.Context, job *onceflow.Job[Greeting]) error {
		<-release
		return nil
	}))
	env := onceflowtest.New(t, onceflow.Config{Workers: workers})
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), Greeting{To: "bob"}, nil); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the delivery", func() bool {
		return onceflowtest.Pending(t, env.Redis, env.Prefix, onceflow.DefaultQueue) == 1
	})
	close(release)
	onceflowtest.WaitFor(t, 10*time.Second, "the acknowledgement", func() bool {
		return onceflowtest.Pending(t, env.Redis, env.Prefix, onceflow.DefaultQueue) == 0
	})
	fmt.Println("acknowledged")
	// Output: acknowledged
}
