package cli_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/openaiprovider"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// shadow report summarises the shadow runs per step and candidate and shows the worst
// disagreements, as text and as JSON; --step and --since select the runs.
func TestShadowReportSummarisesAgreementCostAndLatency(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	_, prefix := testenv.Redis(t)
	ctx := context.Background()
	insert := `INSERT INTO shadow_runs (prod_key, candidate, tenant, job_id, step, prod_model, cand_model, prod_answer, cand_answer,
	agree, score, detail, prod_latency_ms, cand_latency_ms, prod_cost_usd, cand_cost_usd, prod_input_tokens, cand_input_tokens, created_at)
VALUES ($1, $2, 'acme', $3, $4, 'gpt-4.1', $2, $5, $6, $7, $8, $9, $10, $11, 0.01, 0.002, 100, 100, now() - $12::interval)`
	for i, r := range []struct {
		step, cand, prod, answer, detail, ago string
		agree                                 bool
		score                                 float64
		prodMS, candMS                        int
	}{
		{"summary", "gpt-4.1-nano", "Shipped.", "Shipped.", "", "1 minute", true, 1, 800, 400},
		{"summary", "gpt-4.1-nano", "Shipped.", "Lost.", "the text differs", "1 minute", false, 0, 900, 300},
		{"summary", "gpt-4.1-nano", "Refunded.", "Refunded.", "", "3 days", true, 1, 700, 500},
		{"classify", "terse", `{"label":"bug"}`, `{"label":"feature"}`, "fields differ: label", "1 minute", false, 0, 100, 50},
	} {
		prod, _ := json.Marshal(map[string]string{"content": r.prod})
		cand, _ := json.Marshal(map[string]string{"content": r.answer})
		if _, err := pool.Exec(ctx, insert, "llm-"+strings.Repeat("a", 60)+string(rune('a'+i)), r.cand, "job-"+string(rune('a'+i)), r.step,
			prod, cand, r.agree, r.score, r.detail, r.prodMS, r.candMS, r.ago); err != nil {
			t.Fatal(err)
		}
	}
	getenv := func(k string) string {
		return map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": dsn, "ONCEFLOW_PREFIX": prefix,
			"ONCEFLOW_LOG_FORMAT": "text"}[k]
	}
	out, errOut, code := runCommand(t, cli.App{}, getenv, "shadow", "report", "--json", "--since", "24h")
	var rep onceflow.ShadowReport
	if code != 0 || json.Unmarshal([]byte(out), &rep) != nil {
		t.Fatalf("shadow report --json: exit %d, %q %s", code, out, errOut)
	}
	if len(rep.Summaries) != 2 {
		t.Fatalf("summaries %+v, want classify and summary", rep.Summaries)
	}
	s := rep.Summaries[1] // sorted by step: classify, summary
	if s.Step != "summary" || s.Candidate != "gpt-4.1-nano" || s.Runs != 2 || s.Agreed != 1 || s.Agreement != 0.5 ||
		s.ProdLatencyMS != 850 || s.CandLatencyMS != 350 || s.ProdTokens != 200 {
		t.Fatalf("summary's shadows in the last 24h: %+v, want 2 runs (the one of 3 days ago left out), 1 agreed", s)
	}
	if len(rep.Disagreements) != 2 || rep.Disagreements[0].Shadow.Content == "" {
		t.Fatalf("disagreements %+v", rep.Disagreements)
	}
	out, _, code = runCommand(t, cli.App{}, getenv, "shadow", "report", "--step", "summary")
	if code != 0 || !strings.Contains(out, "gpt-4.1-nano") || !strings.Contains(out, "2 (66.7%)") || strings.Contains(out, "classify") ||
		!strings.Contains(out, "production: Shipped.") || !strings.Contains(out, "candidate:  Lost.") {
		t.Fatalf("shadow report --step summary: exit %d\n%s", code, out)
	}
	for _, args := range [][]string{{"shadow"}, {"shadow", "frob"}, {"shadow", "report", "--worst", "-1"}, {"shadow", "report", "x"}} {
		if _, _, code := runCommand(t, cli.App{}, getenv, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (usage)", args, code)
		}
	}
}

