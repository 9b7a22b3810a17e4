package adminui_test

import (
	"context"
	"encoding/json"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
)

// pendingApprovals returns how many tool calls of app wait for a decision, of every
// tenant.
func pendingApprovals(t *testing.T, app *adminuitest.AgentApp) int {
	t.Helper()
	list, err := app.Client.Inspector().Approvals(context.Background(), "", true, 100)
	if err != nil {
		t.Fatal(err)
	}
	return len(list)
}

// decisionOf returns the decision recorded on the call of a, as the job reads it.
func decisionOf(t *testing.T, app *adminuitest.AgentApp, a onceflow.Approval) onceflow.Decision {
	t.Helper()
	var raw []byte
	if err := app.DB.QueryRow(context.Background(), `SELECT result FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3`,
		a.Tenant, a.JobID, "signal:approval:"+a.Key).Scan(&raw); err != nil {
		t.Fatalf("the decision on %s: %v", a.Key, err)
	}
	var d onceflow.Decision
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	return d
}

// The approvals page lists the calls of every tenant waiting for a decision (the tool,
// its arguments, the job linked to its page, the conversation so far, when it was
// asked and its deadline), the overview links to it, a tenant filter narrows it, and
// its forms approve (the call runs once) and reject (it does not run, and the model
// reads the note), recorded as decided by the session's admin key.
func TestApprovalsPageListsEveryTenantsCallsAndDecides(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-1042")
	app.Run(t)
	acme := app.Ask(t, "acme", "My parcel never came; please refund order A-1042.")
	globex := app.Ask(t, "globex", "Refund A-1042 for Globex, please.")
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	c, token := signedIn(t, e)

	_, overview := adminuitest.Get(t, c, e.URL+"/ui/")
	if !strings.Contains(overview, `<a href="/ui/approvals">2 tool calls waiting for approval</a>`) {
		t.Fatalf("the overview does not link to the approvals with their count: %.3000s", overview)
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/approvals")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /ui/approvals: %d", resp.StatusCode)
	}
	for _, a := range []onceflow.Approval{acme, globex} {
		for _, want := range []string{`<a href="/ui/jobs/` + a.JobID + `">`, `value="` + a.Key + `"`, `value="` + a.Tenant + `"`, "for tenant " + a.Tenant} {
			if !strings.Contains(page, want) {
				t.Errorf("the page lacks %q of %s's call", want, a.Tenant)
			}
		}
	}
	for _, want := range []string{"Tool <code>issue_refund</code>", "&#34;order&#34;: &#34;A-1042&#34;", "&#34;cents&#34;: 1250",
		"My parcel never came; please refund order A-1042.", "Refunds need an operator&#39;s approval.", "calls <code>lookup_order</code>", "lost in transit",
		"The conversation so far (5 messages)", "Asked</dt>", "Deadline</dt>", `name="decision" value="approve"`, `name="decision" value="reject"`} {
		if !strings.Contains(page, want) {
			t.Errorf("the approvals page lacks %q", want)
		}
	}
	if strings.Count(page, `<form method="post" action="/ui/approvals">`) != 4 || strings.Count(page, `name="csrf" value="`+token+`"`) < 5 {
		t.Errorf("the page does not have an approve and a reject form with the CSRF token per call: %.4000s", page)
	}
	_, only := adminuitest.Get(t, c, e.URL+"/ui/approvals?tenant=acme")
	if !strings.Contains(only, acme.JobID) || strings.Contains(only, globex.JobID) {
		t.Errorf("?tenant=acme does not show acme's call alone")
	}

	// Approve acme's: the refund runs once and the job ends.
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/approvals", url.Values{"csrf": {token}, "job": {acme.JobID}, "key": {acme.Key}, "tenant": {"acme"},
		"decision": {"approve"}, "note": {"customer called"}}, "Origin", e.URL)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/approvals?done=approve" {
		t.Fatalf("approve: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	app.WaitStatus(t, "acme", acme.JobID, onceflow.StatusDone)
	if n := app.Refunds(acme.Key); n != 1 {
		t.Fatalf("the approved refund ran %d times, want 1", n)
	}
	if d := decisionOf(t, app, acme); !d.Approved || d.Note != "customer called" || !strings.HasPrefix(d.By, "admin key ") || len(d.By) != len("admin key ")+12 {
		t.Fatalf("acme's decision: %+v, want approved by the session's admin key", d)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/approvals?done=approve")
	if !strings.Contains(page, "Approved: the job runs the call now.") || strings.Contains(page, acme.JobID) || !strings.Contains(page, globex.JobID) {
		t.Fatalf("after the approval the page shows: %.3000s", page)
	}
	// Reject globex's: the refund does not run, and the model reads the note.
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/approvals", url.Values{"csrf": {token}, "job": {globex.JobID}, "key": {globex.Key}, "tenant": {"globex"},
		"decision": {"reject"}, "note": {"  duplicate of ticket 77  "}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/approvals?done=reject" {
		t.Fatalf("reject: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	app.WaitStatus(t, "globex", globex.JobID, onceflow.StatusDone)
	if n := app.Refunds(globex.Key); n != 0 {
		t.Fatalf("the rejected refund ran %d times", n)
	}
	if d := decisionOf(t, app, globex); d.Approved || d.Note != "duplicate of ticket 77" {
		t.Fatalf("globex's decision: %+v", d)
	}
	// A decision on a call decided already does nothing, and says so.
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/approvals", url.Values{"csrf": {token}, "job": {globex.JobID}, "key": {globex.Key}, "tenant": {"globex"}, "decision": {"approve"}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/approvals?done=gone" {
		t.Fatalf("a second decision: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	_, page = adminuitest.Get(t, c, e.URL+resp.Header.Get("Location"))
	if !strings.Contains(page, "Nothing was done: no job waits for that decision any more") || !strings.Contains(page, "No tool call waits for a decision") {
		t.Fatalf("after a second decision the page shows: %.2000s", page)
	}
	if n := app.Refunds(globex.Key); n != 0 {
		t.Fatalf("approving a rejected call ran it: %d", n)
	}
}

// The approvals page and its forms are an admin's only: without a session the page
// leads to the sign-in form and a tenant's API key does not open it; a decision without
// the session's CSRF token, from another origin or from a GET does nothing; malformed
// forms are refused (4xx) and decide nothing.
func TestApprovalFormsNeedAnAdminSessionAndTheCSRFToken(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-7")
	app.Run(t)
	a := app.Ask(t, "acme", "Refund A-7.")
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	anon := adminuitest.Browser(t)
	if resp, page := adminuitest.Get(t, anon, e.URL+"/ui/approvals"); resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/login" || strings.Contains(page, a.JobID) {
		t.Fatalf("GET /ui/approvals without a session: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	tenant := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, tenant, adminuitest.TenantKey); code != http.StatusUnauthorized {
		t.Fatalf("a tenant key's sign-in: %d", code)
	}
	if resp, _ := adminuitest.Get(t, tenant, e.URL+"/ui/approvals"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("a tenant key opened the approvals: %d", resp.StatusCode)
	}
	c, token := signedIn(t, e)
	form := func(csrf string) url.Values {
		return url.Values{"csrf": {csrf}, "job": {a.JobID}, "key": {a.Key}, "tenant": {"acme"}, "decision": {"approve"}}
	}
	for name, do := range map[string]func() int{
		"no session": func() int { r, _ := adminuitest.Post(t, anon, e.URL+"/ui/approvals", form(token)); return r.StatusCode },
		"a tenant's": func() int {
			r, _ := adminuitest.Post(t, tenant, e.URL+"/ui/approvals", form(token))
			return r.StatusCode
		},
		"no token": func() int { r, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form("")); return r.StatusCode },
		"a wrong token": func() int {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form(token+"x"))
			return r.StatusCode
		},
		"another origin": func() int {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form(token), "Origin", "https://evil.example")
			return r.StatusCode
		},
		"cross-site": func() int {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form(token), "Sec-Fetch-Site", "cross-site")
			return r.StatusCode
		},
	} {
		if code := do(); code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, code)
		}
	}
	if resp, _ := adminuitest.Get(t, c, e.URL+"/ui/approvals?"+form(token).Encode()); resp.StatusCode != http.StatusOK {
		t.Errorf("GET with the form's fields: %d", resp.StatusCode)
	}
	for name, f := range map[string]url.Values{
		"an unknown decision": {"decision": {"maybe"}},
		"a malformed job id":  {"job": {"a b"}},
		"a malformed key":     {"key": {"wait:approval:x"}},
		"a malformed tenant":  {"tenant": {"ac/me"}},
		"a note too long":     {"note": {strings.Repeat("n", onceflow.MaxDecisionNote+1)}},
	} {
		v := form(token)
		for k, vs := range f {
			v[k] = vs
		}
		if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", v); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: %d, want 400", name, resp.StatusCode)
		}
	}
	if code, _, _ := try(c, http.MethodPost, e.URL+"/ui/approvals", strings.NewReader(form(token).Encode()+"&note="+strings.Repeat("x", 300<<10))); code >= 500 || code == http.StatusSeeOther {
		t.Errorf("a 300 KiB form: %d", code)
	}
	if n := pendingApprovals(t, app); n != 1 || app.Refunds(a.Key) != 0 {
		t.Fatalf("the refused requests decided: %d pending, %d refunds", n, app.Refunds(a.Key))
	}
	// Another tenant's name with the call's key decides nothing (the call is acme's).
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", url.Values{"csrf": {token}, "job": {a.JobID}, "key": {a.Key}, "tenant": {"globex"}, "decision": {"reject"}}); resp.Header.Get("Location") != "/ui/approvals?done=gone" {
		t.Errorf("a decision naming another tenant: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	if n := pendingApprovals(t, app); n != 1 {
		t.Fatalf("a decision naming another tenant decided: %d pending", n)
	}
}

