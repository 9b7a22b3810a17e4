package onceflowtest_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

type Greeting struct {
	To string `json:"to"`
}

func (Greeting) Kind() string { return "greeting" }

// A worker's effect, counted three ways: the outbox row its Commit wrote, the
// completion record, and the one POST the receiver got. In a test, t is the test's.
func ExampleNew() {
	t := newExampleT()
	defer t.cleanup()

	sink := onceflowtest.NewSink(t)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Greeting](func(ctx context.Context, job *onceflow.Job[Greeting]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("greetings", "greeting:"+job.ID, map[string]string{"to": job.Args.To})
			return nil
		})
	}))
	env := onceflowtest.New(t, onceflow.Config{Workers: workers,
		Senders: map[string]outbox.Sender{"greetings": sink.Sender(t, nil)}})
	env.Start()

	if _, err := env.Client.Enqueue(context.Background(), Greeting{To: "ann"}, &onceflow.EnqueueOpts{Key: "greet-ann"}); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the greeting", func() bool { return sink.Total() == 1 })
	fmt.Println(env.OutboxRows("greetings"), onceflowtest.Completions(t, env.DB, "greeting"), sink.Total())
	// Output: 1 1 1
}

// exampleT stands in for the *testing.T a real test has: examples get none.
type exampleT struct {
	testing.TB // nil: only the methods below are called
	cleanups   []func()
}

func newExampleT() *exampleT { return &exampleT{} }

func (t *exampleT) Helper()                   {}
func (t *exampleT) Name() string              { return "Example" }
func (t *exampleT) Cleanup(f func())          { t.cleanups = append(t.cleanups, f) }
func (t *exampleT) Failed() bool              { return false }
func (t *exampleT) Log(args ...any)           {}
func (t *exampleT) Logf(string, ...any)       {}
func (t *exampleT) Error(args ...any)         { panic(fmt.Sprint(args...)) }
func (t *exampleT) Errorf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }
func (t *exampleT) Fatal(args ...any)         { panic(fmt.Sprint(args...)) }
func (t *exampleT) Fatalf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }

func (t *exampleT) cleanup() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}

// A scripted model answers by the number of tool results in the conversation: a tool
// call first, then text. With RandomIDs, every answer gets fresh tool-call ids, as
// most providers give a repeated request.
func ExampleScriptedModel() {
	m := &onceflowtest.ScriptedModel{RandomIDs: true, Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", map[string]string{"order": "A-1"})}},
		{Text: "Found it."},
	}}
	ask := []llm.Message{{Role: llm.RoleUser, Content: "Where is A-1?"}}
	first, _ := m.Complete(context.Background(), &llm.Request{Messages: ask})
	again, _ := m.Complete(context.Background(), &llm.Request{Messages: ask})
	fmt.Println(first.ToolCalls[0].Name, first.ToolCalls[0].Arguments, first.ToolCalls[0].ID != again.ToolCalls[0].ID)
	ask = append(ask, llm.Message{Role: llm.RoleAssistant, ToolCalls: first.ToolCalls},
		llm.Message{Role: llm.RoleTool, ToolCallID: first.ToolCalls[0].ID, Content: `{"status":"shipped"}`})
	final, _ := m.Complete(context.Background(), &llm.Request{Messages: ask})
	fmt.Println(final.Content, len(m.Requests()))
	// Output:
	// lookup_order {"order":"A-1"} true
	// Found it. 3
}

// A job whose first commit fails is delivered again: its recorded step (the refund)
// is replayed, not run again, and its effect is committed once.
func ExampleFailFirstCommit() {
	t := newExampleT()
	defer t.cleanup()

	var refunds, attempts atomic.Int64
	sink := onceflowtest.NewSink(t)
	env := onceflowtest.New(t, onceflow.Config{Workers: refundWorkers(&refunds, &attempts), Queues: fastRetry,
		Senders: map[string]outbox.Sender{"replies": sink.Sender(t, nil)}})
	fault := onceflowtest.FailFirstCommit(t, env.DB, onceflow.JobID(onceflow.EnqueueScope("", "refund", "order-A-1")))
	env.Start()

	if _, err := env.Client.Enqueue(context.Background(), refundJob{Order: "A-1"}, &onceflow.EnqueueOpts{Key: "order-A-1"}); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the reply", func() bool { return sink.Total() == 1 })
	fmt.Println("commits tried:", fault.Commits(t), "refunds:", refunds.Load(), "replies:", env.OutboxRows("replies"))
	// Output: commits tried: 2 refunds: 1 replies: 1
}

// Commits counts the job's commits tried since FailFirstCommit: here two inserts of its
// completion record, the first refused on purpose.
func ExampleCommitFault_Commits() {
	t := newExampleT()
	defer t.cleanup()

	db, _ := onceflowtest.Postgres(t)
	fault := onceflowtest.FailFirstCommit(t, db, "job-1")
	for range 2 {
		_, err := db.Exec(context.Background(), `INSERT INTO job_completions (job_id, kind) VALUES ('job-1', 'k') ON CONFLICT DO NOTHING`)
		fmt.Println(err != nil)
	}
	fmt.Println(fault.Commits(t))
	// Output:
	// true
	// false
	// 2
}
