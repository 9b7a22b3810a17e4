package adminui_test

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
)

type greeting struct {
	Name string `json:"name"`
}

func (greeting) Kind() string { return "greeting" }

// greetingApp is a client of its own stores whose greeting jobs commit a result and an
// email effect (to sink, which accepts every one), or fail permanently while fail is
// set. run starts it.
type greetingApp struct {
	c    *onceflow.Client
	rdb  *redis.Client
	db   *pgxpool.Pool
	sink *discard
	fail atomic.Bool
	// flaky is the runs still to fail with a transient error.
	flaky atomic.Int32
}

func newGreetingApp(t *testing.T) *greetingApp {
	t.Helper()
	return newGreetingAppRecording(t, true)
}

// newGreetingAppRecording is newGreetingApp with its workers recording successes in
// the jobs' histories or not (QueueConfig.RecordSuccesses).
func newGreetingAppRecording(t *testing.T, record bool) *greetingApp {
	t.Helper()
	a := &greetingApp{sink: &discard{}}
	var prefix string
	a.rdb, prefix = testenv.Redis(t)
	a.db, _ = testenv.Postgres(t)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[greeting](func(ctx context.Context, job *onceflow.Job[greeting]) error {
		if a.fail.Load() {
			return onceflow.Permanent(errors.New("the greeting service refused the name"))
		}
		if a.flaky.Add(-1) >= 0 {
			return errors.New("the greeting service timed out")
		}
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email.greeting", "greeting:"+job.ID, map[string]string{"to": job.Args.Name})
			c.Result(map[string]string{"greeted": job.Args.Name})
			return nil
		})
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: a.rdb, DB: a.db, Prefix: prefix, Workers: workers, Logger: testenv.Logger(t),
		QueueDefaults: onceflow.QueueConfig{RecordSuccesses: record},
		Senders:       map[string]outbox.Sender{"email.": a.sink}})
	if err != nil {
		t.Fatal(err)
	}
	a.c = c
	return a
}

// run runs the client until the test ends.
func (a *greetingApp) run(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- a.c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-stopped })
}

// discard is a sender that accepts every effect.
type discard struct{ sent atomic.Int64 }

func (d *discard) Send(context.Context, outbox.Message) error { d.sent.Add(1); return nil }

// A job that failed once, was replayed from the UI and then committed a result and an
// effect that was sent: its page shows its failure while it is dead-lettered, then the
// trail of the run that succeeded, in order; the search finds it by its id, its
// effect's dedupe key and its request's idempotency key.
func TestJobTrail(t *testing.T) {
	t.Parallel()
	app := newGreetingApp(t)
	app.fail.Store(true)
	app.run(t)
	c, rdb, sink, fail := app.c, app.rdb, app.sink, &app.fail
	ctx := context.Background()
	res, err := c.Enqueue(ctx, greeting{Name: "ann"}, &onceflow.EnqueueOpts{Key: "greet-ann-0123456789", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	keys := c.QueueKeys(onceflow.DefaultQueue)
	testenv.WaitFor(t, 15*time.Second, "the dead letter", func() bool { return rdb.XLen(ctx, keys.Dead()).Val() == 1 })

	e := serveUI(t, c, rdb, adminui.Config{})
	b := browser(t)
	if code := signIn(t, e, b, adminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := get(t, b, e.url+"/ui/jobs/"+res.JobID)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "dead-lettered") || !strings.Contains(page, "the greeting service refused the name") {
		t.Fatalf("the failed job's page: %d %.3000s", resp.StatusCode, page)
	}
	fail.Store(false)
	_, dl := get(t, b, e.url+"/ui/dead-letters?queue="+onceflow.DefaultQueue)
	id := regexpFind(t, dl, `name="id" value="([0-9]+-[0-9]+)"`)
	resp, _ = post(t, b, e.url+"/ui/dead-letters", url.Values{"csrf": {csrfOf(t, dl)}, "queue": {onceflow.DefaultQueue}, "action": {"replay"}, "id": {id}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatal(resp.StatusCode)
	}
	testenv.WaitFor(t, 15*time.Second, "the effect sent", func() bool { return sink.sent.Load() == 1 })

	_, page = get(t, b, e.url+"/ui/jobs/"+res.JobID)
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
		resp, _ := get(t, b, e.url+"/ui/jobs?"+q)
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/jobs/"+res.JobID {
			t.Errorf("search by %s: %d %q", name, resp.StatusCode, resp.Header.Get("Location"))
		}
	}
	route := onceflow.JobID(idempotency.Scope{Tenant: "acme", Method: http.MethodPost, Path: "/v1/greetings", Key: "k-0123456789abcdef"})
	if resp, _ := get(t, b, e.url+"/ui/jobs?tenant=acme&path=/v1/greetings&key=k-0123456789abcdef"); resp.Header.Get("Location") != "/ui/jobs/"+route {
		t.Fatalf("search by a route's key: %q", resp.Header.Get("Location"))
	}
	if resp, _ := get(t, b, e.url+"/ui/jobs/00000000-0000-4000-8000-000000000999"); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("an unknown job: %d", resp.StatusCode)
	}
}

// Without RecordSuccesses a job's page shows its successful run from the
// acknowledgement, saying how to have its consumer and times.
func TestJobTrailWithoutRecordedSuccesses(t *testing.T) {
	t.Parallel()
	app := newGreetingAppRecording(t, false)
	app.run(t)
	ctx := context.Background()
	res, err := app.c.Enqueue(ctx, greeting{Name: "bo"}, &onceflow.EnqueueOpts{Key: "greet-bo-0123456789", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 15*time.Second, "the effect sent", func() bool { return app.sink.sent.Load() == 1 })
	e := serveUI(t, app.c, app.rdb, adminui.Config{})
	b := browser(t)
	if code := signIn(t, e, b, adminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	testenv.WaitFor(t, 10*time.Second, "the acknowledged run on the page", func() bool {
		_, page := get(t, b, e.url+"/ui/jobs/"+res.JobID)
		return strings.Contains(page, "<strong>run succeeded (acknowledged)</strong>") && strings.Contains(page, "ONCEFLOW_RECORD_SUCCESSES=true") &&
			!strings.Contains(page, "<h2>Deliveries</h2>")
	})
}

func regexpFind(t *testing.T, s, re string) string {
	t.Helper()
	m := regexp.MustCompile(re).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("%s not in %.2000s", re, s)
	}
	return m[1]
}
