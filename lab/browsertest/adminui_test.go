package browsertest_test

// Browser tests: the operator UI driven in a real headless Chromium
// (lab/browsertest), as an operator uses it: typing into its forms and clicking
// its buttons, on a UI served by an httptest server on a real Redis and PostgreSQL.
// Without Chromium (scripts/install-chromium) they skip.
//
// With ONCEFLOW_UI_SCREENSHOTS set to a directory they also save 1280x800 PNGs of
// the pages there (`make ui-screenshots` writes docs/ui/ this way; docs/ui.md shows
// them).

import (
	"context"
	"errors"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/lab/browsertest"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// envScreenshots names the directory the browser tests save their screenshots in.
const envScreenshots = "ONCEFLOW_UI_SCREENSHOTS"

// shot saves what the tab shows as dir/name when ONCEFLOW_UI_SCREENSHOTS is set.
func shot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	dir := os.Getenv(envScreenshots)
	if dir == "" {
		return
	}
	if err := browsertest.Screenshot(ctx, filepath.Join(dir, name)); err != nil {
		t.Errorf("screenshot %s: %v", name, err)
	}
}

// do runs browser steps, failing the test at the first error.
func do(t *testing.T, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// visit loads u in the tab and returns the HTTP status of the page it lands on (after
// redirects).
func visit(t *testing.T, ctx context.Context, u string) int64 {
	t.Helper()
	resp, err := chromedp.Run(ctx, chromedp.NavigateResponse(u))
	if err != nil {
		t.Fatalf("open %s: %v", u, err)
	}
	return resp.Status
}

// click clicks the element sel (a CSS selector) that submits a form or follows a link,
// waits for the page it leads to and returns that page's HTTP status (after
// redirects).
func click(t *testing.T, ctx context.Context, sel string) int64 {
	t.Helper()
	resp, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS(sel)))
	if err != nil {
		t.Fatalf("click %s: %v", sel, err)
	}
	return resp.Status
}

// text returns the visible text of the element sel (a CSS selector), once it shows.
func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel), chromedp.NodeVisible))
	if err != nil {
		t.Fatalf("text of %s: %v", sel, err)
	}
	return strings.TrimSpace(s)
}

