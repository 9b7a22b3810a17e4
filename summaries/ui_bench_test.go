package summaries_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/summaries"
)

// BenchmarkPipelineWithUI measures what the operator UI costs the pipeline while pages
// are open and live: BenchmarkPipeline's service configuration (the ledger on), alone
// and with an operator UI on the same stores, its sampler running and two tabs open
// (the overview and the dead letters), each refreshing every 5 seconds as the page's
// script does; the two alternate over ONCEFLOW_BENCH_UI_ROUNDS rounds (default 3).
// The UI has its own Redis and PostgreSQL connections, as a serve process beside the
// workers would, so the per-job round trips counted are the pipeline's alone.
//
//	go test -run '^$' -bench BenchmarkPipelineWithUI -benchtime 1x ./summaries/
func BenchmarkPipelineWithUI(b *testing.B) {
	jobs := benchEnvInt(b, "ONCEFLOW_BENCH_JOBS", 20000)
	clients := benchEnvInt(b, "ONCEFLOW_BENCH_CONCURRENCY", 64)
	workers := benchEnvInt(b, "ONCEFLOW_WORKER_CONCURRENCY", 64)
	rounds := benchEnvInt(b, "ONCEFLOW_BENCH_UI_ROUNDS", 3)
	var plain, withUI []float64
	for i := range rounds {
		order := []bool{false, true}
		if i%2 == 1 {
			order = []bool{true, false}
		}
		for _, ui := range order {
			b.Run(fmt.Sprintf("round=%d/ui=%v", i+1, ui), func(b *testing.B) {
				r := runPipeline(b, jobs, clients, workers, true, ui)
				b.ReportMetric(r.jobsPerSec, "jobs/s")
				b.ReportMetric(r.redisAPI, "redis-api-rt/job")
				b.ReportMetric(r.redisWorker, "redis-worker-rt/job")
				b.ReportMetric(r.pgRoundTrips, "pg-rt/job")
				if ui {
					withUI = append(withUI, r.jobsPerSec)
				} else {
					plain = append(plain, r.jobsPerSec)
				}
			})
		}
	}
	if len(plain) == rounds && len(withUI) == rounds {
		mp, mu := medianOf(plain), medianOf(withUI)
		b.Logf("pipeline jobs/s, %d rounds alternating: without the UI %v (median %.0f), with the UI open and live %v (median %.0f): ratio %.3f",
			rounds, plain, mp, withUI, mu, mu/mp)
	}
}

func medianOf(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// openUI starts an operator UI on the pipeline's stores (prefix, dsn) with its sampler,
// signs in, and keeps two pages refreshing every 5 seconds until the returned func is
// called, which logs the requests served.
func openUI(b *testing.B, prefix, dsn string) (stop func()) {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	rdb, err := connect.Redis(testenv.RedisURL(b))
	if err != nil {
		b.Fatal(err)
	}
	pool, err := connect.Postgres(ctx, dsn, nil)
	if err != nil {
		b.Fatal(err)
	}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: slog.New(slog.DiscardHandler),
		Queues: map[string]onceflow.QueueConfig{summaries.QueueName: {}}})
	if err != nil {
		b.Fatal(err)
	}
	const key = "bench-admin-key-0123456789"
	ui, err := adminui.New(adminui.Config{Client: c, AdminKeys: []string{key}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ui/", ui)
	srv := httptest.NewServer(mux)
	var wg sync.WaitGroup
	wg.Go(func() { _ = ui.Run(ctx) })
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar}
	resp, err := hc.Get(srv.URL + "/ui/login")
	if err != nil {
		b.Fatal(err)
	}
	form, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindSubmatch(form)
	if m == nil {
		b.Fatal("no sign-in form")
	}
	resp, err = hc.PostForm(srv.URL+"/ui/login", url.Values{"csrf": {string(m[1])}, "key": {key}})
	if err != nil || resp.StatusCode != http.StatusOK {
		b.Fatalf("sign in: %v %v", resp, err)
	}
	resp.Body.Close()
	var served atomic.Int64
	for _, page := range []string{"/ui/", "/ui/dead-letters"} {
		wg.Go(func() {
			t := time.NewTicker(5 * time.Second)
			defer t.Stop()
			for {
				if resp, err := hc.Get(srv.URL + page); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK && !strings.Contains(resp.Request.URL.Path, "login") {
						served.Add(1)
					}
				}
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		})
	}
	return func() {
		cancel()
		wg.Wait()
		srv.Close()
		pool.Close()
		_ = rdb.Close()
		b.Logf("the UI served %d page refreshes during the run", served.Load())
	}
}
