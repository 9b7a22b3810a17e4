package onceflow_test

import (
	"cmp"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/onceflowtest"
)

// evalEnv runs n production jobs of step "summary" to completion and returns the
// environment, whose ledger then holds their requests.
func evalEnv(t *testing.T, model *modelsByName, n int) *onceflowtest.Env {
	t.Helper()
	env, sink := shadowEnv(t, model, nil, false, false)
	env.Start()
	for i := range n {
		if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: fmt.Sprint("ticket ", i)}, nil); err != nil {
			t.Fatal(err)
		}
	}
	onceflowtest.WaitFor(t, 20*time.Second, "every production email", func() bool { return sink.Total() == n })
	return env
}

// An evaluation asks each recorded production input of the step of the candidate once
// and records the comparison under "eval:<name>", next to the production job; run
// again, it finds nothing new to ask. A run lost after its answer (a crash before the
// record) is recorded again from the ledger, without asking the candidate again. No
// evaluation causes an effect.
func TestEvalAsksEachRecordedInputOnceAndRecordsItsRun(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "Shipped.", "cand": "Shipped."}}
	env := evalEnv(t, model, 3)
	ctx := context.Background()
	e := onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: "cand"}}
	res, err := env.Client.Eval(ctx, e)
	if err != nil {
		t.Fatal(err)
	}
	if res.Candidate != "eval:cand" || res.Inputs != 3 || res.Recorded != 3 || res.Failed != 0 || model.count("cand") != 3 {
		t.Fatalf("eval %+v, candidate asked %d times; want 3 inputs recorded, asked once each", res, model.count("cand"))
	}
	if len(res.Report.Summaries) != 1 || res.Report.Summaries[0].Runs != 3 || res.Report.Summaries[0].Agreed != 3 || res.Report.Summaries[0].Candidate != "eval:cand" {
		t.Fatalf("report %+v", res.Report.Summaries)
	}
	if n := env.Count(`SELECT count(*) FROM shadow_runs s JOIN llm_calls c ON c.idem_key = s.prod_key
WHERE s.candidate = 'eval:cand' AND s.step = 'summary' AND c.work = 'summary/' || s.job_id`); n != 3 {
		t.Fatalf("%d runs tied to their production job and call, want 3", n)
	}
	again, err := env.Client.Eval(ctx, e)
	if err != nil || again.Inputs != 0 || model.count("cand") != 3 {
		t.Fatalf("a second eval: %+v %v, candidate asked %d times; want nothing new", again, err, model.count("cand"))
	}
	if _, err := env.DB.Exec(ctx, `DELETE FROM shadow_runs WHERE job_id = (SELECT min(job_id) FROM shadow_runs)`); err != nil {
		t.Fatal(err)
	}
	resumed, err := env.Client.Eval(ctx, e)
	if err != nil || resumed.Inputs != 1 || resumed.Recorded != 1 || model.count("cand") != 3 {
		t.Fatalf("a resumed eval: %+v %v, candidate asked %d times; want the lost run recorded from the ledger", resumed, err, model.count("cand"))
	}
	if n := env.OutboxRows(""); n != 3 {
		t.Fatalf("%d outbox rows, want production's 3", n)
	}
}

// An evaluation stops asking once its calls cost MaxCostUSD, and says so.
func TestEvalStopsAtItsBudget(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "a", "gpt-4.1-mini": "b"}}
	env := evalEnv(t, model, 4)
	one := 100*0.4/1e6 + 20*1.6/1e6 // a call's 100 input and 20 output tokens at gpt-4.1-mini's default prices
	res, err := env.Client.Eval(context.Background(), onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: "gpt-4.1-mini"},
		MaxCostUSD: 1.5 * one, Concurrency: 1})
	if err != nil {
		t.Fatal(err)
	}
	if res.Inputs != 4 || res.Recorded != 2 || !strings.Contains(res.Stopped, "budget") || model.count("gpt-4.1-mini") != 2 {
		t.Fatalf("eval %+v, asked %d times; want 2 of 4 asked, then stopped by the budget", res, model.count("gpt-4.1-mini"))
	}
	if res.CostUSD < 1.9*one || res.CostUSD > 2.1*one {
		t.Fatalf("cost %v, want two calls' %v", res.CostUSD, 2*one)
	}
}

