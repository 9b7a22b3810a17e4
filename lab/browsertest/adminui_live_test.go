package browsertest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/lab/browsertest"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// A page left open refreshes its numbers without a reload (the script the page loads
// under its Content-Security-Policy): a job dead-lettered after the overview was opened
// shows up in its dead-letter count, and the page was not reloaded.
func TestBrowserOverviewRefreshesLive(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t)
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 1)
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	cell := fmt.Sprintf(`table[data-live="queues"] a[href="/ui/dead-letters?queue=%s"]`, adminuitest.Queue)
	if n := liveText(t, ctx, cell); n != "1" {
		t.Fatalf("dead letters shown: %q", n)
	}
	// A mark on the document: a reload would drop it.
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`window.__notReloaded = true`)); err != nil {
		t.Fatal(err)
	}
	// One more job fails.
	bg := context.Background()
	if _, err := queue.Enqueue(bg, e.Redis, e.Keys, queue.Message{JobID: "late-job-0001", Tenant: "acme", Kind: "greeting", Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.Redis, Keys: e.Keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { return retry.Permanent(io.ErrUnexpectedEOF) })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(bg)
	wdone := make(chan struct{})
	go func() { _ = w.Run(wctx); close(wdone) }()
	testenv.WaitFor(t, 10*time.Second, "the second dead letter", func() bool { return e.Redis.XLen(bg, e.Keys.Dead()).Val() == 2 })
	cancel()
	<-wdone
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := liveText(t, ctx, cell)
		mark, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`window.__notReloaded === true`))
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimSpace(got) == "2" {
			if !mark {
				t.Fatal("the page was reloaded")
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20 s the page still shows %q dead letters", got)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// liveText is the text of the element sel selects, read in the page in one step: a live
// refresh replaces a table's nodes, and a node chromedp looks up in one call may be gone
// by its next ("No node with given id found").
func liveText(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	q, _ := json.Marshal(sel)
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`(document.querySelector(`+string(q)+`) || {}).textContent || ""`))
	if err != nil {
		t.Fatalf("text of %s: %v", sel, err)
	}
	return strings.TrimSpace(s)
}
