package limitbench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// modelName is the model the workers ask for (ONCEFLOW_LLM_MODEL), whose buckets
// fake-llm keeps.
const modelName = "gpt-4.1-mini"

// duplicateMsg is the summaries workflow's log line for a delivery that found its
// job's summary already stored.
const duplicateMsg = "a concurrent delivery stored the summary first: duplicate"

// stack is one run's stores and processes: its own redis-server, a schema of its own,
// a fresh fake-llm, and the work processes once started.
type stack struct {
	b    *bench
	name string
	dir  string
	keys queue.Keys

	redis  *cluster.Server
	rdb    *redis.Client
	schema string
	dbURL  string
	pool   *pgxpool.Pool
	llm    *cluster.Proc
	llmURL string

	workers     []*cluster.Proc
	metricsURLs []string
	// redisCPU0, redisCmds0 and load0 are the Redis CPU time, its commands processed
	// and the load average when the workers started.
	redisCPU0  time.Duration
	redisCmds0 int64
	load0      float64
}

// newStack starts run name's stores and fake-llm; on error it stops what it started.
func (b *bench) newStack(ctx context.Context, name string) (*stack, error) {
	s := &stack{b: b, name: name, dir: filepath.Join(b.cfg.Dir, name), keys: queue.Keys{Prefix: "limitbench", Queue: summaries.QueueName}}
	if err := s.start(ctx); err != nil {
		s.close()
		return nil, fmt.Errorf("set up the %s run: %w", name, err)
	}
	return s, nil
}

// start starts the stores and fake-llm of s; close stops whatever it started.
func (s *stack) start(ctx context.Context) (err error) {
	b := s.b
	if err := os.MkdirAll(s.dir, 0o750); err != nil {
		return err
	}
	if s.redis, err = cluster.NewRedis(s.dir, "always"); err != nil {
		return err
	}
	if err := s.redis.Up(); err != nil {
		return err
	}
	if s.rdb, err = connect.Redis(s.redis.URL); err != nil {
		return err
	}
	if err := s.createSchema(ctx); err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, s.dbURL, slog.New(slog.DiscardHandler)); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if s.pool, err = connect.Postgres(ctx, s.dbURL, nil); err != nil {
		return err
	}
	c := b.cfg
	s.llm = &cluster.Proc{Name: "fake-llm", Bin: c.Bin, LogDir: s.dir, Args: []string{"fake-llm", "--addr", "127.0.0.1:0",
		"--rpm", strconv.Itoa(c.RPM), "--tpm", strconv.Itoa(c.TPM), "--latency", c.Latency.String(), "--seed", strconv.FormatUint(c.Seed, 10)}}
	if err := s.llm.Start(); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	addr, err := s.llm.Addr(wctx, "fake-llm listening")
	if err != nil {
		return err
	}
	s.llmURL = "http://" + addr
	return nil
}

// createSchema creates the run's schema on Config.DatabaseURL and sets s.dbURL to a URL
// whose search_path selects it.
func (s *stack) createSchema(ctx context.Context) error {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	s.schema = "limitbench_" + strings.ReplaceAll(s.name, "-", "_") + "_" + hex.EncodeToString(rnd[:])
	conn, err := pgx.Connect(ctx, s.b.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+s.schema); err != nil {
		s.schema = ""
		return fmt.Errorf("create schema: %w", err)
	}
	u, err := url.Parse(s.b.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("parse database url: %w", err)
	}
	q := u.Query()
	q.Set("search_path", s.schema)
	u.RawQuery = q.Encode()
	s.dbURL = u.String()
	return nil
}

// close stops every process of the run (workers with SIGTERM), stops its Redis and
// drops its schema. The logs stay in the run's folder.
func (s *stack) close() {
	s.stopWorkers()
	if s.llm != nil {
		s.llm.Stop(10 * time.Second)
	}
	if s.pool != nil {
		s.pool.Close()
	}
	if s.rdb != nil {
		_ = s.rdb.Close()
	}
	if s.redis != nil {
		s.redis.Down()
	}
	if s.schema != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if conn, err := pgx.Connect(ctx, s.b.cfg.DatabaseURL); err == nil {
			_, _ = conn.Exec(ctx, "DROP SCHEMA "+s.schema+" CASCADE")
			_ = conn.Close(ctx)
		}
	}
}

