package adminui_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
)

// A job in doubt shows on the overview and on its page, with its call (the tool, its
// arguments, its key) and a form per outcome: "it happened" records the result and the
// job goes on from it without calling the tool again; "it did not happen" puts the job
// back and it calls the tool again, once. A resolved call's form does nothing more.
func TestJobPageResolvesACallInDoubt(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-9")
	app.Run(t)
	happened, hc := app.InDoubt(t, "acme", "Refund A-9 through the old system.")
	again, ac := app.InDoubt(t, "globex", "Refund A-9 for Globex.")
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	c, token := signedIn(t, e)
	_, overview := adminuitest.Get(t, c, e.URL+"/ui/")
	for _, id := range []string{happened, again} {
		if !strings.Contains(overview, `<a href="/ui/jobs/`+id+`"><code>`+id+`</code></a>`) {
			t.Errorf("the overview does not link to the job in doubt %s: %.3000s", id, overview)
		}
	}
	if !strings.Contains(overview, "2 jobs in doubt") {
		t.Errorf("the overview does not count the jobs in doubt")
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/jobs/"+happened)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the job's page: %d", resp.StatusCode)
	}
	for _, want := range []string{"<dt>Status</dt><dd><strong>in_doubt</strong></dd>", "Tool <code>issue_refund</code>", "<code>" + hc.Key + "</code>",
		"&#34;order&#34;: &#34;A-9&#34;", `name="outcome" value="happened"`, `name="outcome" value="not-happened"`, `<textarea id="result-` + hc.Key + `" name="result"`,
		`<form method="post" action="/ui/jobs/` + happened + `">`, `name="tenant" value="acme"`, "It did not happen: run it again"} {
		if !strings.Contains(page, want) {
			t.Errorf("the page of a job in doubt lacks %q", want)
		}
	}
	resolve := func(id, key, tenant, outcome, result string) *http.Response {
		t.Helper()
		resp, _ := adminuitest.Post(t, c, e.URL+"/ui/jobs/"+id, url.Values{"csrf": {token}, "action": {"resolve"}, "tenant": {tenant}, "key": {key},
			"outcome": {outcome}, "result": {result}})
		return resp
	}
	// "It happened" without a result, for another tenant, or with a malformed field: nothing done.
	if resp := resolve(happened, hc.Key, "acme", "happened", "  "); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("happened without a result: %d, want 400", resp.StatusCode)
	}
	if resp := resolve(happened, hc.Key, "acme", "maybe", "x"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("an unknown outcome: %d, want 400", resp.StatusCode)
	}
	if resp := resolve(happened, hc.Key, "globex", "happened", "x"); resp.Header.Get("Location") != "/ui/jobs/"+happened+"?done=gone" {
		t.Errorf("naming another tenant: %d %s, want nothing done", resp.StatusCode, resp.Header.Get("Location"))
	}
	if resp := resolve(happened, hc.Key, "acme", "happened", strings.Repeat("r", 65<<10)); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a result over 64 KiB: %d, want 400", resp.StatusCode)
	}
	if st, err := app.Client.JobState(context.Background(), "acme", happened); err != nil || st.Status != onceflow.StatusInDoubt {
		t.Fatalf("the refused forms changed the job: %v %v", st, err)
	}

	// It happened: the job goes on from the operator's result, without a second refund.
	if resp := resolve(happened, hc.Key, "acme", "happened", `{"refund":"re_9","status":"succeeded"}`); resp.StatusCode != http.StatusSeeOther ||
		resp.Header.Get("Location") != "/ui/jobs/"+happened+"?done=happened" {
		t.Fatalf("happened: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	app.WaitStatus(t, "acme", happened, onceflow.StatusDone)
	if n := app.Refunds(hc.Key); n != 1 {
		t.Fatalf("the refund ran %d times, want 1: the operator said it happened", n)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/jobs/"+happened+"?done=happened")
	if !strings.Contains(page, "Recorded: the call happened.") || strings.Contains(page, `name="outcome"`) {
		t.Errorf("after the resolution the job's page shows: %.2000s", page)
	}
	// It did not happen: the job calls the tool again, once.
	if resp := resolve(again, ac.Key, "globex", "not-happened", "ignored"); resp.Header.Get("Location") != "/ui/jobs/"+again+"?done=not-happened" {
		t.Fatalf("not-happened: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	app.WaitStatus(t, "globex", again, onceflow.StatusDone)
	if n := app.Refunds(ac.Key); n != 2 {
		t.Fatalf("the refund ran %d times, want 2: in doubt, then again", n)
	}
	// A resolved call's form again: nothing done, and the page says so.
	if resp := resolve(again, ac.Key, "globex", "not-happened", ""); resp.Header.Get("Location") != "/ui/jobs/"+again+"?done=gone" {
		t.Fatalf("a second resolution: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	if n := app.Refunds(ac.Key); n != 2 {
		t.Fatalf("a second resolution ran the refund again: %d", n)
	}
}

// The resolve form needs an admin session and the session's CSRF token: without them
// it is 403 and the job stays in doubt.
func TestResolveFormNeedsAnAdminSessionAndTheCSRFToken(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-10")
	app.Run(t)
	id, call := app.InDoubt(t, "acme", "Refund A-10.")
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	c, token := signedIn(t, e)
	form := func(csrf string) url.Values {
		return url.Values{"csrf": {csrf}, "action": {"resolve"}, "tenant": {"acme"}, "key": {call.Key}, "outcome": {"not-happened"}}
	}
	tenant := adminuitest.Browser(t)
	adminuitest.SignIn(t, e, tenant, adminuitest.TenantKey)
	for name, do := range map[string]func() int{
		"no session": func() int {
			r, _ := adminuitest.Post(t, adminuitest.Browser(t), e.URL+"/ui/jobs/"+id, form(token))
			return r.StatusCode
		},
		"a tenant's": func() int {
			r, _ := adminuitest.Post(t, tenant, e.URL+"/ui/jobs/"+id, form(token))
			return r.StatusCode
		},
		"no token":      func() int { r, _ := adminuitest.Post(t, c, e.URL+"/ui/jobs/"+id, form("")); return r.StatusCode },
		"a wrong token": func() int { r, _ := adminuitest.Post(t, c, e.URL+"/ui/jobs/"+id, form(token+"x")); return r.StatusCode },
		"another origin": func() int {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/jobs/"+id, form(token), "Origin", "https://evil.example")
			return r.StatusCode
		},
	} {
		if code := do(); code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, code)
		}
	}
	if code, _, _ := try(c, http.MethodGet, e.URL+"/ui/jobs/"+id+"?"+form(token).Encode(), nil); code != http.StatusOK {
		t.Errorf("GET with the form's fields: %d", code)
	}
	if st, err := app.Client.JobState(context.Background(), "acme", id); err != nil || st.Status != onceflow.StatusInDoubt || app.Refunds(call.Key) != 1 {
		t.Fatalf("a refused resolution changed the job: %v %v, %d refunds", st, err, app.Refunds(call.Key))
	}
}