// location returns the tab's URL.
func location(t *testing.T, ctx context.Context) string {
	t.Helper()
	u, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// cookies returns the names of the browser's cookies for u.
func cookies(t *testing.T, ctx context.Context, u string) []string {
	t.Helper()
	cs, err := chromedp.Run(ctx, func(ctx context.Context, tg *chromedp.Target) ([]*network.Cookie, error) {
		r, err := cdp.Call(ctx, tg, network.GetCookies, network.GetCookiesParams{URLs: []string{u}})
		return r.Cookies, err
	})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range cs {
		names = append(names, c.Name)
	}
	return names
}

// signInWith opens the sign-in form of e, types key and submits it; it returns the
// status of the page the browser lands on.
func signInWith(t *testing.T, ctx context.Context, e *adminuitest.Env, key string, screenshot string) int64 {
	t.Helper()
	if code := visit(t, ctx, e.URL+"/ui/"); code != http.StatusOK || location(t, ctx) != e.URL+"/ui/login" {
		t.Fatalf("signed out, /ui/ led to %s (%d), want the sign-in form", location(t, ctx), code)
	}
	do(t, ctx, "type the key", chromedp.WaitVisible(chromedp.CSS("form.login")), chromedp.SendKeys(chromedp.ID("key"), key))
	if screenshot != "" {
		shot(t, ctx, screenshot)
	}
	return click(t, ctx, `form.login button[type="submit"]`)
}

// rowOf is the CSS selector of the dead-letters table's row of the dead letter id.
func rowOf(id string) string { return fmt.Sprintf(`table.dead tr:has(input[name="id"][value=%q])`, id) }

// An operator signs in with the admin key, sees the queue's dead letter on the
// overview, opens Dead letters, replays the job with its row's button and sees the
// outcome; the job is back on the queue and a worker that succeeds finishes it.
func TestBrowserSignInAndReplayADeadLetter(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t) // first: skips at once without a browser
	e := adminuitest.New(t, adminui.Config{})
	jobs := adminuitest.DeadLetters(t, e, 1)
	bg := context.Background()
	dl, _, err := queue.ListDead(bg, e.Redis, e.Keys, "", 10)
	if err != nil || len(dl) != 1 {
		t.Fatal(dl, err)
	}

	if code := signInWith(t, ctx, e, adminuitest.AdminKey, "login.png"); code != http.StatusOK || location(t, ctx) != e.URL+"/ui/" {
		t.Fatalf("sign-in led to %s (%d), want the overview", location(t, ctx), code)
	}
	if h := text(t, ctx, "main h1"); h != "Overview" {
		t.Fatalf("after sign-in the page says %q", h)
	}
	if n := text(t, ctx, fmt.Sprintf(`table[data-live="queues"] a[href="/ui/dead-letters?queue=%s"]`, adminuitest.Queue)); n != "1" {
		t.Fatalf("the overview shows %q dead letters for %s, want 1", n, adminuitest.Queue)
	}
	shot(t, ctx, "signed-in.png")

	if code := click(t, ctx, `nav a[href="/ui/dead-letters"]`); code != http.StatusOK {
		t.Fatalf("Dead letters: %d", code)
	}
	row := text(t, ctx, rowOf(dl[0].ID))
	if !strings.Contains(row, jobs[0]) || !strings.Contains(row, "permanent: unexpected EOF") {
		t.Fatalf("the dead letter's row shows %q, want job %s and its reason", row, jobs[0])
	}
	if code := click(t, ctx, rowOf(dl[0].ID)+` td.actions button[name="action"][value="replay"]`); code != http.StatusOK {
		t.Fatalf("Replay: %d", code)
	}
	if n := text(t, ctx, "p.notice"); n != "Replayed 1." {
		t.Fatalf("after Replay the page says %q, want %q", n, "Replayed 1.")
	}
	if s := text(t, ctx, "table.dead tbody"); s != "No dead letters." {
		t.Fatalf("after Replay the table shows %q", s)
	}
	shot(t, ctx, "replayed.png")
	if n := e.Redis.XLen(bg, e.Keys.Dead()).Val(); n != 0 {
		t.Fatalf("%d dead letters left after the replay", n)
	}
	if _, state, _, err := queue.JobState(bg, e.Redis, e.Keys, jobs[0]); err != nil || state != queue.StateQueued {
		t.Fatalf("the replayed job reads %q, %v; want queued", state, err)
	}

	// A worker that succeeds runs it: the job is acknowledged and not failed. (The queue
	// records no "done" state: the job index stays queued and its latest stream entry
	// reads acknowledged.)
	ran := make(chan string, 8)
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.Redis, Keys: e.Keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(_ context.Context, j *queue.Job) error { ran <- j.JobID; return nil })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(bg)
	stopped := make(chan struct{})
	go func() { _ = w.Run(wctx); close(stopped) }()
	defer func() { cancel(); <-stopped }()
	select {
	case id := <-ran:
		if id != jobs[0] {
			t.Fatalf("the worker ran job %s, want %s", id, jobs[0])
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the replayed job did not run")
	}
	testenv.WaitFor(t, 10*time.Second, "the replayed job acknowledged", func() bool {
		ix, err := queue.ReadJobIndex(bg, e.Redis, e.Keys, jobs[0])
		if err != nil || ix.State == queue.StateFailed || ix.Entry == "" {
			return false
		}
		st, err := queue.EntryState(bg, e.Redis, e.Keys, queue.DefaultGroup, ix.Entry)
		return err == nil && st == queue.EntryAcknowledged
	})
	if _, state, _, err := queue.JobState(bg, e.Redis, e.Keys, jobs[0]); err != nil || state == queue.StateFailed {
		t.Fatalf("the finished job reads %q, %v", state, err)
	}
	// Its page says it is done, and its trail shows the replay's enqueue.
	if code := visit(t, ctx, e.URL+"/ui/jobs/"+jobs[0]); code != http.StatusOK {
		t.Fatalf("the job's page: %d", code)
	}
	if st := text(t, ctx, "dl.facts dd strong"); st != "done" {
		t.Fatalf("the job's page says %q, want done", st)
	}
	if tr := text(t, ctx, "ol.trail"); !strings.Contains(tr, "enqueued") {
		t.Fatalf("the job's trail: %q", tr)
	}
}

