// Command bench measures onceflow's queue worker beside asynq and River on the same
// machine, the same Redis and the same PostgreSQL, in one invocation. It lives in its own
// module (the lab, github.com/onceflow/onceflow/lab) so the peers never enter onceflow's dependencies. `make bench` runs it.
//
// For each Redis fsync setting (everysec, always) it starts a private redis-server, then
// for each run (alternating the order of systems between runs) and each workload:
//
//   - throughput: N jobs are enqueued through each system's recommended bulk path with
//     the workers stopped, then the workers start and the clock runs until the last job
//     is done: jobs/s = N / drain time.
//   - latency: with the workers running, jobs are enqueued at a fixed rate below every
//     system's capacity; enqueue-to-done latency p50 and p99 per job.
//
// Workloads: noop (the handler returns at once) and txinsert (the handler inserts one row
// in its own PostgreSQL transaction). Medians over the runs are reported as a Markdown
// table with onceflow/peer ratios.
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// handlerFunc is the job body every system runs: it receives the job's number.
type handlerFunc func(ctx context.Context, id int) error

// system is one queue implementation under test.
type system interface {
	name() string
	// prepare resets the system's state for a new measurement.
	prepare(ctx context.Context) error
	// enqueue adds jobs with the given numbers through the system's bulk path.
	enqueue(ctx context.Context, ids []int) error
	// start begins processing with h; the returned func stops it.
	start(ctx context.Context, h handlerFunc) (stop func(), err error)
	close()
}

type result struct {
	system, workload, fsync string
	jobsPerSec              float64
	p50, p99                time.Duration
}

