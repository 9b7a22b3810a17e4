package adminui_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// TestRenderTimeWithLargeStores is `make bench-ui`: the server-side time of the UI's
// pages with 100,000 jobs in the stores (each with its completion record, its outbox
// row, sent, and its model call in the ledger, and its job index in Redis) and 1,000
// dead letters; 50 requests per page after 5 of warm-up, p50 and p99 of the handler's
// whole time (stores and rendering), measured around the UI's ServeHTTP. It runs only
// with ONCEFLOW_UI_BENCH=1. Knobs: UI_BENCH_JOBS (100000), UI_BENCH_DEAD (1000).
func TestRenderTimeWithLargeStores(t *testing.T) {
	if os.Getenv("ONCEFLOW_UI_BENCH") != "1" {
		t.Skip("set ONCEFLOW_UI_BENCH=1 to measure the UI's render times (make bench-ui)")
	}
	jobs, dead := benchEnvInt(t, "UI_BENCH_JOBS", 100000), benchEnvInt(t, "UI_BENCH_DEAD", 1000)
	ctx := context.Background()
	rdb, prefix := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Logger: slog.New(slog.DiscardHandler),
		Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	// PostgreSQL: what 100,000 finished jobs leave behind.
	for _, st := range []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO job_completions (job_id, kind, tenant, result, queue, completed_at)
		 SELECT 'job-' || i, 'greeting', 'tenant-' || (i % 50), '{"ok": true}', $2, now() - (i || ' seconds')::interval FROM generate_series(1, $1) i`, []any{jobs, adminuitest.Queue}},
		{`INSERT INTO outbox (topic, dedupe_key, payload, attempts, sent_at, created_at)
		 SELECT 'email.greeting', 'greeting:job-' || i, '{"to": "a@example.com"}', 0, now() - (i || ' seconds')::interval, now() - (i || ' seconds')::interval FROM generate_series(1, $1) i`, []any{jobs}},
		{`INSERT INTO llm_calls (idem_key, work, state, request_hash, provider, model, response, attempt, expires_at, created_at, updated_at)
		 SELECT 'llm-' || md5(i::text), 'summarise/job-' || i, 'succeeded', 'h', 'openai', 'gpt-4.1-mini',
		   '{"usage": {"input_tokens": 400, "output_tokens": 60}}', 1, now() + interval '1 day', now() - (i || ' seconds')::interval, now() - (i || ' seconds')::interval
		 FROM generate_series(1, $1) i`, []any{jobs}},
		{`ANALYZE`, nil},
	} {
		if _, err := db.Exec(ctx, st.sql, st.args...); err != nil {
			t.Fatalf("seed: %v", err)
		}
	}
	// Redis: each job's index, as a finished job leaves it.
	keys := c.Inspector().QueueKeys(adminuitest.Queue)
	for i := 1; i <= jobs; i += 1000 {
		pipe := rdb.Pipeline()
		for j := i; j < i+1000 && j <= jobs; j++ {
			k := keys.Job("job-" + strconv.Itoa(j))
			pipe.HSet(ctx, k, "tenant", "tenant-"+strconv.Itoa(j%50), "state", "queued")
			pipe.Expire(ctx, k, time.Hour)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// The dead letters, by a worker that fails them.
	for i := range dead {
		if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: fmt.Sprintf("dead-%05d", i), Tenant: "acme", Kind: "greeting", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { return retry.Permanent(io.ErrUnexpectedEOF) })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	wdone := make(chan struct{})
	go func() { _ = w.Run(wctx); close(wdone) }()
	testenv.WaitFor(t, 5*time.Minute, "the dead letters", func() bool { return rdb.XLen(ctx, keys.Dead()).Val() == int64(dead) })
	cancel()
	<-wdone
	t.Logf("seeded %d jobs and %d dead letters in %v", jobs, dead, time.Since(t0).Round(time.Millisecond))

	ui, err := adminui.New(adminui.Config{Client: c, AdminKeys: []string{adminuitest.AdminKey}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var cur []time.Duration
	mux := http.NewServeMux()
	mux.Handle("/ui/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s := time.Now()
		ui.ServeHTTP(w, r)
		mu.Lock()
		cur = append(cur, time.Since(s))
		mu.Unlock()
	}))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	e := &adminuitest.Env{URL: srv.URL, Redis: rdb, Client: c, Keys: keys}
	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	pages := []struct{ name, path string }{
		{"overview", "/ui/"},
		{"job detail (a finished job)", fmt.Sprintf("/ui/jobs/job-%d", jobs/2+1)},
		{"job detail (a dead-lettered job)", fmt.Sprintf("/ui/jobs/dead-%05d", dead/2)},
		{"dead letters (first page)", "/ui/dead-letters"},
		{"dead letters (filtered)", "/ui/dead-letters?q=dead-0099"},
		{"outbox (failing)", "/ui/outbox"},
		{"model calls", "/ui/calls"},
	}
	report := fmt.Sprintf("UI render times, server-side, %d jobs and %d dead letters, 50 requests per page:\n\n| page | p50 | p99 |\n| --- | ---: | ---: |\n", jobs, dead)
	for _, p := range pages {
		for i := range 55 {
			if i == 5 {
				mu.Lock()
				cur = cur[:0]
				mu.Unlock()
			}
			resp, _ := adminuitest.Get(t, b, srv.URL+p.path)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: %d", p.path, resp.StatusCode)
			}
		}
		mu.Lock()
		d := slices.Clone(cur)
		mu.Unlock()
		slices.Sort(d)
		p50, p99 := d[len(d)/2], d[len(d)*99/100]
		report += fmt.Sprintf("| %s | %.1f ms | %.1f ms |\n", p.name, float64(p50)/1e6, float64(p99)/1e6)
		if p.name == "overview" || p.name == "job detail (a finished job)" {
			if p50 > 100*time.Millisecond {
				t.Errorf("%s: p50 %v, the target is under 100 ms", p.name, p50)
			}
		}
	}
	t.Log("\n" + report)
}

func benchEnvInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q", name, v)
	}
	return n
}
