package cli_test

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/openaiprovider"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// `batches list` shows the lane's waiting requests by model and its batches;
// `batches cancel ID` (the provider's id or the submission's) asks the provider to
// cancel a batch in flight; an unknown id is an error (exit 1), a missing one a usage
// error (exit 2).
func TestBatchesListAndCancel(t *testing.T) {
	t.Parallel()
	fake, err := fakeserver.New(fakeserver.Config{BatchDelay: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(fake)
	t.Cleanup(func() { srv.Close(); fake.Close() })
	ctx := context.Background()
	api := openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "sk-test"}).Batches()
	sub := uuid.NewString()
	req := &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "hi"}}}
	info, err := api.Submit(ctx, llm.BatchSubmission{ID: sub, Model: req.Model, Items: []llm.BatchItem{{CustomID: "a1", Request: req}, {CustomID: "a2", Request: req}}})
	if err != nil {
		t.Fatal(err)
	}
	_, prefix := testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	if _, err := pool.Exec(ctx, `INSERT INTO batch_submissions (id, model, state, batch_id, items, tokens, submitted_at) VALUES ($1, $2, 'submitted', $3, 2, 20, now())`, sub, req.Model, info.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO batch_items (key, custom_id, work, request_hash, model, request, job_id, state, tokens)
VALUES ('k1', 'c1', 'w', 'h', 'gpt-4.1-nano', '{}', 'job-1', 'pending', 5)`); err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": dsn, "ONCEFLOW_PREFIX": prefix,
		"ONCEFLOW_LLM": "openai", "ONCEFLOW_LLM_BASE_URL": srv.URL + "/v1", "OPENAI_API_KEY": "sk-test"}
	getenv := func(k string) string { return vars[k] }
	prog := cli.App{Name: "onceflow", Providers: []cli.Provider{openaiprovider.Provider()}}

	out, errOut, code := runCommand(t, prog, getenv, "batches", "list", "--json")
	var lane onceflow.BatchLane
	if code != 0 || json.Unmarshal([]byte(out), &lane) != nil {
		t.Fatalf("batches list --json: exit %d, %q %s", code, out, errOut)
	}
	if lane.Pending["gpt-4.1-nano"] != 1 || len(lane.Batches) != 1 || lane.Batches[0].BatchID != info.ID || lane.Batches[0].State != "submitted" {
		t.Fatalf("batches list --json: %+v", lane)
	}
	out, _, code = runCommand(t, prog, getenv, "batches", "list")
	if code != 0 || !strings.Contains(out, "1 requests of gpt-4.1-nano wait for a batch") || !strings.Contains(out, info.ID) {
		t.Fatalf("batches list: exit %d\n%s", code, out)
	}

	out, errOut, code = runCommand(t, prog, getenv, "batches", "cancel", sub)
	if code != 0 || !strings.Contains(out, "asked openai to cancel batch "+info.ID) {
		t.Fatalf("batches cancel: exit %d, %q %s", code, out, errOut)
	}
	if n := fake.Stats().BatchesCancelled; n != 1 {
		t.Fatalf("the provider cancelled %d batches, want 1", n)
	}
	if _, errOut, code = runCommand(t, prog, getenv, "batches", "cancel", "batch_nope"); code != 1 || !strings.Contains(errOut, "no such batch") {
		t.Fatalf("batches cancel of an unknown id: exit %d, %s", code, errOut)
	}
	if _, _, code = runCommand(t, prog, getenv, "batches", "cancel"); code != 2 {
		t.Fatalf("batches cancel without an id: exit %d, want 2", code)
	}
}

// `batches cancel` under a provider without a batch API says so, naming ONCEFLOW_LLM
// (the setting to change), not the summaries' lane, which it does not read (exit 2).
func TestBatchesCancelNamesAProviderWithoutABatchAPI(t *testing.T) {
	t.Parallel()
	_, prefix := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	vars := map[string]string{"ONCEFLOW_REDIS_URL": testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL": dsn, "ONCEFLOW_PREFIX": prefix, "ONCEFLOW_LLM": "fake"}
	_, errOut, code := runCommand(t, cli.App{Name: "onceflow"}, func(k string) string { return vars[k] }, "batches", "cancel", "batch_1")
	if code != 2 || !strings.Contains(errOut, "ONCEFLOW_LLM") || !strings.Contains(errOut, "no batch API") || strings.Contains(errOut, "SUMMARIES_LANE") {
		t.Fatalf("batches cancel on the fake provider: exit %d\n%s", code, errOut)
	}
}