// Arguments and a conversation that hold markup are shown escaped, on the approvals
// page and on the job's page.
func TestApprovalsPageEscapesArgumentsAndConversation(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, xss)
	app.Run(t)
	a := app.Ask(t, "acme", "Refund "+xss)
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	c, _ := signedIn(t, e)
	for _, p := range []string{"/ui/approvals", "/ui/jobs/" + a.JobID, "/ui/"} {
		_, page := adminuitest.Get(t, c, e.URL+p)
		for _, bad := range []string{"<b>XSS", "<script>alert", `'><`} {
			if strings.Contains(page, bad) {
				t.Errorf("%s renders %q unescaped", p, bad)
			}
		}
		if p == "/ui/approvals" && strings.Count(page, "&lt;script&gt;alert(1)&lt;/script&gt;") < 4 {
			t.Errorf("%s does not show the hostile arguments and messages, escaped: %.3000s", p, page)
		}
	}
}

// heldJob is a job whose model step an eval gate checks.
type heldJob struct{}

func (heldJob) Kind() string { return "ui.held" }

// The approvals page lists the jobs an eval gate holds (the gate, why, the job) with
// release and reject forms; released, the job goes on and commits once; a second
// decision does nothing.
func TestApprovalsPageReleasesAHeldJob(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[heldJob](func(ctx context.Context, job *onceflow.Job[heldJob]) error {
		st, err := job.Complete(ctx, "classify", &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "The app crashes."}}})
		if err != nil {
			return err
		}
		return job.Commit(ctx, func(c *onceflow.Commit) error { c.Result(st.Response.Content); return nil })
	}))
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{{Text: "bug"}}}
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: ws, Model: model, NoLimits: true, Logger: testenv.Logger(t),
		Gates: []onceflow.Gate{{Step: "classify", Name: "structured", Schema: json.RawMessage(`{"type":"object"}`)}}})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, cl)
	res, err := cl.Enqueue(context.Background(), heldJob{}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	var held []onceflow.Held
	testenv.WaitFor(t, 10*time.Second, "the job held", func() bool {
		held, err = cl.Inspector().Held(context.Background(), "", true, 10)
		return err == nil && len(held) == 1
	})
	e := adminuitest.Serve(t, cl, rdb, adminui.Config{})
	c, token := signedIn(t, e)
	_, page := adminuitest.Get(t, c, e.URL+"/ui/approvals")
	for _, want := range []string{"Held by an eval gate <small>(1)</small>", "Gate <code>structured</code>, for tenant acme", "the answer is not JSON",
		`<a href="/ui/jobs/` + res.JobID + `">`, `name="kind" value="gate"`, `value="` + held[0].Key + `"`, "Release</button>"} {
		if !strings.Contains(page, want) {
			t.Errorf("the approvals page lacks %q", want)
		}
	}
	form := url.Values{"csrf": {token}, "kind": {"gate"}, "job": {res.JobID}, "key": {held[0].Key}, "tenant": {"acme"}, "decision": {"approve"}}
	resp, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/approvals?done=release" {
		t.Fatalf("release: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	testenv.WaitFor(t, 10*time.Second, "the released job done", func() bool {
		st, err := cl.JobState(context.Background(), "acme", res.JobID)
		return err == nil && st.Status == onceflow.StatusDone && string(st.Result) == `"bug"`
	})
	form.Set("decision", "reject")
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form); resp.Header.Get("Location") != "/ui/approvals?done=gone" {
		t.Fatalf("rejecting a released job: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	form.Set("key", "tool-"+strings.Repeat("a", 64)) // a tool call's key is no answer's
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/approvals", form); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("a gate decision on a tool call's key: %d, want 400", resp.StatusCode)
	}
}

// runClient runs c until the test ends.
func runClient(t *testing.T, c *onceflow.Client) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}
