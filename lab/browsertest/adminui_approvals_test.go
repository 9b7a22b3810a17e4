package browsertest_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/lab/browsertest"
)

// In the browser: the overview links to the approvals, where an agent's refund waits
// with its arguments and the conversation so far; the operator types a note and
// approves it with the call's Approve button, and the job runs the refund once. The
// other tenant's call is still there.
func TestBrowserApproveAToolCall(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t)
	app := adminuitest.NewAgentApp(t, "A-1042")
	app.Run(t)
	acme := app.Ask(t, "acme", "My parcel never came. Please refund order A-1042.")
	globex := app.Ask(t, "globex", "Refund A-1042 for Globex, please.")
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	if s := text(t, ctx, `ul[data-live="waiting"] a[href="/ui/approvals"]`); s != "2 tool calls waiting for approval" {
		t.Fatalf("the overview's link to the approvals says %q", s)
	}
	if code := click(t, ctx, `ul[data-live="waiting"] a[href="/ui/approvals"]`); code != http.StatusOK {
		t.Fatalf("Approvals: %d", code)
	}
	call := `article.approval:has(input[name="key"][value="` + acme.Key + `"])`
	if s := text(t, ctx, call+" h2"); s != "Tool issue_refund, for tenant acme" {
		t.Fatalf("the call's heading says %q", s)
	}
	if s := text(t, ctx, call+" pre.args"); !strings.Contains(s, `"order": "A-1042"`) {
		t.Fatalf("the call's arguments show %q", s)
	}
	do(t, ctx, "open the conversation", chromedp.Click(chromedp.CSS(call+" details.conversation summary")))
	if s := text(t, ctx, call+" ol.messages"); !strings.Contains(s, "My parcel never came") || !strings.Contains(s, "lost in transit") {
		t.Fatalf("the conversation shows %q", s)
	}
	shot(t, ctx, "approvals.png")
	do(t, ctx, "type a note", chromedp.SendKeys(chromedp.ID("approve-note-"+acme.Key), "customer called; parcel lost"))
	if code := click(t, ctx, call+` form:has(input[name="decision"][value="approve"]) button[type="submit"]`); code != http.StatusOK {
		t.Fatalf("Approve: %d", code)
	}
	if s := text(t, ctx, "p.notice"); s != "Approved: the job runs the call now." {
		t.Fatalf("after Approve the page says %q", s)
	}
	app.WaitStatus(t, "acme", acme.JobID, onceflow.StatusDone)
	if n := app.Refunds(acme.Key); n != 1 {
		t.Fatalf("the approved refund ran %d times, want 1", n)
	}
	if s := text(t, ctx, "main"); strings.Contains(s, acme.JobID) || !strings.Contains(s, globex.JobID) {
		t.Fatalf("after the approval the page shows %q", s)
	}
}

// In the browser: a job in doubt's page shows its call; the operator, who checked the
// refunds system, types what it returned and clicks "It happened"; the job goes on
// from that result without a second refund.
func TestBrowserResolveAJobInDoubt(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t)
	app := adminuitest.NewAgentApp(t, "A-1043")
	app.Run(t)
	id, call := app.InDoubt(t, "acme", "Refund order A-1043, please.")
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	if code := click(t, ctx, `ul[data-live="waiting"] a[href="/ui/jobs/`+id+`"]`); code != http.StatusOK {
		t.Fatalf("the job in doubt from the overview: %d", code)
	}
	if st := text(t, ctx, "dl.facts dd strong"); st != "in_doubt" {
		t.Fatalf("the job's page says %q", st)
	}
	shot(t, ctx, "in-doubt.png")
	do(t, ctx, "type the result", chromedp.SendKeys(chromedp.ID("result-"+call.Key), `{"refund":"re_77","status":"succeeded"}`))
	if code := click(t, ctx, `form:has(input[name="outcome"][value="happened"]) button[type="submit"]`); code != http.StatusOK {
		t.Fatalf("It happened: %d", code)
	}
	if s := text(t, ctx, "p.notice"); !strings.HasPrefix(s, "Recorded: the call happened.") {
		t.Fatalf("after It happened the page says %q", s)
	}
	app.WaitStatus(t, "acme", id, onceflow.StatusDone)
	if n := app.Refunds(call.Key); n != 1 {
		t.Fatalf("the refund ran %d times, want 1: the operator said it happened", n)
	}
}
