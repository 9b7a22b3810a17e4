package cli

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// BenchmarkWorkInFlight measures how many jobs one `onceflow work` process holds in
// flight when the model is slow, and what that costs in memory: a real worker process
// (ONCEFLOW_WORKER_CONCURRENCY, default 1000 here) runs the summaries handler with the
// OpenAI adapter against `onceflow fake-llm --latency 2s`, on a queue filled in advance.
// While the jobs drain it samples the model calls in flight (fake-llm's /stats) and the
// worker's resident memory (VmRSS in /proc/PID/status); at the end it reads the peak
// (VmHWM) and the jobs per second. The ideal rate is concurrency / latency.
//
//	go test -run '^$' -bench BenchmarkWorkInFlight -benchtime 1x ./cli/
//
// Knobs (environment): ONCEFLOW_WORKER_CONCURRENCY (default 1000), ONCEFLOW_BENCH_JOBS
// (default 4 x concurrency), ONCEFLOW_BENCH_LATENCY (default 2s).
func BenchmarkWorkInFlight(b *testing.B) {
	concurrency := benchInt(b, "ONCEFLOW_WORKER_CONCURRENCY", 1000)
	jobs := benchInt(b, "ONCEFLOW_BENCH_JOBS", 4*concurrency)
	latency := 2 * time.Second
	if v := os.Getenv("ONCEFLOW_BENCH_LATENCY"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			b.Fatalf("ONCEFLOW_BENCH_LATENCY=%q: want a positive duration", v)
		}
		latency = d
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	rdb, prefix := testenv.Redis(b)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	pool, dsn := testenv.Postgres(b)
	bin := testenv.Binary(b)

	model := testenv.Start(b, bin, nil, "fake-llm", "--addr", "127.0.0.1:0", "--latency", latency.String())
	base := fmt.Sprint(model.WaitLog(ctx, "fake-llm listening")["base_url"])

	// Fill the queue first, so the worker is never starved.
	payload := summaries.Request{Text: "Quarterly review for the account team: revenue grew 12%, churn fell to 2.1%.", Notify: "team@example.com"}.Canonical()
	var fill sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 16; w++ {
		fill.Add(1)
		go func() {
			defer fill.Done()
			for i := w; i < jobs; i += 16 {
				m := queue.Message{JobID: fmt.Sprintf("00000000-0000-4000-8000-%012d", i), Tenant: "acme", Payload: payload}
				if _, err := queue.Enqueue(ctx, rdb, keys, m); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	fill.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatal(err)
	}

	b.ResetTimer()
	start := time.Now()
	worker := testenv.Start(b, bin, []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(b), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + base, "OPENAI_API_KEY=bench",
		"ONCEFLOW_WORKER_CONCURRENCY=" + strconv.Itoa(concurrency), "ONCEFLOW_LOG_FORMAT=json",
	}, "work")
	var maxInFlight int64
	var rssAtMax, maxRSS int64
	var done int
	for done < jobs {
		if ctx.Err() != nil || worker.Exited() {
			b.Fatalf("%d of %d jobs done; worker exited: %v\n%s", done, jobs, worker.Exited(), worker.Stderr())
		}
		time.Sleep(100 * time.Millisecond)
		st, err := fakeserver.FetchStats(ctx, nil, base)
		if err != nil {
			b.Fatal(err)
		}
		rss := procStatusKB(b, worker.Pid(), "VmRSS")
		if st.InFlight > maxInFlight {
			maxInFlight, rssAtMax = st.InFlight, rss
		}
		maxRSS = max(maxRSS, rss)
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM summaries`).Scan(&done); err != nil {
			b.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()
	peak := procStatusKB(b, worker.Pid(), "VmHWM")
	st, err := fakeserver.FetchStats(ctx, nil, base)
	if err != nil {
		b.Fatal(err)
	}
	if st.Requests != int64(jobs) {
		b.Errorf("%d model calls for %d jobs", st.Requests, jobs)
	}
	ideal := float64(concurrency) / latency.Seconds()
	rate := float64(jobs) / elapsed.Seconds()
	b.ReportMetric(float64(maxInFlight), "max-in-flight")
	b.ReportMetric(float64(rssAtMax)/1024, "rss-MB-at-max")
	b.ReportMetric(float64(peak)/1024, "peak-rss-MB")
	b.ReportMetric(rate, "jobs/s")
	b.ReportMetric(rate/ideal, "jobs/ideal")
	b.Logf("concurrency %d, model latency %v, %d jobs in %v: %.0f jobs/s (ideal %.0f, ratio %.2f); at most %d model calls in flight, RSS %.0f MB then, peak %.0f MB (sampled max %.0f MB)",
		concurrency, latency, jobs, elapsed.Round(time.Millisecond), rate, ideal, rate/ideal, maxInFlight,
		float64(rssAtMax)/1024, float64(peak)/1024, float64(maxRSS)/1024)
	if maxInFlight < 1000 || peak >= 300*1024 {
		b.Logf("TARGET MISSED: want at least 1000 jobs in flight with RSS under 300 MB")
	}
}

// procStatusKB reads one "Name:   123 kB" line of /proc/PID/status.
func procStatusKB(b *testing.B, pid int, name string) int64 {
	b.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				b.Fatalf("%s: %q", name, v)
			}
			return n
		}
	}
	b.Fatalf("no %s in /proc/%d/status", name, pid)
	return 0
}

func benchInt(b *testing.B, name string, def int) int {
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
