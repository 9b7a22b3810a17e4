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

// eval --worst N shows (and --json gives) the N worst disagreements of the candidate,
// not the report's default few.
func TestEvalShowsTheWorstDisagreementsAsked(t *testing.T) {
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
	const inputs = 8
	for i := range inputs {
		req := &llm.Request{Model: "gpt-4.1", Messages: []llm.Message{{Role: llm.RoleUser, Content: fmt.Sprint("ticket ", i)}}}
		req.IdempotencyKey = ledger.Work(fmt.Sprint("job-", i), "summary")
		body, _ := json.Marshal(req)
		answer, _ := json.Marshal(llm.Response{Model: "gpt-4.1", Content: "production's answer"}) // the fake answers otherwise
		if _, err := pool.Exec(context.Background(), `INSERT INTO llm_calls (idem_key, work, state, request_hash, request, response, expires_at)
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
	out, errOut, code := runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano", "--worst", "7", "--json")
	var res onceflow.EvalResult
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil {
		t.Fatalf("eval --json: exit %d, %q %s", code, out, errOut)
	}
	if res.Recorded != inputs || len(res.Report.Disagreements) != 7 {
		t.Fatalf("eval --worst 7 --json: %d recorded, %d disagreements; want %d and 7", res.Recorded, len(res.Report.Disagreements), inputs)
	}
	out, _, code = runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano", "--worst", "6")
	if n := strings.Count(out, "summary / eval:gpt-4.1-nano, job"); code != 0 || n != 6 {
		t.Fatalf("eval --worst 6: exit %d, %d disagreements shown, want 6\n%s", code, n, out)
	}
	out, _, code = runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano", "--worst", "0")
	if code != 0 || strings.Contains(out, "worst disagreements") {
		t.Fatalf("eval --worst 0: exit %d, want no disagreements\n%s", code, out)
	}
}

// eval while PostgreSQL does not answer fails with status 1 and says why; it is no
// usage error (status 2, "invalid").
func TestEvalWithPostgresDownExitsOne(t *testing.T) {
	t.Parallel()
	_, prefix := testenv.Redis(t)
	getenv := func(k string) string {
		return map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": "postgres://onceflow@127.0.0.1:1/onceflow?sslmode=disable&connect_timeout=2",
			"ONCEFLOW_PREFIX": prefix, "ONCEFLOW_LOG_FORMAT": "text", "ONCEFLOW_LLM": "openai", "ONCEFLOW_LLM_BASE_URL": "http://127.0.0.1:1/v1", "OPENAI_API_KEY": "test"}[k]
	}
	app := cli.App{Providers: []cli.Provider{openaiprovider.Provider()}}
	_, errOut, code := runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano")
	if code != 1 || strings.Contains(errOut, "invalid") || !strings.Contains(errOut, "recorded calls") {
		t.Fatalf("eval with PostgreSQL down: exit %d, want 1 saying the recorded calls could not be read\n%s", code, errOut)
	}
	if _, errOut, code := runCommand(t, app, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano", "--name", "ünicode"); code != 2 || !strings.Contains(errOut, "candidate name") {
		t.Fatalf("eval of a bad candidate name: exit %d, want 2 (usage)\n%s", code, errOut)
	}
}

// eval makes its calls at once, neither shadowed nor batched: ONCEFLOW_SUMMARIES_LANE=batch
// with a provider that has no batch API is none of its concern (it goes on, here to find
// PostgreSQL down: exit 1, not 2).
func TestEvalDoesNotBuildTheBatchLane(t *testing.T) {
	t.Parallel()
	_, prefix := testenv.Redis(t)
	getenv := func(k string) string {
		return map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": "postgres://onceflow@127.0.0.1:1/onceflow?sslmode=disable&connect_timeout=2",
			"ONCEFLOW_PREFIX": prefix, "ONCEFLOW_LOG_FORMAT": "text", "ONCEFLOW_LLM": "fake", "ONCEFLOW_SUMMARIES_LANE": "batch"}[k]
	}
	_, errOut, code := runCommand(t, cli.App{}, getenv, "eval", "--step", "summary", "--candidate", "gpt-4.1-nano")
	if code != 1 || strings.Contains(errOut, "batch") {
		t.Fatalf("eval with ONCEFLOW_SUMMARIES_LANE=batch on the fake provider: exit %d, want 1 (PostgreSQL down) with no word of the batch lane\n%s", code, errOut)
	}
}
