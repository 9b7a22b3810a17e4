package ledger_test

import (
	"testing"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// List selects by state (ambiguous: any ambiguous attempt), model and job, newest
// first, with the recorded answer's token counts; ToolCallsOf gives each recorded tool
// call's downstream key.
func TestListAndToolCalls(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{Wait: -1})
	ctx := ctxT(t)
	begin := func(job, step, model string) *ledger.Attempt {
		t.Helper()
		tenant := "acme"
		if job == "job-22" {
			tenant = "globex"
		}
		att, _, err := l.Begin(ctx, ledger.Call{Key: "k-" + job + "-" + step, Work: ledger.Work(job, step), RequestHash: "h", Provider: "p", Model: model, Tenant: tenant})
		if err != nil {
			t.Fatal(err)
		}
		return att
	}
	a := begin("job-1", "summarise", "m1")
	if _, _, err := a.Succeed(ctx, ledger.Result{Response: []byte(`{"usage":{"input_tokens":12,"output_tokens":5}}`), Raw: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	b := begin("job-1", "classify", "m2")
	if err := b.Fail(ctx, errString("boom"), true); err != nil {
		t.Fatal(err)
	}
	begin("job-22", "summarise", "m1") // in flight; a job id ending like another's
	all, err := l.List(ctx, ledger.ListOptions{})
	if err != nil || len(all) != 3 {
		t.Fatalf("all: %d %v", len(all), err)
	}
	for _, tc := range []struct {
		opts ledger.ListOptions
		want []string
	}{
		{ledger.ListOptions{Job: "job-1"}, []string{"k-job-1-classify", "k-job-1-summarise"}},
		{ledger.ListOptions{Job: "ob-1"}, nil},
		{ledger.ListOptions{State: ledger.StateSucceeded}, []string{"k-job-1-summarise"}},
		{ledger.ListOptions{State: ledger.StateAmbiguous}, []string{"k-job-1-classify"}},
		{ledger.ListOptions{State: ledger.StateInFlight, Model: "m1"}, []string{"k-job-22-summarise"}},
		{ledger.ListOptions{Model: "m2", Job: "job-22"}, nil},
		{ledger.ListOptions{Tenant: "globex"}, []string{"k-job-22-summarise"}},
		{ledger.ListOptions{Tenant: "acme", State: ledger.StateSucceeded}, []string{"k-job-1-summarise"}},
		{ledger.ListOptions{Tenant: "initech"}, nil},
	} {
		got, err := l.List(ctx, tc.opts)
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, s := range got {
			keys = append(keys, s.Key)
		}
		if len(keys) != len(tc.want) || (len(keys) > 0 && !sameSet(keys, tc.want)) {
			t.Errorf("%+v: %v, want %v", tc.opts, keys, tc.want)
		}
	}
	got, _ := l.List(ctx, ledger.ListOptions{State: ledger.StateSucceeded})
	if got[0].InputTokens != 12 || got[0].OutputTokens != 5 || got[0].Work != "summarise/job-1" || got[0].Tenant != "acme" {
		t.Fatalf("summary: %+v", got[0])
	}
	if _, err := l.List(ctx, ledger.ListOptions{State: "bogus"}); err == nil {
		t.Fatal("an unknown state was accepted")
	}
	keys, err := l.ToolKeys(ctx, "p", "k-job-1-summarise", []llm.ToolCall{
		{ID: "call_1", Name: "refund", Arguments: `{"order":"o-9"}`}, {Name: "email", Arguments: `{"to":"a"}`}})
	if err != nil {
		t.Fatal(err)
	}
	tools, err := l.ToolCallsOf(ctx, []string{"k-job-1-summarise", "k-job-22-summarise"})
	// Only calls with a provider id are recorded (one without is keyed by its
	// arguments alone, which need no record).
	if err != nil || len(tools) != 1 || tools[0].Tool != "refund" || tools[0].Key != keys[0].Key || tools[0].FirstID != "call_1" {
		t.Fatalf("tool calls: %+v %v (ToolKeys: %+v)", tools, err, keys)
	}
}

func sameSet(a, b []string) bool {
	m := map[string]int{}
	for _, x := range a {
		m[x]++
	}
	for _, x := range b {
		m[x]--
	}
	for _, v := range m {
		if v != 0 {
			return false
		}
	}
	return true
}

type errString string

func (e errString) Error() string { return string(e) }
