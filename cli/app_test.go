package cli_test

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

//go:embed testdata/notes/*.sql
var notesSQL embed.FS

// Note is the test workflow's job kind: keep a note, and announce it.
type Note struct {
	Body string `json:"body"`
}

func (Note) Kind() string { return "test.note" }

// EnqueueOpts puts notes on the workflow's queue.
func (Note) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "notes"} }

// notesWorkflow is a workflow of the test kind on its own queue, "notes": a route, a
// worker that commits its row and one effect, its table and its audit (every note has
// its effect).
func notesWorkflow(h cli.Host) onceflow.Workflow {
	return onceflow.Workflow{
		Name:       "notes",
		Senders:    notesSenders,
		Queues:     map[string]onceflow.QueueConfig{"notes": {}},
		Migrations: &migrations.Source{FS: notesSQL, Dir: "testdata/notes", Table: "notes_migrations"},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Note](func(ctx context.Context, j *onceflow.Job[Note]) error {
				return j.Commit(ctx, func(c *onceflow.Commit) error {
					c.Exec(`INSERT INTO notes (job_id, tenant, body) VALUES ($1, $2, $3)`, j.ID, j.Tenant, j.Args.Body)
					c.Emit("test.noted", "noted:"+j.ID, j.Args)
					return nil
				})
			}))
		},
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			route, err := onceflow.Route(c, onceflow.RouteConfig[Note]{Tenant: h.Tenant})
			mux.Handle("POST /v1/notes", route)
			return err
		},
		Audit: func(ctx context.Context, c *onceflow.Client) (*onceflow.AuditReport, error) {
			r := &onceflow.AuditReport{Checked: []string{"notes"}, Counts: map[string]int64{}}
			var notes, orphans int64
			err := c.Inspector().DB().QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE o.id IS NULL)
				FROM notes n LEFT JOIN outbox o ON o.dedupe_key = 'noted:' || n.job_id`).Scan(&notes, &orphans)
			if err != nil {
				return nil, err
			}
			r.Counts["notes"] = notes
			if orphans > 0 {
				r.Violations = append(r.Violations, fmt.Sprintf("%d notes without their test.noted effect", orphans))
			}
			return r, nil
		},
	}
}

// notesSenders are the notes workflow's senders: none, unless a test sets them before
// it runs a command.
var notesSenders map[string]outbox.Sender

// notesApp hosts the notes workflow and one without queues, routes or audit.
var notesApp = cli.App{Name: "notesd", Workflows: func(h cli.Host) ([]onceflow.Workflow, error) {
	return []onceflow.Workflow{notesWorkflow(h), {Name: "quiet"}}, nil
}}

// hostEnv is the environment of the hosting tests: the test Redis under a prefix of
// their own, an empty schema, one API key.
func hostEnv(t *testing.T) (getenv func(string) string, addr string) {
	t.Helper()
	_, prefix := testenv.Redis(t)
	addr = fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	vars := map[string]string{
		"ONCEFLOW_REDIS_URL":    testenv.RedisURL(t),
		"ONCEFLOW_DATABASE_URL": testenv.EmptySchema(t),
		"ONCEFLOW_PREFIX":       prefix,
		"ONCEFLOW_API_KEYS":     "acme:key-acme-0123456789",
		"ONCEFLOW_HTTP_ADDR":    addr,
		"ONCEFLOW_LOG_FORMAT":   "text",
	}
	return func(k string) string { return vars[k] }, addr
}

// run runs one command of notesApp to its end and returns its output and exit status.
func run(t *testing.T, getenv func(string) string, args ...string) (string, int) {
	t.Helper()
	var out, errs bytes.Buffer
	err := cli.Run(context.Background(), notesApp, args, &out, &errs, getenv)
	if err != nil {
		t.Logf("%s: %v\nstderr: %s", strings.Join(args, " "), err, errs.String())
	}
	return out.String(), cli.ExitCode(err)
}

// start runs a long-running command of notesApp until the test stops it.
func start(t *testing.T, getenv func(string) string, args ...string) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var errs testenv.SyncBuffer
	go func() { done <- cli.Run(ctx, notesApp, args, &bytes.Buffer{}, &errs, getenv) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// A program's own workflow hosted by cli.Run: migrate creates its table, serve mounts
// its route, work --queue runs its worker (once per job however often it is posted),
// relay sends nothing it has no sender for, and audit reports onceflow's checks and the
// workflow's, what each read, and a planted violation (exit 4).
func TestRunHostsAWorkflow(t *testing.T) {
	getenv, addr := hostEnv(t)
	ctx := context.Background()
	if out, code := run(t, getenv, "migrate"); code != 0 {
		t.Fatalf("migrate: exit %d: %s", code, out)
	}

	stopServe := start(t, getenv, "serve")
	post := func(key string) int {
		req, _ := http.NewRequest("POST", "http://"+addr+"/v1/notes", strings.NewReader(`{"body":"hello"}`))
		req.Header.Set("Authorization", "Bearer key-acme-0123456789")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	testenv.WaitFor(t, 10*time.Second, "serve accepting", func() bool { return post("note-key-000000001") == http.StatusAccepted })
	if code := post("note-key-000000001"); code != http.StatusAccepted {
		t.Fatalf("the same key again: %d, want the stored 202", code)
	}
	if code := post("note-key-000000002"); code != http.StatusAccepted {
		t.Fatalf("a second note: %d", code)
	}
	resp, err := http.Get("http://" + addr + "/v1/nothing")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("an unrouted path: %d %s, want a JSON 404", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if err := stopServe(); err != nil {
		t.Fatalf("serve: %v", err)
	}

	if _, code := run(t, getenv, "work", "--queue", "summaries"); code != 2 {
		t.Fatalf("work --queue of a queue the program does not have: exit %d, want 2", code)
	}
	pool, err := onceflow.NewPostgres(ctx, getenv("ONCEFLOW_DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	count := func(sql string) int64 {
		var n int64
		if err := pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	stopWork := start(t, getenv, "work", "--queue", "notes")
	testenv.WaitFor(t, 20*time.Second, "both notes", func() bool { return count(`SELECT count(*) FROM notes`) == 2 })
	if err := stopWork(); err != nil {
		t.Fatalf("work: %v", err)
	}
	if n := count(`SELECT count(*) FROM outbox WHERE topic = 'test.noted' AND sent_at IS NULL`); n != 2 {
		t.Fatalf("%d unsent test.noted effects, want 2 (one per note; work runs no relay)", n)
	}

	out, code := run(t, getenv, "audit")
	t.Logf("audit:\n%s", out)
	if code != 0 {
		t.Fatalf("audit: exit %d:\n%s", code, out)
	}
	for _, want := range []string{
		"onceflow (every kind and queue): checked queue notes, job_completions, outbox",
		"job_completions test.note  2",
		"workflow notes: checked notes",
		"invariants: all hold for notes",
		"workflow quiet: checked nothing",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("audit output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "quiet: checked nothing") && strings.Count(out, "all hold") != 2 {
		t.Errorf("audit says all hold %d times, want 2 (onceflow's and notes', not quiet's):\n%s", strings.Count(out, "all hold"), out)
	}

	// Plant a violation: a note's effect is gone.
	if _, err := pool.Exec(ctx, `DELETE FROM outbox WHERE id = (SELECT min(id) FROM outbox)`); err != nil {
		t.Fatal(err)
	}
	out, code = run(t, getenv, "audit")
	if code != 4 || !strings.Contains(out, "VIOLATION: 1 notes without their test.noted effect") {
		t.Fatalf("audit of a note without its effect: exit %d, want 4:\n%s", code, out)
	}
	out, code = run(t, getenv, "audit", "--json")
	if code != 4 || !strings.Contains(out, `"workflow": "notes"`) {
		t.Fatalf("audit --json: exit %d:\n%s", code, out)
	}

	out, code = run(t, getenv, "dlq", "list")
	if code != 0 || !strings.Contains(out, "no dead letters") {
		t.Fatalf("dlq list (the program's only queue): exit %d: %s", code, out)
	}
	out, code = run(t, getenv, "outbox", "list", "--topic", "test.")
	if code != 0 || strings.Count(out, "test.noted") != 1 {
		t.Fatalf("outbox list --topic test.: exit %d, want the one remaining row:\n%s", code, out)
	}
	if out, code := run(t, getenv, "outbox", "list", "--topic", "email."); code != 0 || strings.Contains(out, "test.noted") {
		t.Fatalf("outbox list --topic email.: exit %d:\n%s", code, out)
	}
}

// run hosts the whole workflow in one process: the route accepts, the worker commits, the
// relay sends the effect with the workflow's sender, once per note.
func TestRunCommandServesWorksAndRelays(t *testing.T) {
	getenv, addr := hostEnv(t)
	var mu sync.Mutex
	sent := map[string]int{}
	notesSenders = map[string]outbox.Sender{"test.noted": outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
		mu.Lock()
		sent[m.DedupeKey]++
		mu.Unlock()
		return nil
	})}
	t.Cleanup(func() { notesSenders = nil })
	if out, code := run(t, getenv, "migrate"); code != 0 {
		t.Fatalf("migrate: exit %d: %s", code, out)
	}
	stop := start(t, getenv, "run", "--queue", "notes")
	post := func(key string) int {
		req, _ := http.NewRequest("POST", "http://"+addr+"/v1/notes", strings.NewReader(`{"body":"hi"}`))
		req.Header.Set("Authorization", "Bearer key-acme-0123456789")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	testenv.WaitFor(t, 10*time.Second, "run accepting", func() bool { return post("run-note-00000001") == http.StatusAccepted })
	for range 3 {
		if code := post("run-note-00000001"); code != http.StatusAccepted {
			t.Fatalf("a retried POST: %d", code)
		}
	}
	total := func() (keys, sends int) {
		mu.Lock()
		defer mu.Unlock()
		for _, n := range sent {
			keys, sends = keys+1, sends+n
		}
		return keys, sends
	}
	testenv.WaitFor(t, 20*time.Second, "the effect sent", func() bool { k, _ := total(); return k == 1 })
	time.Sleep(500 * time.Millisecond) // a second send, if any, would come by now
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if keys, sends := total(); keys != 1 || sends != 1 {
		t.Fatalf("%d effects sent %d times, want one, once (four POSTs of one key)", keys, sends)
	}
}

// Host gives the workflows what the command read from the environment.
func TestHostGivesTheWorkflowsTheEnvironment(t *testing.T) {
	var got *cli.Host
	app := cli.App{Workflows: func(h cli.Host) ([]onceflow.Workflow, error) {
		got = &h
		return []onceflow.Workflow{{Name: "w", Queues: map[string]onceflow.QueueConfig{"w": {}}}}, nil
	}}
	env := map[string]string{
		"ONCEFLOW_REDIS_URL": "redis://localhost:6379/0", "ONCEFLOW_DATABASE_URL": "postgres://localhost/app",
		"ONCEFLOW_API_KEYS": "acme:key-acme-0123456789", "ONCEFLOW_PREFIX": "hostenv", "MY_SETTING": "42",
	}
	var stderr bytes.Buffer
	err := cli.Run(context.Background(), app, []string{"work", "--queue", "other"}, io.Discard, &stderr, func(k string) string { return env[k] })
	if cli.ExitCode(err) != 2 || !strings.Contains(stderr.String(), `onceflow: --queue "other": no such queue; this program's queues: w`) {
		t.Fatalf("work --queue other: exit %d, stderr %q", cli.ExitCode(err), stderr.String())
	}
	if got == nil {
		t.Fatal("App.Workflows was not called")
	}
	if got.Config.Prefix != "hostenv" || got.Getenv("MY_SETTING") != "42" || got.Logger == nil {
		t.Fatalf("host: prefix %q, MY_SETTING %q, logger %v", got.Config.Prefix, got.Getenv("MY_SETTING"), got.Logger)
	}
	r := httptest.NewRequest("POST", "/v1/x", nil)
	if _, err := got.Tenant(r); !errors.Is(err, idempotency.ErrUnauthenticated) {
		t.Fatalf("Tenant without a key: %v, want ErrUnauthenticated", err)
	}
	r.Header.Set("Authorization", "Bearer key-acme-0123456789")
	if tenant, err := got.Tenant(r); tenant != "acme" || err != nil {
		t.Fatalf("Tenant with acme's key: %q %v", tenant, err)
	}
	if s, err := got.Sender(); s == nil || err != nil {
		t.Fatalf("Sender (ONCEFLOW_SENDER's default): %v %v", s, err)
	}
	if got.Registerer == nil || got.RouteStatuses == nil {
		t.Fatalf("host of work: Registerer %v, RouteStatuses set %v", got.Registerer, got.RouteStatuses != nil)
	}
	got.RouteStatuses("POST /v1/x", 202) // declared: serve's /metrics would show it at zero
	rec := httptest.NewRecorder()
	got.Unauthorized.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/x", nil))
	if rec.Code != 401 || rec.Header().Get("WWW-Authenticate") != `Bearer realm="onceflow"` ||
		rec.Body.String() != `{"detail":"missing or unknown API key (Authorization: Bearer KEY)"}`+"\n" {
		t.Fatalf("Unauthorized: %d %v %q, want the command's 401", rec.Code, rec.Header(), rec.Body)
	}
}