// eval asks a candidate, at the provider, each production call of the step the ledger
// recorded with its request, records the runs as eval:MODEL and prints their report;
// run again, it asks nothing; bad flags are usage errors.
func TestEvalReplaysRecordedInputsAgainstACandidateOnce(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	_, prefix := testenv.Redis(t)
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	model := httptest.NewServer(fs)
	t.Cleanup(model.Close)
	ctx := context.Background()
	for i, step := range []string{"summary", "summary", "classify"} {
		req := &llm.Request{Model: "gpt-4.1", Messages: []llm.Message{{Role: llm.RoleUser, Content: fmt.Sprint("ticket ", i)}}}
		req.IdempotencyKey = ledger.Work(fmt.Sprint("job-", i), step)
		body, _ := json.Marshal(req)
		answer, _ := json.Marshal(llm.Response{Model: "gpt-4.1", Content: "production's answer"})
		if _, err := pool.Exec(ctx, `INSERT INTO llm_calls (idem_key, work, state, request_hash, request, response, expires_at)
VALUES ($1, $2, 'succeeded', $3, $4, $5, now() + interval '1 day')`, ledger.Key(req.IdempotencyKey, req), req.IdempotencyKey,
			ledger.RequestHash(req), body, answer); err != nil {
			t.Fatal(err)
		}
	}
	getenv := func(k string) string {
		return map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": dsn, "ONCEFLOW_PREFIX": prefix,
			"ONCEFLOW_LOG_FORMAT": "text", "ONCEFLOW_LLM": "openai", "ONCEFLOW_LLM_BASE_URL": model.URL + "/v1", "OPENAI_API_KEY": "test"}[k]
	}
	app := cli.App{Providers: []cli.Provider{openaiprovider.Provider()}}
	out, errOut, code := runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano", "--json")
	var res onceflow.EvalResult
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil {
		t.Fatalf("eval --json: exit %d, %q %s", code, out, errOut)
	}
	if res.Candidate != "eval:gpt-4.1-nano" || res.Inputs != 2 || res.Recorded != 2 || len(res.Report.Summaries) != 1 || res.Report.Summaries[0].Runs != 2 {
		t.Fatalf("eval: %+v, want the step's 2 inputs recorded and reported", res)
	}
	if st := fs.Stats(); st.Requests != 2 {
		t.Fatalf("the provider got %d requests, want the 2 inputs'", st.Requests)
	}
	out, _, code = runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano")
	if code != 0 || !strings.Contains(out, "0 new inputs") || !strings.Contains(out, "eval:gpt-4.1-nano") || fs.Stats().Requests != 2 {
		t.Fatalf("eval again: exit %d, %d requests at the provider\n%s", code, fs.Stats().Requests, out)
	}
	for _, args := range [][]string{{"eval"}, {"eval", "--step", "summary"}, {"eval", "--step", "s", "--candidate", "m", "--limit", "0"},
		{"eval", "--step", "s", "--candidate", "m", "--fields", "a", "--judge", "j"}, {"eval", "--step", "s", "--candidate", "m", "--threshold", "0.5"},
		{"eval", "--step", "s", "--candidate", "m", "extra"}} {
		if _, _, code := runCommand(t, app, getenv, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (usage)", args, code)
		}
	}
}

// shadow report prints the models' answers and the judge's reason with their control
// characters (a terminal's escape sequences) replaced: what a model wrote cannot drive
// the operator's terminal.
func TestShadowReportPrintsNoControlCharactersOfTheAnswers(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	_, prefix := testenv.Redis(t)
	prod, _ := json.Marshal(map[string]string{"content": "Shipped.\x1b]0;pwned\x07"})
	cand, _ := json.Marshal(map[string]string{"content": "\x1b[2J\x1b[1;1HAll good, nothing to see.\u009b31m"})
	if _, err := pool.Exec(context.Background(), `INSERT INTO shadow_runs (prod_key, candidate, tenant, job_id, step, prod_answer, cand_answer,
	agree, score, detail) VALUES ('llm-1', 'cand', 'acme', 'job-1', 'summary', $1, $2, false, 0, $3)`, prod, cand, "B differs\x1b[8m hidden"); err != nil {
		t.Fatal(err)
	}
	getenv := func(k string) string {
		return map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": dsn, "ONCEFLOW_PREFIX": prefix,
			"ONCEFLOW_LOG_FORMAT": "text"}[k]
	}
	out, _, code := runCommand(t, cli.App{}, getenv, "shadow", "report")
	if code != 0 || !strings.Contains(out, "All good, nothing to see.") || !strings.Contains(out, "B differs") ||
		strings.ContainsAny(out, "\x1b\x07\u009b") {
		t.Fatalf("shadow report: exit %d, want the answers without control characters\n%q", code, out)
	}
}
