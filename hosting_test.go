package onceflow_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
)

// RunWorkers works only the queues it is given, and sends no effect; RunRelay sends
// them.
func TestRunWorkersAndRunRelaySeparately(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	rec := &recorder{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, j *onceflow.Job[sortArgs]) error {
		rec.add("sort")
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("test.sorted", "sorted:"+j.ID, j.Args)
			return nil
		})
	}))
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(context.Context, *onceflow.Job[emailArgs]) error {
		rec.add("email")
		return nil
	}))
	sent := &recorder{}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Workers: ws,
		Queues:  map[string]onceflow.QueueConfig{"default": {}, "mail": {}},
		Senders: map[string]outbox.Sender{"test.": outbox.SenderFunc(func(_ context.Context, m outbox.Message) error { sent.add(m.DedupeKey); return nil })},
		Logger:  testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := c.RunWorkers(ctx, "default", "nope"); !errors.Is(err, onceflow.ErrUnknownQueue) {
		t.Fatalf("RunWorkers of an unknown queue: %v, want ErrUnknownQueue", err)
	}
	res, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b", "a"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, emailArgs{To: "x@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	wctx, stopWorkers := context.WithCancel(ctx)
	wdone := make(chan error, 1)
	go func() { wdone <- c.RunWorkers(wctx, "default") }()
	waitDone(c, "", res.JobID)
	time.Sleep(300 * time.Millisecond) // a relay, if RunWorkers ran one, would have sent by now
	stopWorkers()
	if err := <-wdone; err != nil {
		t.Fatalf("RunWorkers: %v", err)
	}
	if got := strings.Join(rec.all(), ","); got != "sort" {
		t.Fatalf("RunWorkers(default) ran %q, want only the sort job (mail is not its queue)", got)
	}
	if n := len(sent.all()); n != 0 {
		t.Fatalf("RunWorkers sent %d effects, want 0 (the relay is RunRelay's)", n)
	}
	rctx, stopRelay := context.WithCancel(ctx)
	rdone := make(chan error, 1)
	go func() { rdone <- c.RunRelay(rctx) }()
	testenv.WaitFor(t, 10*time.Second, "the effect sent", func() bool { return len(sent.all()) == 1 })
	stopRelay()
	if err := <-rdone; err != nil {
		t.Fatalf("RunRelay: %v", err)
	}
	if got := sent.all(); got[0] != "sorted:"+res.JobID {
		t.Fatalf("relay sent %q", got)
	}
}

func TestRunRelayNeedsDB(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	if err := c.RunRelay(context.Background()); err == nil || !strings.Contains(err.Error(), "Config.DB") {
		t.Fatalf("RunRelay without DB: %v", err)
	}
}
