package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
)

// The agent loop against real Redis and PostgreSQL, with the hazards that make a naive
// loop act twice: a read tool whose answer changes between deliveries, a provider that
// gives every answer new tool-call ids, and ledger rows deleted between deliveries.

type lookupArgs struct {
	Order string `json:"order" jsonschema:"the order id"`
}

type refundToolArgs struct {
	Order  string `json:"order"`
	Amount int    `json:"amount" jsonschema:"in cents"`
}

// orderAgent is a support agent's tools with counters: lookups, and refunds by the key
// the payments API would see.
type orderAgent struct {
	lookups atomic.Int64
	mu      sync.Mutex
	refunds map[string]int // by Idempotency-Key
	amounts []int
}

func newOrderAgent() *orderAgent { return &orderAgent{refunds: map[string]int{}} }

func (a *orderAgent) tools() []onceflow.AgentTool {
	return []onceflow.AgentTool{
		onceflow.MustTool("lookup_order", "Look an order up.", func(ctx context.Context, key string, args lookupArgs) (string, error) {
			// A real API's answer carries its read time: it differs at every read.
			return fmt.Sprintf(`{"order":%q,"total":1250,"updated_at":%d}`, args.Order, a.lookups.Add(1)), nil
		}),
		onceflow.MustTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args refundToolArgs) (string, error) {
			a.mu.Lock()
			defer a.mu.Unlock()
			a.refunds[key]++
			if a.refunds[key] == 1 {
				a.amounts = append(a.amounts, args.Amount)
			}
			return `{"refund":"re_1","status":"succeeded"}`, nil
		}),
	}
}

// effects returns how many refunds the payments API made (one per distinct key) and how
// many requests it got.
func (a *orderAgent) effects() (refunds, requests int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, n := range a.refunds {
		requests += n
	}
	return len(a.refunds), requests
}

func refundScript(randomIDs bool) *onceflowtest.ScriptedModel {
	return &onceflowtest.ScriptedModel{RandomIDs: randomIDs, Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", lookupArgs{Order: "A-1"})}},
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("issue_refund", refundToolArgs{Order: "A-1", Amount: 1250})}},
		{Text: "Your refund of 12.50 is on its way."},
	}}
}

func agentRequest(order string) *llm.Request {
	return &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{
		{Role: llm.RoleSystem, Content: "You are a support agent."},
		{Role: llm.RoleUser, Content: "Please refund order " + order + "."},
	}}
}

// agentRuns collects what each delivery's RunAgent returned.
type agentRuns struct {
	mu  sync.Mutex
	got []*onceflow.AgentResult
}

func (r *agentRuns) add(a *onceflow.AgentResult) {
	r.mu.Lock()
	r.got = append(r.got, a)
	r.mu.Unlock()
}
func (r *agentRuns) all() []*onceflow.AgentResult {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*onceflow.AgentResult(nil), r.got...)
}

// A redelivered agent job (its first delivery died after the loop, before its commit)
// replays every turn and tool: one lookup, one refund, no model call, the same answer,
// although a second lookup would have answered differently.
func TestAgentRedeliveryReplaysTurnsAndTools(t *testing.T) {
	t.Parallel()
	agent, model, runs := newOrderAgent(), refundScript(false), &agentRuns{}
	e := newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: agent.tools()})
		if err != nil {
			return err
		}
		runs.add(res)
		if j.Delivery == 1 {
			return errCrash
		}
		return nil
	})
	e.enqueue("A-1")
	e.start()
	e.waitRuns(2)
	if n := len(model.Requests()); n != 3 {
		t.Fatalf("the model was asked %d times, want 3 (one per turn, none again)", n)
	}
	if n := agent.lookups.Load(); n != 1 {
		t.Fatalf("lookup_order ran %d times, want 1", n)
	}
	if refunds, requests := agent.effects(); refunds != 1 || requests != 1 {
		t.Fatalf("%d refunds from %d requests, want 1 from 1", refunds, requests)
	}
	got := runs.all()
	if len(got) != 2 || got[0].Answer != got[1].Answer || got[0].Answer != "Your refund of 12.50 is on its way." || got[1].ToolCalls != 2 {
		t.Fatalf("deliveries' results: %+v", got)
	}
	a, _ := json.Marshal(got[0].Messages)
	b, _ := json.Marshal(got[1].Messages)
	if string(a) != string(b) {
		t.Fatalf("the deliveries' transcripts differ:\n%s\n%s", a, b)
	}
}

