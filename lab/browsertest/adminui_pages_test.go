package browsertest_test

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/lab/browsertest"
	"github.com/onceflow/onceflow/ledger"
)

// In the browser: retry an exhausted outbox row from its Retry button; then the model
// calls and the page of a job that committed an effect (which the screenshots show).
func TestBrowserOutboxRetryCallsAndJobPage(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t)
	bg := context.Background()
	app := adminuitest.NewGreetingApp(t, true)
	c, rdb, db, sink := app.Client, app.Redis, app.DB, app.Sink
	// Two exhausted rows (the relay gave up on them), one failing, one sent.
	ids := adminuitest.OutboxRows(t, db, 4, 2)
	app.Flaky.Store(1) // the job's first run fails, its second commits
	app.Run(t)
	res, err := c.Enqueue(bg, adminuitest.Greeting{Name: "ann"}, &onceflow.EnqueueOpts{Key: "greet-ann-0123456789", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 15*time.Second, "the effect sent", func() bool { return sink.Sent() == 1 })
	// A model call of the job, recorded as the ledger records them.
	l, _ := ledger.New(db, ledger.Config{Wait: -1})
	for i, amb := range []bool{false, true} {
		att, _, err := l.Begin(bg, ledger.Call{Key: "llm-" + strconv.Itoa(i) + res.JobID, Work: ledger.Work(res.JobID, "summarise-"+strconv.Itoa(i)), RequestHash: "h", Provider: "openai", Model: "gpt-4.1-mini", Tenant: "acme"})
		if err != nil {
			t.Fatal(err)
		}
		if amb {
			if err := att.Fail(bg, errors.New("connection reset mid-answer"), true); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if _, _, err := att.Succeed(bg, ledger.Result{Response: []byte(`{"usage":{"input_tokens":412,"output_tokens":57}}`), Raw: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}

	e := adminuitest.Serve(t, c, rdb, adminui.Config{})
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	if code := visit(t, ctx, e.URL+"/ui/outbox?state=exhausted"); code != http.StatusOK {
		t.Fatalf("outbox: %d", code)
	}
	shot(t, ctx, "outbox.png")
	row := `table tr:has(input[name="id"][value="` + strconv.FormatInt(ids[0], 10) + `"]) td.actions button[value="retry"]`
	if code := click(t, ctx, row); code != http.StatusOK {
		t.Fatalf("Retry: %d", code)
	}
	if msg := text(t, ctx, "p.notice"); !strings.HasPrefix(msg, "1 rows are due again") {
		t.Fatalf("after Retry the page says %q", msg)
	}
	var exhausted bool
	if err := db.QueryRow(bg, `SELECT exhausted_at IS NOT NULL FROM outbox WHERE id = $1`, ids[0]).Scan(&exhausted); err != nil || exhausted {
		t.Fatalf("the retried row is still exhausted (%v)", err)
	}
	if err := db.QueryRow(bg, `SELECT exhausted_at IS NOT NULL FROM outbox WHERE id = $1`, ids[1]).Scan(&exhausted); err != nil || !exhausted {
		t.Fatalf("the other exhausted row changed (%v)", err)
	}
	// The relay sends the retried row (the greeting's effect was the first send).
	testenv.WaitFor(t, 15*time.Second, "the retried row sent", func() bool { return sink.Sent() == 2 })

	if code := click(t, ctx, `nav a[href="/ui/calls"]`); code != http.StatusOK {
		t.Fatalf("Model calls: %d", code)
	}
	if s := text(t, ctx, `[data-live="amb-total"]`); !strings.HasPrefix(s, "2 calls begun, 1 with an attempt") {
		t.Fatalf("the calls page says %q", s)
	}
	shot(t, ctx, "calls.png")

	// The search box finds the job by its effect's dedupe key.
	do(t, ctx, "search", chromedp.SendKeys(chromedp.ID("top-q"), "greeting:"+res.JobID))
	if code := click(t, ctx, `form.search button[type="submit"]`); code != http.StatusOK || !strings.HasSuffix(location(t, ctx), "/ui/jobs/"+res.JobID) {
		t.Fatalf("search led to %s (%d)", location(t, ctx), code)
	}
	if st := text(t, ctx, "dl.facts dd strong"); st != "done" {
		t.Fatalf("the job's page says %q", st)
	}
	trail := text(t, ctx, "ol.trail")
	for _, want := range []string{"enqueued", "delivery 1 failed; an attempt spent", "the greeting service timed out",
		"delivery 1 succeeded", "model call summarise-0", "committed", "effect email.greeting sent"} {
		if !strings.Contains(trail, want) {
			t.Fatalf("the trail lacks %q: %s", want, trail)
		}
	}
	shot(t, ctx, "job.png")
}