// cli.App{} hosts no workflows (the onceflow binary's summaries service is
// package service's): the commands that host workflows exit 2 saying so, before
// touching a store, and dlq needs --queue.
func TestAppWithoutWorkflowsHostsNothing(t *testing.T) {
	env := map[string]string{
		"ONCEFLOW_REDIS_URL": "redis://127.0.0.1:1/0", "ONCEFLOW_DATABASE_URL": "postgres://127.0.0.1:1/app",
		"ONCEFLOW_API_KEYS": "acme:key-acme-0123456789", "ONCEFLOW_HTTP_ADDR": "127.0.0.1:0",
	}
	for _, args := range [][]string{{"serve"}, {"work"}, {"relay"}, {"run"}, {"audit"}, {"dlq", "list"}} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var stderr bytes.Buffer
		err := cli.Run(ctx, cli.App{}, args, io.Discard, &stderr, func(k string) string { return env[k] })
		cancel()
		want := "onceflow: this program hosts no workflows"
		if args[0] == "dlq" {
			want = "give --queue"
		}
		if cli.ExitCode(err) != 2 || !strings.Contains(stderr.String(), want) {
			t.Errorf("%v: exit %d, stderr %q, want 2 and %q", args, cli.ExitCode(err), stderr.String(), want)
		}
	}
}

// serve refuses to start without API keys when a workflow has routes (they authenticate
// with Host.Tenant).
func TestServeOfRoutesNeedsAPIKeys(t *testing.T) {
	env := map[string]string{"ONCEFLOW_REDIS_URL": "redis://localhost:6379/0", "ONCEFLOW_DATABASE_URL": "postgres://localhost/app"}
	var stderr bytes.Buffer
	err := cli.Run(context.Background(), notesApp, []string{"serve"}, io.Discard, &stderr, func(k string) string { return env[k] })
	if cli.ExitCode(err) != 2 || !strings.Contains(stderr.String(), "ONCEFLOW_API_KEYS") {
		t.Fatalf("serve without keys: exit %d, stderr %q", cli.ExitCode(err), stderr.String())
	}
}