// With the ledger's rows gone between deliveries (retention, an operator's cleanup) and
// a provider that gives every answer new tool-call ids, the model is asked again, and
// still the refund goes out once: the tool's key is its content, and the recorded
// results make the conversation the same.
func TestAgentRefundsOnceWithNewToolCallIDsAndNoLedgerRows(t *testing.T) {
	t.Parallel()
	agent, model := newOrderAgent(), refundScript(true)
	var keys sync.Map
	var e *stepEnv
	e = newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		if j.Delivery == 2 { // the rows the first delivery left are gone
			if _, err := e.pool.Exec(ctx, `DELETE FROM llm_calls`); err != nil {
				return err
			}
		}
		res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: agent.tools()})
		if err != nil {
			return err
		}
		for _, s := range res.Steps {
			for _, c := range j.ToolCalls(s) {
				keys.Store(c.Key, true)
			}
		}
		if j.Delivery == 1 {
			return errCrash
		}
		return nil
	})
	e.enqueue("A-1")
	e.start()
	e.waitRuns(2)
	if n := len(model.Requests()); n != 6 {
		t.Fatalf("the model was asked %d times, want 6 (three turns, asked again without their rows)", n)
	}
	if refunds, requests := agent.effects(); refunds != 1 || requests != 1 {
		t.Fatalf("%d refunds from %d requests, want 1 from 1: the recorded refund is replayed", refunds, requests)
	}
	if n := agent.lookups.Load(); n != 1 {
		t.Fatalf("lookup_order ran %d times, want 1", n)
	}
	nkeys := 0
	keys.Range(func(any, any) bool { nkeys++; return true })
	if nkeys != 2 {
		t.Fatalf("%d distinct tool keys across deliveries, want 2", nkeys)
	}
	reqs := model.Requests()
	for i := range 3 {
		a, _ := json.Marshal(reqs[i].Messages)
		b, _ := json.Marshal(reqs[i+3].Messages)
		if string(a) != string(b) {
			t.Fatalf("turn %d's request differs between deliveries:\n%s\n%s", i+1, a, b)
		}
	}
}

// The calls of one turn run in parallel, and their results go back in the order of the
// calls, under ids that are not the provider's.
func TestAgentRunsOneTurnsCallsInParallel(t *testing.T) {
	t.Parallel()
	started := make(chan struct{}, 2)
	release := make(chan struct{})
	tool := onceflow.MustTool("lookup_order", "", func(ctx context.Context, key string, args lookupArgs) (string, error) {
		started <- struct{}{}
		<-release
		return "order " + args.Order, nil
	})
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", lookupArgs{Order: "A-1"}), onceflowtest.Call("lookup_order", lookupArgs{Order: "B-2"})}},
		{Text: "Both found."},
	}}
	results := make(chan *onceflow.AgentResult, 1)
	e := newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: []onceflow.AgentTool{tool}})
		if err != nil {
			return err
		}
		results <- res
		return nil
	})
	e.enqueue("A-1")
	e.start()
	<-started
	<-started // both calls run at once
	close(release)
	res := <-results
	var tools []llm.Message
	for _, m := range res.Messages {
		if m.Role == llm.RoleTool {
			tools = append(tools, m)
		}
		for _, c := range m.ToolCalls {
			if strings.HasPrefix(c.ID, "call_0_") {
				t.Fatalf("the transcript carries the provider's id %q", c.ID)
			}
		}
	}
	if len(tools) != 2 || tools[0].Content != "order A-1" || tools[1].Content != "order B-2" {
		t.Fatalf("tool messages %+v, want A-1's result then B-2's", tools)
	}
}