func main() {
	var (
		jobs        = flag.Int("jobs", 20000, "jobs per throughput measurement")
		latencyJobs = flag.Int("latency-jobs", 2000, "jobs per latency measurement")
		latencyRate = flag.Int("latency-rate", 500, "jobs/s offered in the latency measurement")
		runs        = flag.Int("runs", 3, "runs per system and setting (medians are reported)")
		systems     = flag.String("systems", "onceflow,asynq,river", "systems to measure")
		workloads   = flag.String("workloads", "noop,txinsert", "workloads")
		fsyncs      = flag.String("fsync", "everysec,always", "Redis appendfsync settings")
		concurrency = flag.Int("concurrency", 512, "workers per system (onceflow Concurrency, asynq Concurrency, River MaxWorkers)")
		dbURL       = flag.String("database-url", os.Getenv("ONCEFLOW_DATABASE_URL"), "PostgreSQL (default $ONCEFLOW_DATABASE_URL)")
	)
	flag.Parse()
	ctx := context.Background()
	if *dbURL == "" {
		fatal("no database: set ONCEFLOW_DATABASE_URL (make bench does) or --database-url")
	}
	pool, err := pgxpool.New(ctx, *dbURL+sep(*dbURL)+"pool_max_conns=64")
	if err != nil {
		fatal("postgres: %v", err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_rows (id bigint, system text, at timestamptz DEFAULT now())`); err != nil {
		fatal("create bench_rows: %v", err)
	}

	var results []result
	for _, fs := range strings.Split(*fsyncs, ",") {
		rs, stop := startRedis(fs)
		order := buildSystems(strings.Split(*systems, ","), rs, pool, *concurrency)
		for run := 0; run < *runs; run++ {
			for _, wl := range strings.Split(*workloads, ",") {
				for _, s := range rotate(order, run) {
					h := workloadHandler(wl, s.name(), pool)
					tp, err := measureThroughput(ctx, s, h, *jobs)
					if err != nil {
						fatal("%s %s throughput: %v", s.name(), wl, err)
					}
					p50, p99, err := measureLatency(ctx, s, h, *latencyJobs, *latencyRate)
					if err != nil {
						fatal("%s %s latency: %v", s.name(), wl, err)
					}
					fmt.Fprintf(os.Stderr, "fsync=%s run=%d %-9s %-8s %8.0f jobs/s  p50 %v  p99 %v\n", fs, run+1, s.name(), wl, tp, p50, p99)
					results = append(results, result{s.name(), wl, fs, tp, p50, p99})
				}
			}
		}
		for _, s := range order {
			s.close()
		}
		stop()
	}
	report(os.Stdout, results, *jobs, *latencyRate, *concurrency)
}

func buildSystems(names []string, redisAddr string, pool *pgxpool.Pool, concurrency int) []system {
	var out []system
	for _, n := range names {
		switch n {
		case "onceflow":
			out = append(out, newOnceflowSystem(redisAddr, concurrency))
		case "onceflow-api":
			out = append(out, newOnceflowAPISystem(redisAddr, concurrency))
		case "asynq":
			out = append(out, &asynqSystem{redisAddr: redisAddr, concurrency: concurrency})
		case "river":
			out = append(out, &riverSystem{pool: pool, schema: schemaName("bench_river"), workers: concurrency})
		default:
			fatal("unknown system %q", n)
		}
	}
	return out
}

// rotate returns systems in a different order on each run, so no system always runs
// first (on a warm or a cold machine).
func rotate(s []system, run int) []system {
	out := slices.Clone(s)
	k := run % len(out)
	return append(out[k:], out[:k]...)
}

// workloadHandler returns the job body of a workload.
func workloadHandler(workload, system string, pool *pgxpool.Pool) handlerFunc {
	switch workload {
	case "noop":
		return func(context.Context, int) error { return nil }
	case "txinsert":
		return func(ctx context.Context, id int) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx) //nolint:errcheck // after Commit it is a no-op
			if _, err := tx.Exec(ctx, `INSERT INTO bench_rows (id, system) VALUES ($1, $2)`, id, system); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	fatal("unknown workload %q", workload)
	return nil
}

// tracker records when each job finished.
type tracker struct {
	done    []atomic.Int64 // unix nanos, 0 while pending
	pending atomic.Int64
	all     chan struct{}
	once    sync.Once
}

func newTracker(n int) *tracker {
	t := &tracker{done: make([]atomic.Int64, n), all: make(chan struct{})}
	t.pending.Store(int64(n))
	return t
}

// wrap counts each job once, even if a system delivers it twice.
func (t *tracker) wrap(h handlerFunc) handlerFunc {
	return func(ctx context.Context, id int) error {
		if err := h(ctx, id); err != nil {
			return err
		}
		if id >= 0 && id < len(t.done) && t.done[id].CompareAndSwap(0, time.Now().UnixNano()) {
			if t.pending.Add(-1) == 0 {
				t.once.Do(func() { close(t.all) })
			}
		}
		return nil
	}
}

func measureThroughput(ctx context.Context, s system, h handlerFunc, n int) (float64, error) {
	if err := s.prepare(ctx); err != nil {
		return 0, fmt.Errorf("prepare: %w", err)
	}
	ids := make([]int, n)
	for i := range ids {
		ids[i] = i
	}
	if err := s.enqueue(ctx, ids); err != nil {
		return 0, fmt.Errorf("enqueue: %w", err)
	}
	t := newTracker(n)
	start := time.Now()
	stop, err := s.start(ctx, t.wrap(h))
	if err != nil {
		return 0, fmt.Errorf("start: %w", err)
	}
	defer stop()
	select {
	case <-t.all:
	case <-time.After(10 * time.Minute):
		return 0, fmt.Errorf("%d of %d jobs still pending after 10 minutes", t.pending.Load(), n)
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

func measureLatency(ctx context.Context, s system, h handlerFunc, n, rate int) (p50, p99 time.Duration, err error) {
	if err := s.prepare(ctx); err != nil {
		return 0, 0, fmt.Errorf("prepare: %w", err)
	}
	t := newTracker(n)
	stop, err := s.start(ctx, t.wrap(h))
	if err != nil {
		return 0, 0, fmt.Errorf("start: %w", err)
	}
	defer stop()
	enq := make([]int64, n)
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	var wg sync.WaitGroup
	var firstErr atomic.Value
	for i := 0; i < n; i++ {
		<-tick.C
		enq[i] = time.Now().UnixNano()
		wg.Go(func() {
			if err := s.enqueue(ctx, []int{i}); err != nil {
				firstErr.CompareAndSwap(nil, err)
			}
		})
	}
	wg.Wait()
	if e, ok := firstErr.Load().(error); ok {
		return 0, 0, e
	}
	select {
	case <-t.all:
	case <-time.After(5 * time.Minute):
		return 0, 0, fmt.Errorf("%d of %d jobs still pending", t.pending.Load(), n)
	}
	lat := make([]time.Duration, n)
	for i := range lat {
		lat[i] = time.Duration(t.done[i].Load() - enq[i])
	}
	slices.Sort(lat)
	return lat[n/2], lat[n*99/100], nil
}

// parallel runs f over ids with k goroutines.
func parallel(ctx context.Context, ids []int, k int, f func(context.Context, int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Value
	for range min(k, len(ids)) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(ids) {
					return
				}
				if err := f(ctx, ids[i]); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if e, ok := firstErr.Load().(error); ok {
		return e
	}
	return nil
}

// startRedis starts a private redis-server with AOF on and the given appendfsync, on a
// free port, and returns its address and a stop function.
func startRedis(fsync string) (string, func()) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		fatal("redis-server not found: run scripts/dev-services up first (it installs it)")
	}
	dir, err := os.MkdirTemp("", "onceflow-bench-redis-")
	if err != nil {
		fatal("%v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatal("%v", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	// #nosec G204 -- bin is the redis-server found on PATH by the benchmark itself, and every argument is its own.
	cmd := exec.Command(bin, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--dir", dir,
		"--appendonly", "yes", "--appendfsync", fsync, "--save", "", "--daemonize", "no",
		"--logfile", filepath.Join(dir, "redis.log"))
	if err := cmd.Start(); err != nil {
		fatal("start redis: %v", err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	for i := 0; ; i++ {
		if c.Ping(context.Background()).Err() == nil {
			break
		}
		if i > 200 {
			fatal("redis did not start; see %s/redis.log", dir)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return addr, func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = os.RemoveAll(dir)
	}
}

func report(w io.Writer, results []result, jobs, rate, concurrency int) {
	type key struct{ system, workload, fsync string }
	groups := map[key][]result{}
	var keys []key
	for _, r := range results {
		k := key{r.system, r.workload, r.fsync}
		if _, ok := groups[k]; !ok {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], r)
	}
	median := func(k key) (float64, time.Duration, time.Duration) {
		g := groups[k]
		tps := make([]float64, len(g))
		p50s := make([]time.Duration, len(g))
		p99s := make([]time.Duration, len(g))
		for i, r := range g {
			tps[i], p50s[i], p99s[i] = r.jobsPerSec, r.p50, r.p99
		}
		slices.Sort(tps)
		slices.Sort(p50s)
		slices.Sort(p99s)
		return tps[len(tps)/2], p50s[len(p50s)/2], p99s[len(p99s)/2]
	}
	slices.SortFunc(keys, func(a, b key) int {
		return cmp.Or(cmp.Compare(a.fsync, b.fsync), cmp.Compare(a.workload, b.workload), cmp.Compare(a.system, b.system))
	})
	fmt.Fprintf(w, "Throughput: %d jobs drained per run; latency: jobs offered at %d/s; %d workers per system; medians of %d runs.\n\n",
		jobs, rate, concurrency, len(groups[keys[0]]))
	fmt.Fprintln(w, "| appendfsync | workload | system | jobs/s | onceflow / system | p50 | p99 |")
	fmt.Fprintln(w, "| --- | --- | --- | ---: | ---: | ---: | ---: |")
	for _, k := range keys {
		tp, p50, p99 := median(k)
		ratio := "—"
		if k.system != "onceflow" {
			if _, ok := groups[key{"onceflow", k.workload, k.fsync}]; ok {
				otp, _, _ := median(key{"onceflow", k.workload, k.fsync})
				ratio = fmt.Sprintf("%.2fx", otp/tp)
			}
		}
		fmt.Fprintf(w, "| %s | %s | %s | %.0f | %s | %s | %s |\n", k.fsync, k.workload, k.system, tp, ratio,
			p50.Round(10*time.Microsecond), p99.Round(10*time.Microsecond))
	}
}

func sep(url string) string {
	if strings.Contains(url, "?") {
		return "&"
	}
	return "?"
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func fatal(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
	os.Exit(1)
}
