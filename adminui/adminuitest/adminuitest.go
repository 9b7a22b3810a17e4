// Package adminuitest serves the operator UI (package adminui) against real Redis and
// PostgreSQL for tests: a UI on stores of the test's own, a browser-like HTTP client
// that keeps cookies, sign-in through the login form, and the data the pages show
// (dead letters, outbox rows, a small workflow whose jobs commit an effect).
//
// The stores come from the shared test servers that `make test` starts (see
// docs/testing.md); every helper fails the test on an error and calls t.Helper.
package adminuitest

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// The keys and the queue of an Env: AdminKey opens the UI, TenantKey is a tenant's API
// key (which never does), Queue is the queue New's client declares.
const (
	AdminKey  = "admin-key-0123456789abcdef"
	TenantKey = "tenant-key-0123456789abcdef"
	Queue     = "uiq"
)

// Env is a UI served over HTTP on a client of its own stores.
type Env struct {
	// URL is the server's base URL, without /ui/.
	URL string
	// Redis is the client's Redis, with its keys under the test's own prefix.
	Redis *redis.Client
	// Client is the onceflow client the UI reads.
	Client *onceflow.Client
	// Keys are Queue's keys.
	Keys queue.Keys
}

// New serves a UI with cfg on a new client of a per-test Redis prefix and PostgreSQL
// schema that declares Queue.
func New(t testing.TB, cfg adminui.Config) *Env {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	return Serve(t, c, rdb, cfg)
}

// Serve serves a UI of c (another process of the same deployment, when c is shared)
// until the test ends. cfg.AdminKeys defaults to AdminKey, cfg.Logger to the test's log.
func Serve(t testing.TB, c *onceflow.Client, rdb *redis.Client, cfg adminui.Config) *Env {
	t.Helper()
	cfg.Client = c
	if cfg.AdminKeys == nil {
		cfg.AdminKeys = []string{AdminKey}
	}
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	ui, err := adminui.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ui/", ui)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &Env{URL: srv.URL, Redis: rdb, Client: c, Keys: c.Inspector().QueueKeys(Queue)}
}

// Browser returns a cookie-keeping client that does not follow redirects.
func Browser(t testing.TB) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// Get gets u with c and returns the response and its body.
func Get(t testing.TB, c *http.Client, u string) (*http.Response, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	return resp, readBody(t, resp)
}

// Post posts form to u with c, with header's name/value pairs set, and returns the
// response and its body.
func Post(t testing.TB, c *http.Client, u string, form url.Values, header ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp, readBody(t, resp)
}

func readBody(t testing.TB, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// CSRF returns the CSRF token of a page's form.
func CSRF(t testing.TB, html string) string {
	t.Helper()
	return Find(t, html, csrfRE.String())
}

// Find returns the first submatch of re in s.
func Find(t testing.TB, s, re string) string {
	t.Helper()
	m := regexp.MustCompile(re).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("%s not in %.2000s", re, s)
	}
	return m[1]
}

// SignIn signs c in with key through the login form and returns the status of the
// sign-in POST (303 when the key opens the UI).
func SignIn(t testing.TB, e *Env, c *http.Client, key string) int {
	t.Helper()
	_, form := Get(t, c, e.URL+"/ui/login")
	resp, _ := Post(t, c, e.URL+"/ui/login", url.Values{"csrf": {CSRF(t, form)}, "key": {key}})
	return resp.StatusCode
}

// DeadLetters enqueues n greeting jobs of tenant acme on e's queue, with job ids
// 00000000-0000-4000-8000-00000000000N, and dead-letters them through a worker that
// fails each permanently; it returns the job ids.
func DeadLetters(t testing.TB, e *Env, n int) []string {
	t.Helper()
	ctx := context.Background()
	var jobs []string
	for i := range n {
		id := "00000000-0000-4000-8000-" + strings.Repeat("0", 12-len(strconv.Itoa(i+1))) + strconv.Itoa(i+1)
		if _, err := queue.Enqueue(ctx, e.Redis, e.Keys, queue.Message{JobID: id, Tenant: "acme", Kind: "greeting", Payload: json.RawMessage(`{"name":"x"}`)}); err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, id)
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.Redis, Keys: e.Keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { return onceflow.Permanent(io.ErrUnexpectedEOF) })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = w.Run(wctx); close(done) }()
	testenv.WaitFor(t, 10*time.Second, "dead letters", func() bool { return e.Redis.XLen(ctx, e.Keys.Dead()).Val() == int64(n) })
	cancel()
	<-done
	return jobs
}