// Arguments that do not decode, and a tool that does not exist, are answered to the
// model instead of failing the job; a model that calls tools at its last turn fails it
// permanently.
func TestAgentAnswersBadCallsToTheModelAndStopsAtItsTurnLimit(t *testing.T) {
	t.Parallel()
	agent := newOrderAgent()
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{{Name: "lookup_order", Arguments: `{"order": 7}`}, {Name: "delete_everything", Arguments: `{}`}}},
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", lookupArgs{Order: "A-1"})}},
	}}
	errs := make(chan error, 1)
	e := newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: agent.tools(), MaxTurns: 3})
		errs <- err
		return err
	})
	e.enqueue("A-1")
	e.start()
	if err := <-errs; !errors.Is(err, onceflow.ErrAgentTurnLimit) || !onceflow.IsPermanent(err) {
		t.Fatalf("RunAgent: %v, want a permanent ErrAgentTurnLimit", err)
	}
	reqs := model.Requests()
	if len(reqs) != 3 {
		t.Fatalf("%d model turns, want 3", len(reqs))
	}
	var answers []string
	for _, m := range reqs[1].Messages {
		if m.Role == llm.RoleTool {
			answers = append(answers, m.Content)
		}
	}
	if len(answers) != 2 || !strings.Contains(answers[0], "do not decode") || !strings.Contains(answers[1], `no tool "delete_everything"`) {
		t.Fatalf("the model was told %q", answers)
	}
	if n := agent.lookups.Load(); n != 1 {
		t.Fatalf("lookup_order ran %d times, want once (the call with good arguments)", n)
	}
}

// A tool's argument schema is generated from its Go type.
func TestNewToolGeneratesTheArgumentSchema(t *testing.T) {
	t.Parallel()
	tool, err := onceflow.NewTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args refundToolArgs) (string, error) { return "", nil })
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Type       string                     `json:"type"`
		Properties map[string]json.RawMessage `json:"properties"`
		Required   []string                   `json:"required"`
	}
	if err := json.Unmarshal(tool.Parameters, &schema); err != nil {
		t.Fatal(err)
	}
	if schema.Type != "object" || len(schema.Properties) != 2 || !strings.Contains(string(schema.Properties["amount"]), "in cents") {
		t.Fatalf("schema %s", tool.Parameters)
	}
	if _, err := onceflow.NewTool("bad", "", func(ctx context.Context, key string, args chan int) (string, error) { return "", nil }); err == nil {
		t.Fatal("a tool whose arguments have no JSON Schema was accepted")
	}
}

// With Stream, every turn is streamed and its chunks passed on; a redelivery replays the
// recorded turns (each in one piece) and makes no model call.
func TestAgentStreamsEachTurn(t *testing.T) {
	t.Parallel()
	agent, model := newOrderAgent(), refundScript(false)
	var mu sync.Mutex
	text := map[int]string{}
	e := newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: agent.tools(), Stream: true,
			OnChunk: func(turn int, ch llm.Chunk) {
				mu.Lock()
				text[j.Delivery*10+turn] += ch.Content
				mu.Unlock()
			}})
		if err != nil {
			return err
		}
		if res.Answer != "Your refund of 12.50 is on its way." {
			return fmt.Errorf("answer %q", res.Answer)
		}
		if j.Delivery == 1 {
			return errCrash
		}
		return nil
	})
	e.enqueue("A-1")
	e.start()
	runs := e.waitRuns(2)
	if runs[1].err != nil {
		t.Fatal(runs[1].err)
	}
	if n := len(model.Requests()); n != 3 {
		t.Fatalf("the model was asked %d times, want 3", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if text[13] != "Your refund of 12.50 is on its way." || text[23] != text[13] {
		t.Fatalf("streamed text of the last turn: first delivery %q, second %q", text[13], text[23])
	}
	if refunds, requests := agent.effects(); refunds != 1 || requests != 1 {
		t.Fatalf("%d refunds from %d requests, want 1 from 1", refunds, requests)
	}
}