// A tenant API key typed into the sign-in form does not open the UI: the form says
// so, no session cookie is set and the pages still lead to the form.
func TestBrowserTenantKeyIsRefused(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t) // first: skips at once without a browser
	e := adminuitest.New(t, adminui.Config{})
	if code := signInWith(t, ctx, e, adminuitest.TenantKey, ""); code != http.StatusUnauthorized {
		t.Fatalf("a tenant key's sign-in answered %d, want 401", code)
	}
	if msg := text(t, ctx, `p.error[role="alert"]`); msg != "That is not an admin key." {
		t.Fatalf("the form says %q", msg)
	}
	if v, err := chromedp.Run(ctx, chromedp.Value(chromedp.ID("key"))); err != nil || v != "" {
		t.Fatalf("the refused form kept the key %q (%v)", v, err)
	}
	shot(t, ctx, "login-refused.png")
	if names := cookies(t, ctx, e.URL+"/ui/"); slices.Contains(names, "onceflow_ui") {
		t.Fatalf("a tenant key got a session cookie: %v", names)
	}
	for _, page := range []string{"/ui/", "/ui/dead-letters"} {
		visit(t, ctx, e.URL+page)
		if loc := location(t, ctx); loc != e.URL+"/ui/login" {
			t.Fatalf("after the refused sign-in %s led to %s, want the sign-in form", page, loc)
		}
		do(t, ctx, "the sign-in form", chromedp.WaitVisible(chromedp.CSS("form.login")))
	}
}

