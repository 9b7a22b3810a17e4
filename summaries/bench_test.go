package summaries_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/outbox/webhook"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// BenchmarkPipeline measures the pipeline end to end, in durable jobs per second: POST
// /v1/summaries accepted, the summary and its outbox row committed, the email delivered
// to a webhook sink that answers at once. The model is llm/fake in process (no latency).
// Beside it, in the same run, pgbench runs the handler's summary+outbox statement alone
// against a scratch schema of the same PostgreSQL: the ceiling of durable commits per
// second, since every job needs one. It also counts what a job costs: PostgreSQL round
// trips and commits, and Redis round trips of the API and of the worker.
//
//	go test -run '^$' -bench BenchmarkPipeline -benchtime 1x ./summaries/
//
// Knobs (environment): ONCEFLOW_BENCH_JOBS (default 20000), ONCEFLOW_BENCH_CONCURRENCY
// (HTTP clients, default 64), ONCEFLOW_BENCH_PGBENCH_CLIENTS (default 32, the pipeline's
// pool size), ONCEFLOW_BENCH_PGBENCH_TIME (default 10s), ONCEFLOW_WORKER_CONCURRENCY
// (default 64), ONCEFLOW_BENCH_LIMITER (off: the model calls without the limiter),
// ONCEFLOW_BENCH_ROUNDS (default 1: how many times the three configurations run, one
// after the other in turn, so that a ratio between them is taken from neighbouring runs
// rather than from runs minutes apart, as -count would place them).
// Everything runs on one machine: the Go process (clients, API, worker,
// relay, sink), Redis and PostgreSQL share its cores.
func BenchmarkPipeline(b *testing.B) {
	jobs := benchEnvInt(b, "ONCEFLOW_BENCH_JOBS", 20000)
	clients := benchEnvInt(b, "ONCEFLOW_BENCH_CONCURRENCY", 64)
	pgClients := benchEnvInt(b, "ONCEFLOW_BENCH_PGBENCH_CLIENTS", 32)
	pgTime := benchEnvInt(b, "ONCEFLOW_BENCH_PGBENCH_TIME", 10)
	workers := benchEnvInt(b, "ONCEFLOW_WORKER_CONCURRENCY", queue.DefaultConcurrency)

	ceiling := pgbenchCeiling(b, pgClients, pgTime)
	// The configurations in the same run: the handler without the ledger; with it as it
	// was before group commit (every ledger write commits alone, the answer durably in a
	// commit of its own); and the service's default, whose ledger writes share group
	// transactions and whose answer the job's Commit records in its transaction.
	rounds := benchEnvInt(b, "ONCEFLOW_BENCH_ROUNDS", 1)
	for range rounds {
		for _, mode := range []string{"off", "each-write-alone", "on"} {
			pipelineMode(b, mode, jobs, clients, workers, ceiling, pgClients, pgTime)
		}
	}
}

// pipelineMode runs BenchmarkPipeline's configuration mode as a sub-benchmark.
func pipelineMode(b *testing.B, mode string, jobs, clients, workers int, ceiling float64, pgClients, pgTime int) {
	b.Run("ledger="+mode, func(b *testing.B) {
		r := runPipeline(b, jobs, clients, workers, mode, false)
		b.ReportMetric(ceiling, "pgbench-tps")
		b.ReportMetric(r.jobsPerSec, "jobs/s")
		b.ReportMetric(r.acceptPerSec, "accepted/s")
		b.ReportMetric(r.jobsPerSec/ceiling, "jobs/pgbench")
		b.ReportMetric(r.pgCommits, "pg-commits/job")
		b.ReportMetric(r.pgRelaxed, "pg-relaxed-commits/job")
		b.ReportMetric(r.pgRoundTrips, "pg-rt/job")
		b.ReportMetric(r.redisAPI, "redis-api-rt/job")
		b.ReportMetric(r.redisWorker, "redis-worker-rt/job")
		b.Logf("ledger %s: pgbench ceiling %.0f tps (%d clients, %ds); pipeline %d jobs: %.0f accepted/s, %.0f jobs/s end to end (%.2f of the ceiling); per job: %.3f durable PostgreSQL commits (%.3f without a flush), %.3f PostgreSQL round trips, %.3f Redis round trips at the API, %.3f at the worker",
			mode, ceiling, pgClients, pgTime, jobs, r.acceptPerSec, r.jobsPerSec, r.jobsPerSec/ceiling, r.pgCommits, r.pgRelaxed, r.pgRoundTrips, r.redisAPI, r.redisWorker)
	})
}