// An evaluation graded by a judge asks the judge once per input, and records its
// score; the inputs of other steps, other tenants and before Since are not asked.
func TestEvalWithAJudgeAndItsFilters(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "Shipped Monday.", "cand": "Shipped.", "judge": `{"score":0.5,"reason":"no date"}`}}
	env := evalEnv(t, model, 2)
	ctx := context.Background()
	none, err := env.Client.Eval(ctx, onceflow.Eval{Step: "summary", Tenant: "someone-else", Candidate: onceflow.Shadow{Model: "cand"}})
	if err != nil || none.Inputs != 0 {
		t.Fatalf("another tenant's eval: %+v %v; want no inputs", none, err)
	}
	if none, err = env.Client.Eval(ctx, onceflow.Eval{Step: "another-step", Candidate: onceflow.Shadow{Model: "cand"}}); err != nil || none.Inputs != 0 {
		t.Fatalf("another step's eval: %+v %v; want no inputs", none, err)
	}
	if _, err := env.DB.Exec(ctx, `UPDATE llm_calls SET created_at = now() - interval '2 hours' WHERE idem_key = (SELECT min(idem_key) FROM llm_calls)`); err != nil {
		t.Fatal(err)
	}
	res, err := env.Client.Eval(ctx, onceflow.Eval{Step: "summary", Since: time.Hour,
		Candidate: onceflow.Shadow{Model: "cand", Name: "cand-judged", Judge: &onceflow.Judge{Model: "judge"}}})
	if err != nil || res.Inputs != 1 || res.Recorded != 1 || model.count("judge") != 1 {
		t.Fatalf("eval %+v %v, judge asked %d times; want the one input of the last hour judged once", res, err, model.count("judge"))
	}
	if s := res.Report.Summaries; len(s) != 1 || s[0].Candidate != "eval:cand-judged" || s[0].Score != 0.5 || s[0].Agreed != 0 {
		t.Fatalf("report %+v; want score 0.5, below the default threshold", s)
	}
}

// An Eval that cannot work is refused before any call.
func TestEvalConfigIsChecked(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "a"}}
	env := evalEnv(t, model, 1)
	for _, tc := range []struct {
		e    onceflow.Eval
		want string
	}{
		{onceflow.Eval{Candidate: onceflow.Shadow{Model: "m"}}, "step"},
		{onceflow.Eval{Step: "summary"}, "neither a Model nor a Transform"},
		{onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: "m"}, Limit: onceflow.MaxEvalInputs + 1}, "Limit"},
		{onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: "m"}, Since: -time.Hour}, "Since"},
		{onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: "m"}, MaxCostUSD: -1}, "MaxCostUSD"},
		{onceflow.Eval{Step: "summary", Candidate: onceflow.Shadow{Model: strings.Repeat("m", 62)}}, "candidate name"},
	} {
		if _, err := env.Client.Eval(context.Background(), tc.e); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error saying %q", tc.e, err, tc.want)
		}
	}
	if n := model.count("m"); n != 0 {
		t.Fatalf("a refused eval asked the model %d times", n)
	}
}

// A candidate's answer or a judge's reason holding U+0000, which PostgreSQL's jsonb and
// text refuse, is recorded with U+FFFD in its place, on the first evaluation.
func TestEvalRecordsAnswersHoldingNUL(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "Shipped.", "cand": "Ship\x00ped.", "judge": `{"score":0.2,"reason":"a\u0000b"}`}}
	env := evalEnv(t, model, 2)
	for _, c := range []onceflow.Shadow{{Model: "cand"}, {Model: "cand", Name: "judged", Judge: &onceflow.Judge{Model: "judge"}}} {
		res, err := env.Client.Eval(context.Background(), onceflow.Eval{Step: "summary", Candidate: c})
		if err != nil || res.Recorded != 2 || res.Failed != 0 {
			t.Fatalf("eval of %s: %+v %v; want both inputs recorded", cmp.Or(c.Name, c.Model), res, err)
		}
	}
	if n := env.Count(`SELECT count(*) FROM shadow_runs WHERE cand_answer->>'content' = 'Ship` + "\uFFFD" + `ped.'
	AND (candidate = 'eval:cand' OR detail = 'a` + "\uFFFD" + `b')`); n != 4 {
		t.Fatalf("%d runs with U+FFFD for U+0000, want 4", n)
	}
}
