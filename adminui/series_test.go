package adminui_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// The overview's chart counts the runs that ended (and those that ended in a dead
// letter) and the jobs accepted between two samples of the queue's counters, which Run
// takes every SampleInterval.
func TestOverviewChartCountsRunsBetweenSamples(t *testing.T) {
	t.Parallel()
	var now atomic.Int64
	now.Store(time.Date(2026, 12, 2, 9, 0, 0, 0, time.UTC).UnixNano())
	clock := func() time.Time { return time.Unix(0, now.Load()) }
	e := adminuitest.New(t, adminui.Config{SampleInterval: time.Second, Now: clock})
	ui, err := adminui.New(adminui.Config{Client: e.Client, AdminKeys: []string{adminuitest.AdminKey}, SampleInterval: time.Second, Now: clock, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ui.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	series := e.Keys.Prefix + ":ui:series:" + adminuitest.Queue
	testenv.WaitFor(t, 10*time.Second, "the first sample", func() bool { return e.Redis.HLen(ctx, series).Val() == 1 })

	adminuitest.DeadLetters(t, e, 1) // one job accepted, run, dead-lettered
	for _, id := range []string{"00000000-0000-4000-8000-0000000000a1", "00000000-0000-4000-8000-0000000000a2"} {
		if _, err := queue.Enqueue(ctx, e.Redis, e.Keys, queue.Message{JobID: id, Tenant: "acme", Kind: "greeting", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	var ran atomic.Int64
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.Redis, Keys: e.Keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { ran.Add(1); return nil })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithCancel(ctx)
	wdone := make(chan struct{})
	go func() { _ = w.Run(wctx); close(wdone) }()
	testenv.WaitFor(t, 10*time.Second, "two runs done", func() bool {
		st, err := queue.ReadStats(ctx, e.Redis, e.Keys, queue.DefaultGroup)
		return ran.Load() == 2 && err == nil && st.Pending == 0
	})
	wcancel()
	<-wdone

	now.Add(int64(time.Second)) // the next sample is a second later
	testenv.WaitFor(t, 10*time.Second, "the second sample", func() bool { return e.Redis.HLen(ctx, series).Val() == 2 })
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/")
	want := "3 runs ended (1 dead-lettered, a failure rate of 33.3 %), 3 jobs accepted"
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, want) || !strings.Contains(page, "<svg") {
		t.Fatalf("overview: want %q in %.4000s", want, page)
	}
}
