package adminui_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/ledger"
)

// The model-calls page lists the ledger with tokens, filters it, and counts the calls
// with an ambiguous attempt per hour.
func TestModelCalls(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	l, err := ledger.New(e.Client.Inspector().DB(), ledger.Config{Wait: -1})
	if err != nil {
		t.Fatal(err)
	}
	ok, _, err := l.Begin(ctx, ledger.Call{Key: "k-ok", Work: ledger.Work("job-ok-0001", "summarise"), RequestHash: "h", Provider: "openai", Model: "gpt-4.1-mini", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := ok.Succeed(ctx, ledger.Result{Response: []byte(`{"usage":{"input_tokens":120,"output_tokens":34}}`), Raw: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	amb, _, err := l.Begin(ctx, ledger.Call{Key: "k-amb", Work: ledger.Work("job-amb-0002", "summarise"), RequestHash: "h", Provider: "openai", Model: "gpt-4.1", Tenant: "globex"})
	if err != nil {
		t.Fatal(err)
	}
	if err := amb.Fail(ctx, errors.New("connection reset mid-answer"), true); err != nil {
		t.Fatal(err)
	}
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/calls")
	// 120 input and 34 output tokens of gpt-4.1-mini at the default prices (0.40 and 1.60
	// USD per million): 0.0001024 USD.
	for _, want := range []string{"2 calls begun, 1 with an attempt", "(50.00 %)", "120 / 34", `summarise/<a href="/ui/jobs/job-ok-0001">`, "connection reset mid-answer",
		"<td>acme</td>", "<td>globex</td>", `<td class="num">0.000102</td>`, "cost 0.000102 USD by the default price table"} {
		if resp.StatusCode != http.StatusOK || !strings.Contains(page, want) {
			t.Fatalf("calls page lacks %q: %.4000s", want, page)
		}
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/calls?state=ambiguous")
	if !strings.Contains(page, "job-amb-0002") || strings.Contains(page, "/ui/jobs/job-ok-0001") {
		t.Fatalf("ambiguous filter: %.4000s", page)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/calls?model=gpt-4.1-mini&job=job-ok-0001")
	if !strings.Contains(page, "/ui/jobs/job-ok-0001") || strings.Contains(page, "job-amb-0002\"") {
		t.Fatalf("model and job filter: %.4000s", page)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/calls?tenant=globex")
	if !strings.Contains(page, "job-amb-0002") || strings.Contains(page, "job-ok-0001") {
		t.Fatalf("tenant filter: %.4000s", page)
	}
	if resp, _ := adminuitest.Get(t, c, e.URL+"/ui/calls?state=bogus"); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("unknown state: %d", resp.StatusCode)
	}
}

// A call answered through the provider's batch API is marked so on the model-calls page
// and priced at the batch price: half the synchronous one.
func TestModelCallsPriceBatchAnswersAtTheBatchPrice(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	l, err := ledger.New(e.Client.Inspector().DB(), ledger.Config{Wait: -1})
	if err != nil {
		t.Fatal(err)
	}
	call := ledger.Call{Key: "k-batch", Work: ledger.Work("job-batch-0001", "summarise"), RequestHash: "h", Provider: "openai" + ledger.BatchSuffix,
		Model: "gpt-4.1-mini", Tenant: "acme"}
	if _, err := l.Record(ctx, nil, call, ledger.Result{Response: []byte(`{"usage":{"input_tokens":120,"output_tokens":34}}`), Raw: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, page := adminuitest.Get(t, c, e.URL+"/ui/calls")
	// Half of 0.0001024 USD (120 and 34 tokens at 0.40 and 1.60 USD per million).
	for _, want := range []string{"<td>gpt-4.1-mini (batch)</td>", `<td class="num">0.000051</td>`} {
		if !strings.Contains(page, want) {
			t.Fatalf("calls page lacks %q: %.4000s", want, page)
		}
	}
}
