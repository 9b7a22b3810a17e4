package onceflow_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// ONCEFLOW_SHADOW's form: a share of a step's production calls also made to a
// candidate model.
func ExampleParseShadows() {
	shadows, err := onceflow.ParseShadows("summary=gpt-4.1-nano@0.25,agent.turn-1=claude-haiku-4-5@1")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, s := range shadows {
		fmt.Printf("%s on %s at %v\n", s.Step, s.Model, s.Rate)
	}
	_, err = onceflow.ParseShadows("summary=gpt-4.1-nano@2")
	fmt.Println(err)
	// Output:
	// summary on gpt-4.1-nano at 0.25
	// agent.turn-1 on claude-haiku-4-5 at 1
	// shadow of step "summary": rate 2: want 0 to 1
}

// The default comparison: the same text and the same tool calls, whatever the
// providers' call ids.
func ExampleExactMatch() {
	production := &llm.Response{ToolCalls: []llm.ToolCall{{ID: "call_a", Name: "refund", Arguments: `{"order":"A-1","cents":500}`}}}
	candidate := &llm.Response{ToolCalls: []llm.ToolCall{{ID: "toolu_b", Name: "refund", Arguments: `{"cents":500,"order":"A-1"}`}}}
	fmt.Println(onceflow.ExactMatch(production, candidate).Agree)
	fmt.Println(onceflow.ExactMatch(&llm.Response{Content: "yes"}, &llm.Response{Content: "no"}).Detail)
	// Output:
	// true
	// the text differs
}

// Structured answers compared field by field: the score is the share of the fields
// that agree.
func ExampleJSONFieldsMatch() {
	compare := onceflow.JSONFieldsMatch("label", "priority")
	c := compare(&llm.Response{Content: `{"label":"bug","priority":2,"why":"crash"}`},
		&llm.Response{Content: `{"priority":2,"label":"feature","why":"asks for more"}`})
	fmt.Println(c.Agree, c.Score, c.Detail)
	// Output: false 0.5 fields differ: label
}

// Every call of the step "summary" is also made to a candidate model, whose answer is
// compared with production's and recorded; the report sums them up.
func ExampleInspector_ShadowReport() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &modelsByName{answers: map[string]string{"prod": "The parcel shipped.", "nano": "It shipped."}}
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		_, err := job.Complete(ctx, "summary", &llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}})
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model, NoLimits: true,
		Shadows: []onceflow.Shadow{{Step: "summary", Model: "nano", Rate: 1}}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	if _, err := client.Enqueue(context.Background(), shadowedTicket{Text: "Where is my parcel?"}, nil); err != nil {
		log.Fatal(err)
	}
	for exampleCount(db, `SELECT count(*) FROM shadow_runs`) == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	rep, err := client.Inspector().ShadowReport(context.Background(), onceflow.ShadowQuery{Step: "summary"})
	if err != nil {
		log.Fatal(err)
	}
	s, d := rep.Summaries[0], rep.Disagreements[0]
	fmt.Println(s.Step, s.Candidate, s.Runs, s.Agreed)
	fmt.Printf("%q vs %q: %s\n", d.Production.Content, d.Shadow.Content, d.Detail)
	// Output:
	// summary nano 1 0
	// "The parcel shipped." vs "It shipped.": the text differs
}

// exampleCount runs a counting query for an example.
func exampleCount(db *pgxpool.Pool, sql string) int {
	var n int
	if err := db.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		log.Fatal(err)
	}
	return n
}

// An answer that is not the JSON object its gate asks for holds the job before its
// effects; an operator who checked it releases it, and the job goes on.
func ExampleClient_Release() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &modelsByName{answers: map[string]string{"prod": "bug"}}
	released := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		st, err := job.Complete(ctx, "classify", &llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}})
		if err != nil {
			return err // held: the job parks until an operator decides
		}
		released <- st.Response.Content
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model, NoLimits: true,
		Gates: []onceflow.Gate{{Step: "classify", Name: "structured", Schema: json.RawMessage(`{"type":"object"}`)}}})
	if err != nil {
		log.Fatal(err)
	}
	defer runExample(client)()
	res, err := client.Enqueue(context.Background(), shadowedTicket{Text: "The app crashes."}, nil)
	if err != nil {
		log.Fatal(err)
	}
	// The hold is recorded, then the job parks: wait until its state says held.
	st := &onceflow.JobState{}
	for st.Status != onceflow.StatusHeld {
		time.Sleep(10 * time.Millisecond)
		if st, err = client.JobState(context.Background(), "", res.JobID); err != nil {
			log.Fatal(err)
		}
	}
	held, err := client.Inspector().Held(context.Background(), "", false, 10)
	if err != nil || len(held) != 1 {
		log.Fatal(held, err)
	}
	fmt.Println(st.Status, held[0].Gate, strings.SplitN(held[0].Reason, ":", 2)[0])
	if err := client.Release(context.Background(), "", res.JobID, held[0].Key, "ops@example.com", "a one-word label is fine"); err != nil {
		log.Fatal(err)
	}
	fmt.Println(<-released)
	// Output:
	// held structured the answer is not JSON
	// bug
}

// A judge's answer read as a verdict: fenced or not, a score from 0 to 1 and a reason;
// anything else says what is wrong with it.
func ExampleParseVerdict() {
	v, err := onceflow.ParseVerdict("```json\n{\"score\": 0.8, \"reason\": \"the same facts, shorter\"}\n```")
	fmt.Println(v.Score, v.Reason, err)
	_, err = onceflow.ParseVerdict(`{"score": 8}`)
	fmt.Println(err)
	// Output:
	// 0.8 the same facts, shorter <nil>
	// the judge's score 8 is not a number from 0 to 1
}

// The step's recorded production calls, asked again of a candidate: each input once,
// compared with production's answer and recorded as an "eval:" shadow run.
func ExampleClient_Eval() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &modelsByName{answers: map[string]string{"prod": "Shipped.", "nano": "Shipped."}}
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		_, err := job.Complete(ctx, "summary", &llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}})
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model, NoLimits: true,
		Ledger: ledger.Config{KeepRequests: true}}) // the inputs Eval replays
	if err != nil {
		log.Fatal(err)
	}
	stop := runExample(client)
	for _, text := range []string{"Where is my parcel?", "Is it shipped?"} {
		if _, err := client.Enqueue(context.Background(), shadowedTicket{Text: text}, nil); err != nil {
			log.Fatal(err)
		}
	}
	for exampleCount(db, `SELECT count(*) FROM llm_calls WHERE state = 'succeeded'`) < 2 {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	res, err := client.Eval(context.Background(), onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: "nano"}})
	if err != nil {
		log.Fatal(err)
	}
	s := res.Report.Summaries[0]
	fmt.Println(res.Candidate, res.Inputs, res.Recorded, s.Agreed)
	// Output: eval:nano 2 2 2
}