// OutboxRows writes n outbox rows to db and has the relay's store give up on the first
// exhausted of them (a permanent failure) and fail the next once (retried in an hour);
// the rest are sent. It returns the rows' ids in order.
func OutboxRows(t testing.TB, db *pgxpool.Pool, n, exhausted int) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	for i := range n {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		id, err := pgoutbox.Insert(ctx, tx, outbox.Message{Topic: "email.summary_ready", DedupeKey: "ui-test-" + strconv.Itoa(i), Payload: []byte(`{"to":"a@example.com"}`)})
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	st := pgoutbox.New(db)
	claimed, err := st.Claim(ctx, "ui-test", n, time.Minute)
	if err != nil || len(claimed) != n {
		t.Fatalf("claim: %d %v", len(claimed), err)
	}
	var s outbox.Settlement
	for i, id := range ids {
		switch {
		case i < exhausted:
			s.Failed = append(s.Failed, outbox.Failure{ID: id, Error: "550 mailbox unavailable", Exhaust: true})
		case i == exhausted:
			s.Failed = append(s.Failed, outbox.Failure{ID: id, Error: "connection reset", Delay: time.Hour})
		default:
			s.Sent = append(s.Sent, id)
		}
	}
	if _, err := st.Settle(ctx, "ui-test", s); err != nil {
		t.Fatal(err)
	}
	return ids
}

// Greeting is the job kind of a GreetingApp.
type Greeting struct {
	Name string `json:"name"`
}

// Kind is "greeting".
func (Greeting) Kind() string { return "greeting" }

// GreetingApp is a client of its own stores whose greeting jobs commit a result and an
// email effect (to Sink, which accepts every one), fail permanently while Fail is set,
// and fail with a transient error while Flaky is above zero (counting it down).
type GreetingApp struct {
	Client *onceflow.Client
	Redis  *redis.Client
	DB     *pgxpool.Pool
	Sink   *Discard
	Fail   atomic.Bool
	Flaky  atomic.Int32
}

// NewGreetingApp returns a GreetingApp whose workers record successes in the jobs'
// histories when record is set (QueueConfig.RecordSuccesses).
func NewGreetingApp(t testing.TB, record bool) *GreetingApp {
	t.Helper()
	a := &GreetingApp{Sink: &Discard{}}
	var prefix string
	a.Redis, prefix = testenv.Redis(t)
	a.DB, _ = testenv.Postgres(t)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Greeting](func(ctx context.Context, job *onceflow.Job[Greeting]) error {
		if a.Fail.Load() {
			return onceflow.Permanent(errors.New("the greeting service refused the name"))
		}
		if a.Flaky.Add(-1) >= 0 {
			return errors.New("the greeting service timed out")
		}
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email.greeting", "greeting:"+job.ID, map[string]string{"to": job.Args.Name})
			c.Result(map[string]string{"greeted": job.Args.Name})
			return nil
		})
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: a.Redis, DB: a.DB, Prefix: prefix, Workers: workers, Logger: testenv.Logger(t),
		QueueDefaults: onceflow.QueueConfig{RecordSuccesses: record},
		Senders:       map[string]outbox.Sender{"email.": a.Sink}})
	if err != nil {
		t.Fatal(err)
	}
	a.Client = c
	return a
}

// Run runs the app's client (workers and relay) until the test ends.
func (a *GreetingApp) Run(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- a.Client.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-stopped })
}

// Discard is an outbox sender that accepts every effect and counts them.
type Discard struct{ sent atomic.Int64 }

// Send counts m as sent.
func (d *Discard) Send(context.Context, outbox.Message) error { d.sent.Add(1); return nil }

// Sent returns how many effects were sent.
func (d *Discard) Sent() int64 { return d.sent.Load() }
