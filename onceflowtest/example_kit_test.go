package onceflowtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
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
