package summaries_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/summaries"
)

// onceflow audit's report counts the ledger per provider and model, beside the
// documented fields.
func TestAuditReportsTheLedger(t *testing.T) {
	t.Parallel()
	e := lgSetup(t)
	ctx := context.Background()
	att, _, err := e.ledger.Begin(ctx, ledger.Call{Key: "k1", RequestHash: "h", Provider: "openai", Model: "gpt-4.1-mini"})
	if err != nil {
		t.Fatal(err)
	}
	if err := att.Fail(ctx, context.DeadlineExceeded, true); err != nil {
		t.Fatal(err)
	}
	r, err := summaries.Audit(ctx, summaries.AuditConfig{DB: e.pool, Redis: e.rdb, Keys: e.keys})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(r)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	for _, f := range []string{"summaries", "outbox_total", "outbox_sent", "outbox_unsent", "outbox_exhausted", "dlq", "stream_pending", "violations", "llm_calls"} {
		if _, ok := m[f]; !ok {
			t.Errorf("audit JSON lacks %q: %s", f, b)
		}
	}
	if len(r.LLMCalls) != 1 || r.LLMCalls[0].Ambiguous != 1 || r.LLMCalls[0].Abandoned != 1 || len(r.Violations) != 0 {
		t.Fatalf("report %s", b)
	}
}

// The workflow's Audit reports what it read and finds a planted violation: a summary
// committed without its email intent.
func TestWorkflowAuditReportsWhatItCheckedAndFindsAViolation(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	wf := summaries.Workflow(summaries.Options{Tenant: bearerTenant, Logger: testenv.Logger(t)})
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t), Workflows: []onceflow.Workflow{wf}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := wf.Audit(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK() || r.Workflow != summaries.Name || !slices.Contains(r.Checked, "summaries") || !slices.Contains(r.Checked, "queue summaries") {
		t.Fatalf("empty stores: %+v, want OK with the tables and the queue it checked", r)
	}
	const id = "6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c00aa"
	if _, err := pool.Exec(ctx, `INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'lost email')`, id); err != nil {
		t.Fatal(err)
	}
	r, err = wf.Audit(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if r.OK() || len(r.Violations) != 1 || !strings.Contains(r.Violations[0], id) || r.Counts["summaries"] != 1 {
		t.Fatalf("a summary without its outbox row: %+v, want one violation naming %s", r, id)
	}
}