// stopWorkers stops the work processes together with SIGTERM (they finish or hand
// back what is in flight) and waits for them to exit.
func (s *stack) stopWorkers() {
	var wg sync.WaitGroup
	for _, w := range s.workers {
		wg.Go(func() { w.Stop(20 * time.Second) })
	}
	wg.Wait()
}

// jobID returns the id of job i of a run's tenant number t: UUID-shaped.
func jobID(t, i int) string { return fmt.Sprintf("00000000-0000-4000-8%03d-%012d", t, i) }

// enqueue queues one summaries job.
func (s *stack) enqueue(ctx context.Context, id, tenant, text string) error {
	req := summaries.Request{Text: text, Notify: "account-team@example.com"}
	if _, err := queue.Enqueue(ctx, s.rdb, s.keys, queue.Message{JobID: id, Tenant: tenant, Payload: req.Canonical()}); err != nil {
		return fmt.Errorf("enqueue %s: %w", id, err)
	}
	return nil
}

// workerEnv is the work processes' environment: the OpenAI adapter against the run's
// fake-llm, admission on or off, and with configured the limits set.
func (s *stack) workerEnv(admission, configured bool) []string {
	c := s.b.cfg
	env := []string{
		"ONCEFLOW_REDIS_URL=" + s.redis.URL, "ONCEFLOW_DATABASE_URL=" + s.dbURL, "ONCEFLOW_PREFIX=" + s.keys.Prefix,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + s.llmURL + "/v1", "OPENAI_API_KEY=sk-limitbench", "ONCEFLOW_LLM_MODEL=" + modelName,
		"ONCEFLOW_WORKER_CONCURRENCY=" + strconv.Itoa(c.Concurrency), "ONCEFLOW_SHUTDOWN_TIMEOUT=10s",
		"ONCEFLOW_LLM_ADMISSION=" + map[bool]string{true: "on", false: "off"}[admission],
	}
	if configured {
		env = append(env, "ONCEFLOW_LLM_RPM="+strconv.Itoa(c.RPM), "ONCEFLOW_LLM_TPM="+strconv.Itoa(c.TPM))
	}
	return env
}

