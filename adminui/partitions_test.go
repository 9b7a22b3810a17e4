package adminui_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// A UI of a queue of 3 partitions: a dead letter of partition 2 is on the page of
// queue "uiq:2" (not on uiq's), is replayed into partition 2's stream, its job page
// answers and names uiq:2; names of partitions that do not exist ("uiq:9", "uiq:02",
// "uiq:-1", "uiq:") are 404.
func TestPartitionPages(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {Partitions: 3}}})
	if err != nil {
		t.Fatal(err)
	}
	e := adminuitest.Serve(t, c, rdb, adminui.Config{})
	ctx := context.Background()
	keys := c.Inspector().QueueKeys(adminuitest.Queue).InPartition(2)
	const id = "00000000-0000-4000-8000-000000000042"
	if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: id, Tenant: "acme", Kind: "greeting", Payload: json.RawMessage(`{"name":"x"}`)}); err != nil {
		t.Fatal(err)
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { return retry.Permanent(io.ErrUnexpectedEOF) })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = w.Run(wctx); close(done) }()
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return rdb.XLen(ctx, keys.Dead()).Val() == 1 })
	cancel()
	<-done

	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	if _, page := adminuitest.Get(t, b, e.URL+"/ui/dead-letters?queue="+adminuitest.Queue); strings.Contains(page, id) {
		t.Fatal("partition 2's dead letter is on partition 0's page")
	}
	resp, page := adminuitest.Get(t, b, e.URL+"/ui/dead-letters?queue="+adminuitest.Queue+":2")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, id) {
		t.Fatalf("partition 2's page: %d, job listed %v", resp.StatusCode, strings.Contains(page, id))
	}
	for _, bad := range []string{":9", ":02", ":-1", ":", ":2:2"} {
		if resp, _ := adminuitest.Get(t, b, e.URL+"/ui/dead-letters?queue="+url.QueryEscape(adminuitest.Queue+bad)); resp.StatusCode != http.StatusNotFound {
			t.Errorf("queue %s%s: %d, want 404", adminuitest.Queue, bad, resp.StatusCode)
		}
	}
	if resp, page := adminuitest.Get(t, b, e.URL+"/ui/jobs/"+id); resp.StatusCode != http.StatusOK || !strings.Contains(page, adminuitest.Queue+":2") {
		t.Fatalf("job page of a job in partition 2: %d, names %s:2: %v", resp.StatusCode, adminuitest.Queue, strings.Contains(page, adminuitest.Queue+":2"))
	}
	dl, _, _ := queue.ListDead(ctx, rdb, keys, "", 10)
	resp, _ = adminuitest.Post(t, b, e.URL+"/ui/dead-letters", url.Values{"csrf": {adminuitest.CSRF(t, page)}, "queue": {adminuitest.Queue + ":2"}, "action": {"replay"}, "id": {dl[0].ID}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("replay: %d", resp.StatusCode)
	}
	if _, state, _, err := queue.JobState(ctx, rdb, keys, id); err != nil || state != queue.StateQueued || rdb.XLen(ctx, c.Inspector().QueueKeys(adminuitest.Queue).Stream()).Val() != 0 {
		t.Fatalf("after the replay: state %q in partition 2 (%v), %d entries in partition 0", state, err, rdb.XLen(ctx, c.Inspector().QueueKeys(adminuitest.Queue).Stream()).Val())
	}
	if st, err := c.JobState(ctx, "acme", id); err != nil || st.Status != onceflow.StatusQueued {
		t.Fatalf("JobState after the replay: %+v, %v", st, err)
	}
}
