package onceflow_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
)

// A workflow brings its queue, its worker and its route; NewClient merges them and
// Mount mounts the route; the caller's own Workers are left as they were.
func TestWorkflowBringsQueuesWorkersAndRoutes(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	rec := &recorder{}
	mine := onceflow.NewWorkers()
	onceflow.AddWorker(mine, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		rec.add("sort " + strings.Join(j.Args.Strings, ","))
		return nil
	}))
	wf := onceflow.Workflow{
		Name:   "mail",
		Queues: map[string]onceflow.QueueConfig{"mail": {Concurrency: 2}},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[emailArgs](func(_ context.Context, j *onceflow.Job[emailArgs]) error {
				rec.add("email " + j.Queue + " " + j.Args.To)
				return nil
			}))
		},
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			mux.HandleFunc("GET /mail/ping", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("pong")) })
			return nil
		},
	}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: mine, Workflows: []onceflow.Workflow{wf},
		Queues: map[string]onceflow.QueueConfig{"default": {}}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(c.Inspector().Queues(), ","); got != "default,mail" {
		t.Fatalf("queues %s, want default,mail", got)
	}
	if got := strings.Join(mine.Kinds(), ","); got != "sort" {
		t.Errorf("the caller's Workers now hold %s, want only sort", got)
	}
	mux := http.NewServeMux()
	if err := c.Mount(mux); err != nil {
		t.Fatal(err)
	}
	rr := httptest.NewRecorder()
	mux.ServeHTTP(rr, httptest.NewRequest("GET", "/mail/ping", nil))
	if rr.Body.String() != "pong" {
		t.Fatalf("mounted route answered %d %q", rr.Code, rr.Body.String())
	}
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, emailArgs{To: "a@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"x"}}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "both jobs", func() bool { return len(rec.all()) == 2 })
	if got := rec.all(); !contains(got, "email mail a@example.com") || !contains(got, "sort x") {
		t.Fatalf("workers saw %q", got)
	}
}

func TestWorkflowConflictsAreErrors(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	addEmail := func(ws *onceflow.Workers) error {
		return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[emailArgs](func(context.Context, *onceflow.Job[emailArgs]) error { return nil }))
	}
	send := outbox.SenderFunc(func(context.Context, outbox.Message) error { return nil })
	for want, wfs := range map[string][]onceflow.Workflow{
		"workflow name":          {{Name: "Bad Name"}},
		"listed twice":           {{Name: "a"}, {Name: "a"}},
		"already":                {{Name: "a", Workers: addEmail}, {Name: "b", Workers: addEmail}},
		"configured differently": {{Name: "a", Queues: map[string]onceflow.QueueConfig{"q": {Concurrency: 1}}}, {Name: "b", Queues: map[string]onceflow.QueueConfig{"q": {Concurrency: 2}}}},
		"already has a sender":   {{Name: "a", Senders: map[string]outbox.Sender{"email.": send}}, {Name: "b", Senders: map[string]outbox.Sender{"email.": send}}},
	} {
		_, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workflows: wfs})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("NewClient of %+v: %v, want an error saying %q", wfs, err, want)
		}
	}
}

// Two workflows in one program: one whose kind runs on the default queue and declares
// no Queues (as docs/first-workflow.md's replies does), one that declares its own
// queue's settings (Workflow.Queues). NewClient merges the Queues into Config.Queues and
// still works the default queue ("DefaultQueue and the queue each of Workers' kinds
// names"): the first workflow's jobs run.
func TestWorkflowQueuesDoNotDropTheDefaultQueue(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var sorted atomic.Int64
	plain := onceflow.Workflow{Name: "plain", Workers: func(ws *onceflow.Workers) error {
		return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error {
			sorted.Add(1)
			return nil
		}))
	}}
	mail := onceflow.Workflow{Name: "mail", Queues: map[string]onceflow.QueueConfig{"mail": {Concurrency: 4}},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[emailArgs](func(context.Context, *onceflow.Job[emailArgs]) error { return nil }))
		}}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t), Workflows: []onceflow.Workflow{plain, mail}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(context.Background(), sortArgs{Strings: []string{"x"}}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("the plain workflow's job to run (the client works queues %v)", c.Inspector().Queues()),
		func() bool { return sorted.Load() > 0 })
	if n := sorted.Load(); n != 1 {
		t.Fatalf("the plain workflow's job ran %d times, want 1", n)
	}
}