// pipelineResult is one measured run.
type pipelineResult struct {
	jobsPerSec, acceptPerSec                                  float64
	pgCommits, pgRelaxed, pgRoundTrips, redisAPI, redisWorker float64
}

// runPipeline runs jobs through the pipeline; ledger is "off" (no ledger),
// "each-write-alone" (the ledger without group commit, answers durable on their own) or
// "on" (the service's default).
func runPipeline(b *testing.B, jobs, clients, workers int, ledgerMode string, withUI bool) pipelineResult {
	b.Helper()
	ctx := context.Background()
	quiet := slog.New(slog.DiscardHandler)
	_, prefix := testenv.Redis(b)
	_, dsn := testenv.Postgres(b)
	var pg roundtrip.Commits // durable commits, and those that set synchronous_commit off
	pool, err := connect.Postgres(ctx, dsn, &pg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	var syncCommit string
	if err := pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&syncCommit); err != nil || syncCommit != "on" {
		b.Fatalf("synchronous_commit is %q (%v): the figures would not be durable commits", syncCommit, err)
	}
	redisClient := func(rt *roundtrip.Counter) *redis.Client {
		c, err := connect.Redis(testenv.RedisURL(b) + "?pool_size=" + strconv.Itoa(clients+workers))
		if err != nil {
			b.Fatal(err)
		}
		c.AddHook(rt)
		b.Cleanup(func() { c.Close() })
		return c
	}
	var apiRT, workerRT roundtrip.Counter
	apiRedis, workerRedis := redisClient(&apiRT), redisClient(&workerRT)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}

	api := newAPIServer(b, apiRedis, prefix, pool)
	sink := webhooksink.New(webhooksink.Options{})
	hook := httptest.NewServer(sink)
	b.Cleanup(hook.Close)
	sender, err := webhook.New(webhook.Config{URL: hook.URL})
	if err != nil {
		b.Fatal(err)
	}
	relay, err := outbox.NewRelay(pgoutbox.New(pool), sender, outbox.Config{Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	// ONCEFLOW_BENCH_LIMITER=off runs the model calls without the limiter (Config.NoLimits),
	// to measure what the limiter costs with nothing configured (docs/BENCHMARKS.md).
	hc := handlerConfig{Logger: quiet, NoLimits: os.Getenv("ONCEFLOW_BENCH_LIMITER") == "off"}
	if ledgerMode != "off" {
		l, err := ledger.New(pool, ledger.Config{Logger: quiet})
		if err != nil {
			b.Fatal(err)
		}
		hc.Ledger, hc.Provider = l, "fake"
		if ledgerMode == "each-write-alone" {
			hc.LedgerConfig.GroupLinger, hc.DurableAnswers = -1, true
		} else if v := os.Getenv("ONCEFLOW_BENCH_GROUP_LINGER"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil {
				b.Fatalf("ONCEFLOW_BENCH_GROUP_LINGER=%q: %v", v, err)
			}
			hc.LedgerConfig.GroupLinger = d
		}
	}
	h := newHandler(b, pool, fake.New(), hc)
	stopWorker := startWorker(b, queue.WorkerConfig{Redis: workerRedis, Keys: keys, Handler: h, Concurrency: workers, Logger: quiet})
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	// Let the worker create its group and the relay its first empty pass; then count
	// only what the jobs cost.
	time.Sleep(300 * time.Millisecond)
	pg.Reset()
	apiRT.Reset()
	workerRT.Reset()

	if withUI {
		stopUI := openUI(b, prefix, dsn)
		defer stopUI()
	}
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = clients
	client := &http.Client{Transport: transport}
	body := validBody("Quarterly review for the account team: revenue grew 12%, churn fell to 2.1%, two enterprise renewals are at risk and need an owner this week.")
	var next atomic.Int64
	var failed, retried atomic.Int64
	var firstErr sync.Once
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(jobs) {
					return
				}
				// A client retries a 503 (the API's answer when Redis is slower than its
				// timeout, which an overloaded machine can be) with the same key.
				var err error
				for attempt := 0; attempt < 20; attempt++ {
					if attempt > 0 {
						retried.Add(1)
						time.Sleep(50 * time.Millisecond)
					}
					req, _ := http.NewRequest(http.MethodPost, api.URL+"/v1/summaries", strings.NewReader(body))
					req.Header.Set("Authorization", "Bearer "+keyAcme)
					req.Header.Set("Idempotency-Key", fmt.Sprintf("bench-job-%012d", i))
					req.Header.Set("Content-Type", "application/json")
					var resp *http.Response
					if resp, err = client.Do(req); err != nil {
						break
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusAccepted {
						break
					}
					err = fmt.Errorf("status %d", resp.StatusCode)
					if resp.StatusCode != http.StatusServiceUnavailable {
						break
					}
				}
				if err != nil {
					failed.Add(1)
					firstErr.Do(func() { b.Errorf("POST: %v", err) })
				}
			}
		}()
	}
	wg.Wait()
	acceptedIn := time.Since(start)
	deadline := time.Now().Add(10 * time.Minute)
	for sink.Stats().Deliveries < jobs-int(failed.Load()) {
		if time.Now().After(deadline) {
			b.Fatalf("only %d of %d emails after 10 minutes", sink.Stats().Deliveries, jobs)
		}
		time.Sleep(2 * time.Millisecond)
	}
	ds := sink.Deliveries()
	elapsed := ds[len(ds)-1].At.Sub(start)
	b.StopTimer()
	apiRedisRT, workerRedisRT := apiRT.Redis(), workerRT.Redis()
	pgRT, pgCommits, pgRelaxed := pg.Postgres(), pg.Durable(), pg.Relaxed()
	stopWorker()
	stopRelay()
	if err := <-relayDone; err != nil {
		b.Fatal(err)
	}
	if failed.Load() > 0 {
		b.Fatalf("%d POSTs failed", failed.Load())
	}
	st := sink.Stats()
	var summarised int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM summaries`).Scan(&summarised); err != nil {
		b.Fatal(err)
	}
	if st.DistinctKeys != jobs || st.Deliveries != jobs || summarised != jobs {
		b.Fatalf("%d summaries, %d emails to %d keys, want %d of each", summarised, st.Deliveries, st.DistinctKeys, jobs)
	}
	if retried.Load() > 0 {
		b.Logf("%d POSTs answered 503 (Redis slower than the API's timeout) and were retried with the same key", retried.Load())
	}
	n := float64(jobs)
	return pipelineResult{
		jobsPerSec: n / elapsed.Seconds(), acceptPerSec: n / acceptedIn.Seconds(),
		pgCommits: float64(pgCommits) / n, pgRelaxed: float64(pgRelaxed) / n, pgRoundTrips: float64(pgRT) / n,
		redisAPI: float64(apiRedisRT) / n, redisWorker: float64(workerRedisRT) / n,
	}
}

// pgbenchCeiling runs pgbench with the reference summary+outbox statement (one CTE, one
// autocommit transaction: the store of the handler before the public API; the worker's
// Job.Commit now sends the completion record, the summary and the outbox row as one
// batch, one transaction too) on a scratch schema of the test PostgreSQL, and returns
// its transactions per second.
func pgbenchCeiling(b *testing.B, clients, seconds int) float64 {
	b.Helper()
	bin, err := cluster.LookPostgres("pgbench")
	if err != nil {
		b.Fatal(err)
	}
	dsn := testenv.EmptySchema(b)
	if _, err := migrations.Up(context.Background(), dsn, slog.New(slog.DiscardHandler)); err != nil {
		b.Fatal(err)
	}
	u, err := url.Parse(dsn)
	if err != nil {
		b.Fatal(err)
	}
	q := u.Query()
	schema := q.Get("search_path")
	q.Del("search_path") // not a libpq parameter: pgbench gets it through PGOPTIONS
	u.RawQuery = q.Encode()
	script := filepath.Join(b.TempDir(), "store.sql")
	if err := os.WriteFile(script, []byte(pgbenchStoreSQL), 0o644); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "--no-vacuum", "--protocol=prepared", "--client="+strconv.Itoa(clients), "--jobs=2",
		"--time="+strconv.Itoa(seconds), "--file="+script, u.String())
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+schema+" -c synchronous_commit=on")
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("pgbench: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`).FindSubmatch(out)
	if m == nil {
		b.Fatalf("no tps in pgbench's output:\n%s", out)
	}
	tps, _ := strconv.ParseFloat(string(m[1]), 64)
	return tps
}