// attackPage serves, at /?to=URL&csrf=TOKEN, a page of another origin with a form
// that POSTs "purge all dead letters of adminuitest.Queue, confirmed" to URL.
func attackPage(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, `<!doctype html><title>Win a prize</title>
<form method="post" action="%s">
<input type="hidden" name="action" value="purge"><input type="hidden" name="confirm" value="yes">
<input type="hidden" name="all" value="1"><input type="hidden" name="queue" value="%s">
<input type="hidden" name="csrf" value="%s">
<button id="go" type="submit">Claim your prize</button>
</form>`, html.EscapeString(r.FormValue("to")), adminuitest.Queue, html.EscapeString(r.FormValue("csrf")))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// While an operator is signed in, a page of another origin that posts "purge all" to
// the UI is refused (403) and purges nothing: from another site (localhost beside the
// UI's 127.0.0.1) the SameSite=Strict cookie is not even sent; from another origin of
// the same site the cookie is sent and the Origin check refuses it, even with the
// session's real CSRF token.
func TestBrowserCrossOriginPostIsRefused(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t) // first: skips at once without a browser
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 3)
	bg := context.Background()
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	visit(t, ctx, e.URL+"/ui/dead-letters")
	token, err := chromedp.Run(ctx, chromedp.Value(chromedp.CSS(`form#bulk input[name="csrf"]`)))
	if err != nil || token == "" {
		t.Fatalf("the page's CSRF token: %q, %v", token, err)
	}
	evil := attackPage(t)
	sameSite := evil.URL                                                // http://127.0.0.1:PORT, another origin
	crossSite := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1) // another site
	target := e.URL + "/ui/dead-letters"
	for _, c := range []struct {
		name, page, csrf, says string
	}{
		{"another site, made-up token", crossSite, "made-up-token-0123456789", "You are not signed in"},
		{"same site, another origin, made-up token", sameSite, "made-up-token-0123456789", "came from another site"},
		{"same site, another origin, the real token", sameSite, token, "came from another site"},
	} {
		visit(t, ctx, c.page+"/?to="+target+"&csrf="+c.csrf)
		if code := click(t, ctx, "#go"); code != http.StatusForbidden {
			t.Errorf("%s: the UI answered %d, want 403", c.name, code)
		}
		if loc := location(t, ctx); loc != target {
			t.Errorf("%s: the browser landed on %s", c.name, loc)
		}
		if msg := text(t, ctx, `p.error[role="alert"]`); !strings.Contains(msg, c.says) {
			t.Errorf("%s: the page says %q, want %q", c.name, msg, c.says)
		}
		if c.csrf == token {
			shot(t, ctx, "refused.png")
		}
		if n := e.Redis.XLen(bg, e.Keys.Dead()).Val(); n != 3 {
			t.Fatalf("%s: %d dead letters left, want all 3", c.name, n)
		}
	}
	// The operator is still signed in and sees all three.
	if code := visit(t, ctx, target); code != http.StatusOK || location(t, ctx) != target {
		t.Fatalf("after the attacks the dead letters page led to %s (%d)", location(t, ctx), code)
	}
	n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('table.dead input[type="checkbox"]').length`))
	if err != nil || n != 3 {
		t.Fatalf("the page lists %d dead letters (%v), want 3", n, err)
	}
}

// failJobs makes a dead letter of each message: a worker fails each permanently with
// its reason.
func failJobs(t *testing.T, e *adminuitest.Env, msgs []queue.Message, reasons map[string]string) {
	t.Helper()
	ctx := context.Background()
	for _, m := range msgs {
		if _, err := queue.Enqueue(ctx, e.Redis, e.Keys, m); err != nil {
			t.Fatal(err)
		}
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.Redis, Keys: e.Keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(_ context.Context, j *queue.Job) error {
			return retry.Permanent(errors.New(reasons[j.JobID]))
		})})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = w.Run(wctx); close(done) }()
	testenv.WaitFor(t, 10*time.Second, "dead letters", func() bool { return e.Redis.XLen(ctx, e.Keys.Dead()).Val() == int64(len(msgs)) })
	cancel()
	<-done
}

// Two rows selected with their checkboxes and "Purge selected": the UI asks first,
// and once confirmed those two are gone and the others stay.
func TestBrowserBulkPurgeAsksFirst(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t) // first: skips at once without a browser
	e := adminuitest.New(t, adminui.Config{})
	bg := context.Background()
	var msgs []queue.Message
	reasons := map[string]string{}
	for i, d := range []struct{ tenant, kind, reason string }{
		{"acme", "summarize", "model refused: the prompt is over the context window (212,480 tokens)"},
		{"acme", "send-email", "email provider: 550 mailbox unavailable"},
		{"globex", "triage", `invalid payload: missing field "ticket_id"`},
		{"initech", "summarize", "model refused: the prompt is over the context window (198,102 tokens)"},
		{"globex", "send-email", "email provider: 553 address rejected"},
	} {
		id := fmt.Sprintf("7c1e5b2a-%04x-4d3e-9f10-%012x", 0x3a10+i*0x111, 0x5d2c0e4b7a90+i*0x1f3)
		msgs = append(msgs, queue.Message{JobID: id, Tenant: d.tenant, Kind: d.kind, Payload: []byte(`{}`)})
		reasons[id] = d.reason
	}
	failJobs(t, e, msgs, reasons)
	dl, _, err := queue.ListDead(bg, e.Redis, e.Keys, "", 10)
	if err != nil || len(dl) != len(msgs) {
		t.Fatal(len(dl), err)
	}
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	if code := click(t, ctx, `nav a[href="/ui/dead-letters"]`); code != http.StatusOK {
		t.Fatalf("Dead letters: %d", code)
	}
	purge := []string{dl[1].ID, dl[3].ID}
	for _, id := range purge {
		do(t, ctx, "select "+id, chromedp.Click(chromedp.CSS(rowOf(id)+` input[type="checkbox"]`)))
	}
	shot(t, ctx, "dead-letters.png")
	if code := click(t, ctx, `button[form="bulk"][name="action"][value="purge"]`); code != http.StatusOK {
		t.Fatalf("Purge selected: %d", code)
	}
	if h := text(t, ctx, "main h1"); h != "Are you sure?" {
		t.Fatalf("Purge selected led to %q, want the confirmation", h)
	}
	if q := text(t, ctx, "p.question"); !strings.Contains(q, "Purge 2 dead letters of queue "+adminuitest.Queue) {
		t.Fatalf("the confirmation asks %q", q)
	}
	shot(t, ctx, "confirm.png")
	if n := e.Redis.XLen(bg, e.Keys.Dead()).Val(); n != int64(len(msgs)) {
		t.Fatalf("asking purged: %d dead letters left", n)
	}
	if code := click(t, ctx, `main form button.danger[type="submit"]`); code != http.StatusOK {
		t.Fatalf("confirm: %d", code)
	}
	if n := text(t, ctx, "p.notice"); n != "Purged 2." {
		t.Fatalf("after the purge the page says %q", n)
	}
	shot(t, ctx, "purged.png")
	left, _, err := queue.ListDead(bg, e.Redis, e.Keys, "", 10)
	if err != nil || len(left) != len(msgs)-2 {
		t.Fatalf("%d dead letters left (%v), want %d", len(left), err, len(msgs)-2)
	}
	for _, d := range left {
		if slices.Contains(purge, d.ID) {
			t.Fatalf("dead letter %s was purged but is still there", d.ID)
		}
	}
	for _, d := range dl {
		rows, err := chromedp.Run(ctx, chromedp.Evaluate[int](fmt.Sprintf(`document.querySelectorAll(%q).length`, rowOf(d.ID))))
		if err != nil {
			t.Fatal(err)
		}
		want := 1
		if slices.Contains(purge, d.ID) {
			want = 0
		}
		if rows != want {
			t.Fatalf("row of %s shown %d times, want %d", d.JobID, rows, want)
		}
	}
}