// startWorkers starts Config.Workers work processes with env, each with a /metrics
// listener, and returns when they started (before the first exec: the start of the
// run's clock) and how long until all of them logged "worker started".
func (s *stack) startWorkers(ctx context.Context, env []string) (t0 time.Time, boot time.Duration, err error) {
	s.redisCPU0, s.redisCmds0, _ = s.redisCounters(ctx)
	s.load0 = cluster.LoadAvg()
	for i := range s.b.cfg.Workers {
		port, err := cluster.FreePort()
		if err != nil {
			return t0, 0, err
		}
		s.metricsURLs = append(s.metricsURLs, fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		s.workers = append(s.workers, &cluster.Proc{Name: fmt.Sprintf("work-%d", i+1), Bin: s.b.cfg.Bin, Args: []string{"work"},
			Env: append(slices.Clip(env), fmt.Sprintf("ONCEFLOW_METRICS_ADDR=127.0.0.1:%d", port)), LogDir: s.dir})
	}
	t0 = time.Now()
	for _, w := range s.workers {
		if err := w.Start(); err != nil {
			return t0, 0, err
		}
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, w := range s.workers {
		if _, err := w.WaitLog(wctx, "worker started"); err != nil {
			return t0, 0, err
		}
	}
	return t0, time.Since(t0), nil
}

// count runs a count query.
func (s *stack) count(ctx context.Context, sql string, args ...any) (int64, error) {
	var n int64
	if err := s.pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("%s: %w", sql, err)
	}
	return n, nil
}

// deadLetters returns the length of the dead-letter stream.
func (s *stack) deadLetters(ctx context.Context) (int64, error) {
	return s.rdb.XLen(ctx, s.keys.Dead()).Result()
}

// waitDone polls every 250ms until every one of jobs is summarised or dead-lettered,
// the context ends, or nothing moved for Config.Stall; it logs progress every 10 s. It
// reports whether every job was accounted for; an error is a store's failure.
func (s *stack) waitDone(ctx context.Context, t0 time.Time, jobs int64) (bool, error) {
	lastLog, lastMove, last := time.Now(), time.Now(), int64(-1)
	for {
		n, err := s.count(ctx, `SELECT count(*) FROM summaries`)
		if err != nil {
			return false, err
		}
		dead, err := s.deadLetters(ctx)
		if err != nil {
			return false, err
		}
		if n+dead != last {
			last, lastMove = n+dead, time.Now()
		}
		if n+dead >= jobs {
			return true, nil
		}
		if time.Since(lastLog) >= 10*time.Second {
			lastLog = time.Now()
			st, _ := fakeserver.FetchStats(ctx, nil, s.llmURL)
			s.b.logf("%s: +%.0fs summarised %d, dead-lettered %d; model requests %d (429: %d)", s.name, time.Since(t0).Seconds(),
				n, dead, st.Requests, st.ByStatus["429"])
		}
		if time.Since(lastMove) > s.b.cfg.Stall {
			s.b.logf("%s: no progress for %v; giving up with %d of %d done", s.name, s.b.cfg.Stall, n+dead, jobs)
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, nil
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// model reads fake-llm's counters.
func (s *stack) model(ctx context.Context) (Model, error) {
	st, err := fakeserver.FetchStats(ctx, nil, s.llmURL)
	if err != nil {
		return Model{}, err
	}
	m := Model{Requests: st.Requests, OK: st.ByStatus["200"], Limited: st.ByStatus["429"]}
	m.Other = m.Requests - m.OK - m.Limited
	for _, n := range st.ByIdempotencyKey {
		m.KeysMax = max(m.KeysMax, n)
	}
	return m, nil
}

// deadReasons returns the reasons of the first n dead letters.
func (s *stack) deadReasons(ctx context.Context, n int64) ([]string, error) {
	dead, _, err := queue.ListDead(ctx, s.rdb, s.keys, "", n)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, d := range dead {
		r := d.Reason
		if len(r) > 300 {
			r = r[:300] + "..."
		}
		out = append(out, fmt.Sprintf("%s (%s, %d deliveries): %s", d.JobID, d.Tenant, d.Deliveries, r))
	}
	return out, nil
}

// probe sends fake-llm one request of the workers' model and returns what its
// x-ratelimit-remaining-requests header says is left of the requests bucket after it
// (-1 when absent), and the answer's status.
func (s *stack) probe(ctx context.Context) (remaining int64, status int, err error) {
	body := `{"model":"` + modelName + `","max_tokens":1,"messages":[{"role":"user","content":"probe"}]}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.llmURL+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return -1, 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk-limitbench-probe")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1, 0, fmt.Errorf("probe fake-llm: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	remaining = -1
	if v, err := strconv.ParseInt(resp.Header.Get("X-Ratelimit-Remaining-Requests"), 10, 64); err == nil {
		remaining = v
	}
	return remaining, resp.StatusCode, nil
}

// metrics scrapes every worker's /metrics and sums them.
func (s *stack) metrics(ctx context.Context) (Metrics, error) {
	m := Metrics{}
	for _, u := range s.metricsURLs {
		if err := m.scrape(ctx, u); err != nil {
			return m, err
		}
	}
	return m, nil
}

// usage reads the CPU the run's processes spent so far (call it before they stop).
func (s *stack) usage(ctx context.Context) Usage {
	u := Usage{LoadStart: s.load0, LoadEnd: cluster.LoadAvg()}
	if cpu, cmds, err := s.redisCounters(ctx); err == nil {
		u.RedisCPU, u.RedisCommands = cpu-s.redisCPU0, cmds-s.redisCmds0
	}
	for _, w := range s.workers {
		u.WorkersCPU += cluster.CPUTime(w.Pid())
	}
	if s.llm != nil {
		u.LLMCPU = cluster.CPUTime(s.llm.Pid())
	}
	return u
}

// duplicateRuns counts the workers' log lines of deliveries that found their summary
// stored (call it after the workers stopped, so that their logs are complete).
func (s *stack) duplicateRuns() int {
	n := 0
	for _, w := range s.workers {
		n += w.CountLog(duplicateMsg)
	}
	return n
}

// redisCounters returns the CPU time the run's redis-server used so far (INFO cpu:
// system plus user) and the commands it processed (INFO stats, scripts' own calls
// included).
func (s *stack) redisCounters(ctx context.Context) (time.Duration, int64, error) {
	info, err := s.rdb.Info(ctx, "cpu", "stats").Result()
	if err != nil {
		return 0, 0, err
	}
	var cpu float64
	var cmds int64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		switch {
		case !ok:
		case k == "used_cpu_sys" || k == "used_cpu_user":
			f, _ := strconv.ParseFloat(v, 64)
			cpu += f
		case k == "total_commands_processed":
			cmds, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	return time.Duration(cpu * float64(time.Second)), cmds, nil
}
