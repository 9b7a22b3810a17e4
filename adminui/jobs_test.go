package adminui_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// A job that failed once, was replayed from the UI and then committed a result and an
// effect that was sent: its page shows its failure while it is dead-lettered, then the
// trail of the run that succeeded, in order; the search finds it by its id, its
// effect's dedupe key and its request's idempotency key.
func TestJobTrail(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewGreetingApp(t, true)
	app.Fail.Store(true)
	app.Run(t)
	c, rdb, sink, fail := app.Client, app.Redis, app.Sink, &app.Fail
	ctx := context.Background()
	res, err := c.Enqueue(ctx, adminuitest.Greeting{Name: "ann"}, &onceflow.EnqueueOpts{Key: "greet-ann-0123456789", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	testenv.WaitFor(t, 15*time.Second, "the dead letter", func() bool { return rdb.XLen(ctx, keys.Dead()).Val() == 1 })

	e := adminuitest.Serve(t, c, rdb, adminui.Config{})
	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, b, e.URL+"/ui/jobs/"+res.JobID)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "dead-lettered") || !strings.Contains(page, "the greeting service refused the name") {
		t.Fatalf("the failed job's page: %d %.3000s", resp.StatusCode, page)
	}
	fail.Store(false)
	_, dl := adminuitest.Get(t, b, e.URL+"/ui/dead-letters?queue="+onceflow.DefaultQueue)
	id := adminuitest.Find(t, dl, `name="id" value="([0-9]+-[0-9]+)"`)
	resp, _ = adminuitest.Post(t, b, e.URL+"/ui/dead-letters", url.Values{"csrf": {adminuitest.CSRF(t, dl)}, "queue": {onceflow.DefaultQueue}, "action": {"replay"}, "id": {id}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatal(resp.StatusCode)
	}
	testenv.WaitFor(t, 15*time.Second, "the effect sent", func() bool { return sink.Sent() == 1 })

	_, page = adminuitest.Get(t, b, e.URL+"/ui/jobs/"+res.JobID)
	// A replay removes the dead letter but not the record of the failure: the job's
	// history keeps each delivery and its outcome, and the operator's replay.
	want := []string{"enqueued", "delivery 1: dead-lettered", "replayed by an operator", "enqueued again",
		"committed", "effect email.greeting written", "effect email.greeting sent"}
	at := 0
	for _, w := range want {
		i := strings.Index(page[at:], "<strong>"+w)
		if i < 0 {
			t.Fatalf("the trail lacks %q after position %d: %.5000s", w, at, page)
		}
		at += i
	}
	for _, w := range []string{"<strong>done</strong>", "acme", "greeting:" + res.JobID, `{&#34;greeted&#34;: &#34;ann&#34;}`,
		"<h2>Deliveries</h2>", "the greeting service refused the name", "(dead letter <code>" + id + "</code>)", "<strong>delivery 1 succeeded</strong>"} {
		if !strings.Contains(page, w) {
			t.Fatalf("the page lacks %q: %.5000s", w, page)
		}
	}
	// Search: by id, by the effect's dedupe key, by the idempotency key of the request.
	for name, q := range map[string]string{
		"id":         "q=" + res.JobID,
		"dedupe key": "q=" + url.QueryEscape("greeting:"+res.JobID),
		"idem key":   "tenant=acme&path=greeting&key=greet-ann-0123456789",
	} {
		resp, _ := adminuitest.Get(t, b, e.URL+"/ui/jobs?"+q)
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/jobs/"+res.JobID {
			t.Errorf("search by %s: %d %q", name, resp.StatusCode, resp.Header.Get("Location"))
		}
	}
	route := onceflow.JobID(idempotency.Scope{Tenant: "acme", Method: http.MethodPost, Path: "/v1/greetings", Key: "k-0123456789abcdef"})
	if resp, _ := adminuitest.Get(t, b, e.URL+"/ui/jobs?tenant=acme&path=/v1/greetings&key=k-0123456789abcdef"); resp.Header.Get("Location") != "/ui/jobs/"+route {
		t.Fatalf("search by a route's key: %q", resp.Header.Get("Location"))
	}
	if resp, _ := adminuitest.Get(t, b, e.URL+"/ui/jobs/00000000-0000-4000-8000-000000000999"); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("an unknown job: %d", resp.StatusCode)
	}
}