// pgbenchStoreSQL is the reference store statement with its parameters filled in the
// way a job fills them: a fresh job id, a summary and an email payload of realistic size.
const pgbenchStoreSQL = `WITH s AS (
	INSERT INTO summaries (job_id, tenant, summary) VALUES (gen_random_uuid(), 'acme', 'Summary: revenue grew 12%, churn fell to 2.1%; two enterprise renewals need an owner this week.')
	ON CONFLICT (job_id) DO NOTHING
	RETURNING job_id
)
INSERT INTO outbox (topic, dedupe_key, payload, traceparent)
SELECT 'email.summary_ready', 'summary_ready:' || s.job_id::text,
	jsonb_build_object('job_id', s.job_id, 'to', 'team@example.com', 'subject', 'Your summary is ready',
		'body', 'Your summary ' || s.job_id::text || ' is ready: GET /v1/summaries/' || s.job_id::text || E'\n\nSummary: revenue grew 12%, churn fell to 2.1%; two enterprise renewals need an owner this week.'),
	NULLIF('', '')
FROM s;
`

func benchEnvInt(b *testing.B, name string, def int) int {
	b.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// BenchmarkWorkerLedger measures what the llm_calls ledger costs a summaries worker,
// end to end from the stream to the committed summary and outbox row: b.N jobs are
// enqueued, then one queue.Worker (ONCEFLOW_WORKER_CONCURRENCY 64) runs the summaries
// handler until every job's summary is committed, with a zero-latency in-process model
// (llm/fake), against the dev Redis and PostgreSQL (synchronous_commit on). Modes, in
// one run: without the ledger, with it, with it and RelaxedInsert. Metrics: jobs/s and,
// per job, PostgreSQL round trips, durable commits and commits without a flush (an
// answer recorded before a later durable commit), Redis round trips.
//
//	go test -run '^$' -bench BenchmarkWorkerLedger -benchtime 5000x -count 3 ./summaries/
//
// ONCEFLOW_BENCH_CONCURRENCY overrides the worker concurrency (default 64).
func BenchmarkWorkerLedger(b *testing.B) {
	concurrency := 64
	if v, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_CONCURRENCY")); err == nil && v > 0 {
		concurrency = v
	}
	for _, mode := range []string{"no-ledger", "ledger", "ledger-relaxed"} {
		b.Run(mode, func(b *testing.B) {
			rdb, prefix := testenv.Redis(b)
			watch, dsn := testenv.Postgres(b) // the benchmark's own polls, not counted
			var pgc roundtrip.Commits
			pool, err := connect.Postgres(context.Background(), dsn, &pgc)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(pool.Close)
			var rc roundtrip.Counter
			rdb.AddHook(&rc)
			quiet := slog.New(slog.DiscardHandler)
			cfg := handlerConfig{Model: "gpt-4.1-mini", Provider: "fake", Logger: quiet}
			if mode != "no-ledger" {
				cfg.LedgerConfig = ledger.Config{RelaxedInsert: mode == "ledger-relaxed"}
				cfg.Ledger, err = ledger.New(pool, cfg.LedgerConfig)
				if err != nil {
					b.Fatal(err)
				}
			}
			h := newHandler(b, pool, fake.New(), cfg)
			keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
			ctx := context.Background()
			for i := range b.N {
				payload, _ := json.Marshal(summaries.Request{Text: fmt.Sprintf("Report %d: revenue grew in every region.", i), Notify: "ops@example.com"})
				m := queue.Message{JobID: fmt.Sprintf("00000000-0000-4000-8000-%012x", i), Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}
				if _, err := queue.Enqueue(ctx, rdb, keys, m); err != nil {
					b.Fatal(err)
				}
			}
			w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Handler: h, Concurrency: concurrency, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			pgc.Reset()
			rc.Reset()
			b.ResetTimer()
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- w.Run(runCtx) }()
			for {
				var n int
				if err := watch.QueryRow(ctx, `SELECT count(*) FROM summaries`).Scan(&n); err != nil {
					b.Fatal(err)
				}
				if n == b.N {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			b.StopTimer()
			elapsed := b.Elapsed()
			stop()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			jobs := float64(b.N)
			b.ReportMetric(jobs/elapsed.Seconds(), "jobs/s")
			b.ReportMetric(float64(pgc.Postgres())/jobs, "pg-rt/job")
			b.ReportMetric(float64(pgc.Durable())/jobs, "pg-commits/job")
			b.ReportMetric(float64(pgc.Relaxed())/jobs, "pg-relaxed-commits/job")
			b.ReportMetric(float64(rc.Redis())/jobs, "redis-rt/job")
		})
	}
}

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
				r := runPipeline(b, jobs, clients, workers, "on", ui)
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