// Without RecordSuccesses a job's page shows its successful run from the
// acknowledgement, saying how to have its consumer and times.
func TestJobTrailWithoutRecordedSuccesses(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewGreetingApp(t, false)
	app.Run(t)
	ctx := context.Background()
	res, err := app.Client.Enqueue(ctx, adminuitest.Greeting{Name: "bo"}, &onceflow.EnqueueOpts{Key: "greet-bo-0123456789", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 15*time.Second, "the effect sent", func() bool { return app.Sink.Sent() == 1 })
	e := adminuitest.Serve(t, app.Client, app.Redis, adminui.Config{})
	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	testenv.WaitFor(t, 10*time.Second, "the acknowledged run on the page", func() bool {
		_, page := adminuitest.Get(t, b, e.URL+"/ui/jobs/"+res.JobID)
		return strings.Contains(page, "<strong>run succeeded (acknowledged)</strong>") && strings.Contains(page, "ONCEFLOW_RECORD_SUCCESSES=true") &&
			!strings.Contains(page, "<h2>Deliveries</h2>")
	})
}

// The job search redirects only into the UI, whatever the id, dedupe key or
// idempotency key and path.
func TestJobSearchRedirectsOnlyIntoTheUI(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	// An effect whose dedupe key is a redirect and embeds no job.
	if _, err := e.Client.Inspector().DB().Exec(ctx, `INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('t', '//evil.example', '{}')`); err != nil {
		t.Fatal(err)
	}
	c, _ := signedIn(t, e)
	base, _ := url.Parse(e.URL + "/ui/jobs")
	queries := []string{}
	for _, v := range []string{"//evil.example", `/\evil.example`, `\\evil.example`, "https://evil.example/", "http:evil.example",
		"%2F%2Fevil.example", "/%2Fevil.example", "..//evil.example", "\t//evil.example", "javascript:alert(1)"} {
		queries = append(queries, "q="+url.QueryEscape(v), "key=k&path="+url.QueryEscape(v), "key="+url.QueryEscape(v)+"&path=k&tenant="+url.QueryEscape(v))
	}
	redirects := 0
	for _, q := range queries {
		resp, _ := adminuitest.Get(t, c, e.URL+"/ui/jobs?"+q)
		loc := resp.Header.Get("Location")
		if loc == "" {
			continue
		}
		redirects++
		to, err := base.Parse(loc)
		if err != nil || to.Host != base.Host || !strings.HasPrefix(to.Path, "/ui/jobs/") || strings.HasPrefix(loc, "//") || strings.HasPrefix(loc, `/\`) {
			t.Errorf("search %s redirected to %q (%v)", q, loc, to)
		}
	}
	if redirects < 15 {
		t.Fatalf("only %d searches redirected: the test did not reach the redirects", redirects)
	}
}

// A history line's strings (detail, consumer, outcome, entry, dead
// letter id) reach the job page only escaped by html/template: in the trail and in
// the deliveries table, markup in them is text.
func TestJobPageEscapesHistoryDetails(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	const job = "00000000-0000-4000-8000-00000000a77a"
	if _, err := queue.Enqueue(ctx, e.Redis, e.Keys, queue.Message{JobID: job, Tenant: "acme", Payload: []byte(`{}`), EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	const xss = `<script>alert(1)</script><img src=x onerror=alert(2)>"'`
	var lines []string
	for i, outcome := range []string{queue.OutcomeRetry, queue.OutcomeDeadLettered, xss} {
		rec, _ := json.Marshal(map[string]any{"outcome": outcome, "entry": "1-0" + xss, "n": 1, "consumer": xss, "start": time.Now().UnixMilli() - 1000,
			"end": time.Now().UnixMilli(), "detail": xss, "dead": xss, "wait": 10})
		lines = append(lines, string(rune('1'+i))+" "+string(rec))
	}
	if err := e.Redis.HSet(ctx, e.Keys.Job(job), "history", strings.Join(lines, "\n"), "history_n", 3).Err(); err != nil {
		t.Fatal(err)
	}
	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, b, e.URL+"/ui/jobs/"+job)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "<h2>Deliveries</h2>") {
		t.Fatalf("%d %.3000s", resp.StatusCode, page)
	}
	for _, bad := range []string{"<script>alert", "<img src=x"} {
		if strings.Contains(page, bad) {
			i := strings.Index(page, bad)
			t.Errorf("unescaped %q on the job page: %s", bad, page[max(i-200, 0):min(i+200, len(page))])
		}
	}
	if !strings.Contains(page, "&lt;script&gt;alert(1)&lt;/script&gt;") {
		t.Errorf("the hostile detail is not shown escaped")
	}
}
