// Package chaos proves onceflow's claim, exactly-once effects under crashes, with real
// processes: its own redis-server (appendfsync always) and PostgreSQL, `onceflow serve`,
// two `onceflow work`, `onceflow relay`, `onceflow fake-llm` with 429, 503, hang and drip
// faults, and a webhook sink that records every delivery with its Idempotency-Key.
// Clients submit jobs the way an SDK with idempotency keys does (retrying each job with
// the same key until a final answer, sometimes two at once) while a seeded scheduler
// kill -9s a random worker, the relay or the API every 0.5 to 3 s and restarts it, and
// crashes and restarts Redis and PostgreSQL once each. Then the faults stop, everything
// drains, and the invariants are checked against the stores, `onceflow audit --json` and
// the sink's records.
//
// The same seed replays the same schedule of faults and the same jobs (process timing
// still varies).
//
// RunOutage is the second profile, for the claim that outages never dead-letter work:
// ClaimIdle 2s, MaxDeliveries 3, three workers restarted one at a time with SIGTERM
// every 10 s during 5 s model calls, and, one after the other under load, PostgreSQL
// stopped, the model answering 503 to everything (fake-llm's POST /_fault), Redis
// stopped. It checks that only the poison jobs are dead-lettered, that every other job
// has one summary and one email, and that the workers' /readyz and breaker metrics
// named each outage while it lasted; its report is a Markdown table per phase.
package chaos

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// Config sets up a run.
type Config struct {
	// Bin is the onceflow binary. Required.
	Bin string
	// Dir holds the run's data and logs; it must be reachable by the postgres user when
	// running as root (not a 0700 folder). Required.
	Dir string
	// Seed drives the jobs and the fault schedule. Default: the current time.
	Seed uint64
	// Duration is the length of the load-and-faults phase. Default: 90s.
	Duration time.Duration
	// Clients is the number of concurrent clients. Default: 6.
	Clients int
	// Think is the mean pause of a client between two jobs. Default: 100ms (about 60
	// jobs/s with 6 clients: enough to keep every process busy at each kill, few enough
	// to drain in seconds).
	Think time.Duration
	// PoisonRate is the share of jobs with a text the model refuses. Default: 0.02.
	PoisonRate float64
	// KillMin and KillMax bound the wait between two process kills. Default: 0.5s, 3s.
	KillMin, KillMax time.Duration
	// DrainTimeout bounds the wait for the backlog after the faults stop. Default: 2m.
	DrainTimeout time.Duration
	// Shadow runs every summary's model call also as a shadow, at rate 1
	// (ONCEFLOW_SHADOW=summary=gpt-4.1@1): the run then checks that the shadows caused
	// no effect (every invariant as without them) and were recorded once per summary.
	Shadow bool
	// Log receives progress and the event log. Default: io.Discard.
	Log io.Writer
}

// Report is the outcome of a run.
type Report struct {
	Seed     uint64
	Duration time.Duration
	// Jobs counts jobs the clients submitted; Accepted those acknowledged with 202;
	// Poison the accepted ones meant to be refused by the model.
	Jobs, Accepted, Poison int
	Requests, Replayed     int64
	Summaries              int64
	DeadLettered           int64
	Deliveries             int
	DistinctKeys           int
	// DuplicateDeliveries counts deliveries beyond the first of a key (allowed: the
	// provider dedupes on the key; reported, not asserted).
	DuplicateDeliveries int
	ModelRequests       int64
	// Redelivered counts deliveries of jobs that had already finished (from the workers'
	// logs: reclaims after kills, crashes between commit and XACK).
	Redelivered int
	// Lost counts accepted jobs with no summary when the profile measures the loss
	// instead of forbidding it (RunCluster without WAIT: a failover's loss window).
	Lost int
	// ShadowRuns counts the shadow runs recorded (Config.Shadow); ShadowsDropped the
	// shadows the workers could not enqueue (logged: Redis down at that moment).
	ShadowRuns, ShadowsDropped int
	Events                     []string
	Violations                 []string
}

// Failed reports whether an invariant was violated.
func (r *Report) Failed() bool { return len(r.Violations) > 0 }

// String renders the report: figures, then violations, then the event log.
func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "chaos run seed=%d duration=%s\n", r.Seed, r.Duration)
	fmt.Fprintf(&b, "  jobs %d, accepted %d (poison %d), POSTs %d (replayed %d)\n", r.Jobs, r.Accepted, r.Poison, r.Requests, r.Replayed)
	fmt.Fprintf(&b, "  summaries %d, dead-lettered %d\n", r.Summaries, r.DeadLettered)
	fmt.Fprintf(&b, "  deliveries %d, distinct keys %d, duplicate deliveries %d\n", r.Deliveries, r.DistinctKeys, r.DuplicateDeliveries)
	perJob := 0.0
	if r.Accepted > 0 {
		perJob = float64(r.ModelRequests) / float64(r.Accepted)
	}
	fmt.Fprintf(&b, "  model requests %d (%.2f per job), redelivered finished jobs %d\n", r.ModelRequests, perJob, r.Redelivered)
	fmt.Fprintf(&b, "  faults: %d events\n", len(r.Events))
	if r.Lost > 0 {
		fmt.Fprintf(&b, "  accepted jobs lost (measured, not forbidden: no WAIT): %d\n", r.Lost)
	}
	if r.ShadowRuns > 0 || r.ShadowsDropped > 0 {
		fmt.Fprintf(&b, "  shadow runs %d (not enqueued, logged: %d)\n", r.ShadowRuns, r.ShadowsDropped)
	}
	writeVerdict(&b, r.Violations, r.Events, fmt.Sprintf("make chaos CHAOS_SEED=%d", r.Seed))
	return b.String()
}

// writeVerdict ends a report: "invariants: all hold", or each violation, the event log
// and the command that replays the run.
func writeVerdict(b *strings.Builder, violations, events []string, replay string) {
	if len(violations) == 0 {
		b.WriteString("  invariants: all hold\n")
		return
	}
	for _, v := range violations {
		fmt.Fprintf(b, "  VIOLATION: %s\n", v)
	}
	b.WriteString("event log:\n")
	for _, e := range events {
		fmt.Fprintf(b, "  %s\n", e)
	}
	fmt.Fprintf(b, "replay with the same seed: %s\n", replay)
}

// killRedis kills s with kill -9 and, after pause, starts it again, telling event.
func killRedis(event func(string, ...any), s *cluster.Server, pause time.Duration) error {
	event("kill -9 redis-server (appendfsync always)")
	s.Kill()
	time.Sleep(pause)
	if err := s.Up(); err != nil {
		return fmt.Errorf("restart redis: %w", err)
	}
	event("redis-server restarted")
	return nil
}

// crashPostgres shuts s down in immediate mode (no checkpoint: WAL replay at the next
// start) and, after pause, starts it again, telling event.
func crashPostgres(event func(string, ...any), s *cluster.Server, pause time.Duration) error {
	event("postgres immediate shutdown (SIGQUIT)")
	s.Crash()
	time.Sleep(pause)
	if err := s.Up(); err != nil {
		return fmt.Errorf("restart postgres: %w", err)
	}
	event("postgres restarted")
	return nil
}

// killProc kills p with kill -9 and, after pause, starts it again, telling event.
func killProc(event func(string, ...any), p *cluster.Proc, pause time.Duration) error {
	event("kill -9 %s (pid %d)", p.Name, p.Pid())
	p.Kill()
	time.Sleep(pause)
	if err := p.Start(); err != nil {
		return err
	}
	event("%s restarted", p.Name)
	return nil
}

const (
	apiKey   = "chaos-key-0123456789abcdef"
	maxInput = 4000 // fake-llm refuses longer prompts with 400 context_length_exceeded
)

// setupSpec is what differs between the profiles' process set-ups.
type setupSpec struct {
	// workers is the number of `onceflow work` processes.
	workers int
	// llmArgs are fake-llm's fault and latency flags.
	llmArgs []string
	// settings are the ONCEFLOW_* time scales and limits every process gets.
	settings []string
	// metrics gives each worker a /readyz and /metrics listener (ONCEFLOW_METRICS_ADDR)
	// whose base URLs go to run.workerURLs.
	metrics bool
	// cluster runs on a local Redis Cluster (3 primaries with a replica each) with the
	// queue in clusterPartitions partitions; its faults kill a primary and move a
	// partition's slot instead of crashing the one Redis and PostgreSQL.
	cluster bool
	// waitReplicas is ONCEFLOW_REDIS_WAIT_REPLICAS on the cluster; with 0, accepted jobs
	// lost at a failover are counted (Report.Lost), not a violation.
	waitReplicas int
}

// chaosSpec is TestChaos's set-up: two workers, a model with random faults, and
// short time scales so that a killed worker's jobs are reclaimed, and a killed relay's
// rows re-claimed, within seconds; enough deliveries that a job hit by several kills
// and faults is not dead-lettered for it.
func chaosSpec(seed uint64) setupSpec {
	return setupSpec{
		workers: 2,
		llmArgs: []string{"--fail-429", "0.05", "--retry-after", "1", "--fail-503", "0.05", "--hang", "0.01", "--drip", "0.01",
			"--max-input-chars", fmt.Sprint(maxInput), "--seed", fmt.Sprint(seed)},
		settings: []string{
			"ONCEFLOW_WORKER_CONCURRENCY=32", "ONCEFLOW_CLAIM_IDLE=4s", "ONCEFLOW_MAX_DELIVERIES=40",
			"ONCEFLOW_JOB_BUDGET=3s", "ONCEFLOW_LLM_TIMEOUT=1s", "ONCEFLOW_LEDGER_LEASE=3s",
			"ONCEFLOW_RELAY_INTERVAL=100ms", "ONCEFLOW_RELAY_LEASE=3s", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
		},
	}
}

// run is one chaos run's state.
type run struct {
	cfg   Config
	spec  setupSpec
	rng   *rand.Rand
	start time.Time

	redis   *cluster.Server
	rc      *cluster.RedisCluster // spec.cluster
	pg      *cluster.Server
	llm     *cluster.Proc
	sink    *cluster.Proc
	serve   *cluster.Proc
	workers []*cluster.Proc
	relay   *cluster.Proc
	// workerURLs are the workers' /readyz and /metrics base URLs (spec.metrics).
	workerURLs []string
	llmURL     string
	sinkURL    string
	apiURL     string
	env        []string
	redisURL   string
	dbURL      string

	evMu   sync.Mutex
	events []string

	jobsMu   sync.Mutex
	accepted map[string]string // idempotency key -> job id
	// acceptedAt is when each job id was first acknowledged with 202.
	acceptedAt map[string]time.Time
	poison     map[string]bool // job ids of poison jobs
	mismatch   []string
	jobs       atomic.Int64
	requests   atomic.Int64
	replayed   atomic.Int64
	rejected   []string
}

// Run performs one chaos run and returns its report; an error means the run itself
// could not be carried out (a process would not start), not that an invariant failed.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return runSpec(ctx, cfg, chaosSpec(cfg.Seed))
}

// withDefaults checks cfg and returns it with its defaults applied.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.Bin == "" || cfg.Dir == "" {
		return cfg, errors.New("chaos: Bin and Dir are required")
	}
	cfg.Seed = cmp.Or(cfg.Seed, uint64(time.Now().UnixNano()%1e9))
	cfg.Duration = cmp.Or(cfg.Duration, 90*time.Second)
	cfg.Clients = cmp.Or(cfg.Clients, 6)
	cfg.Think = cmp.Or(cfg.Think, 100*time.Millisecond)
	cfg.PoisonRate = cmp.Or(cfg.PoisonRate, 0.02)
	cfg.KillMin = cmp.Or(cfg.KillMin, 500*time.Millisecond)
	cfg.KillMax = cmp.Or(cfg.KillMax, 3*time.Second)
	cfg.DrainTimeout = cmp.Or(cfg.DrainTimeout, 2*time.Minute)
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	return cfg, nil
}

// runSpec performs one chaos run of spec with cfg's defaults applied.
func runSpec(ctx context.Context, cfg Config, spec setupSpec) (*Report, error) {
	r := newRun(cfg, spec)
	defer r.stopAll()
	if err := r.setup(ctx); err != nil {
		return nil, err
	}
	r.logf("seed %d: load and faults for %s with %d clients", cfg.Seed, cfg.Duration, cfg.Clients)

	loadCtx, stopLoad := context.WithTimeout(ctx, cfg.Duration)
	defer stopLoad()
	wait := r.startClients(loadCtx)
	if err := r.faults(loadCtx); err != nil {
		return nil, err
	}
	// Every process up again before the clients finish their last submissions.
	if err := r.ensureRunning(ctx); err != nil {
		return nil, err
	}
	wait()
	r.logf("faults stopped; %d jobs accepted; draining", len(r.accepted))
	rep, err := r.drainAndCheck(ctx)
	if err != nil {
		return nil, err
	}
	rep.Duration = time.Since(r.start).Round(time.Second)
	return rep, nil
}

// newRun returns a run of cfg (defaults applied) with the process set-up spec.
func newRun(cfg Config, spec setupSpec) *run {
	// #nosec G404 -- a seeded, replayable fault schedule (CHAOS_SEED), not a secret.
	return &run{cfg: cfg, spec: spec, rng: rand.New(rand.NewPCG(cfg.Seed, 0x0ce)), start: time.Now(),
		accepted: map[string]string{}, acceptedAt: map[string]time.Time{}, poison: map[string]bool{}}
}

// startClients starts cfg.Clients clients that submit until ctx ends; wait returns
// once each has a final answer for its last job.
func (r *run) startClients(ctx context.Context) (wait func()) {
	var wg sync.WaitGroup
	for c := range r.cfg.Clients {
		rng := rand.New(rand.NewPCG(r.cfg.Seed, uint64(c+1))) // #nosec G404 G115 -- seeded client behaviour, not a secret; c is a small count
		wg.Go(func() { r.client(ctx, c, rng) })
	}
	return wg.Wait
}

func (r *run) logf(format string, args ...any) {
	fmt.Fprintf(r.cfg.Log, "[%6.1fs] %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func (r *run) event(format string, args ...any) {
	e := fmt.Sprintf("%7.2fs %s", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
	r.evMu.Lock()
	r.events = append(r.events, e)
	r.evMu.Unlock()
	fmt.Fprintf(r.cfg.Log, "[%6.1fs] fault: %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func (r *run) proc(name string, env []string, args ...string) *cluster.Proc {
	return &cluster.Proc{Name: name, Bin: r.cfg.Bin, Args: args, Env: env, LogDir: r.cfg.Dir}
}

// setup starts the stores and every process, and migrates.
func (r *run) setup(ctx context.Context) error {
	var err error
	if r.spec.cluster {
		if r.rc, err = cluster.NewRedisCluster(filepath.Join(r.cfg.Dir, "redis-cluster"), 3, 1, "always", 0); err != nil {
			return err
		}
		if err := r.rc.Up(); err != nil {
			return err
		}
		r.redisURL = "redis://" + r.rc.Addrs()[0]
	} else {
		if r.redis, err = cluster.NewRedis(r.cfg.Dir, "always"); err != nil {
			return err
		}
		if err := r.redis.Up(); err != nil {
			return err
		}
		r.redisURL = r.redis.URL
	}
	if r.pg, err = cluster.NewPostgres(r.cfg.Dir); err != nil {
		return err
	}
	if err := r.pg.Up(); err != nil {
		return err
	}
	r.dbURL = r.pg.URL
	migrate := r.proc("migrate", []string{"ONCEFLOW_DATABASE_URL=" + r.dbURL}, "migrate")
	if err := migrate.Start(); err != nil {
		return err
	}
	if code, err := migrate.Wait(time.Minute); err != nil || code != 0 {
		return fmt.Errorf("migrate exited %d (%v); see %s", code, err, migrate.LogPath())
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r.llm = r.proc("fake-llm", nil, append([]string{"fake-llm", "--addr", "127.0.0.1:0"}, r.spec.llmArgs...)...)
	r.sink = r.proc("webhook-sink", nil, "webhook-sink", "--addr", "127.0.0.1:0")
	for _, p := range []*cluster.Proc{r.llm, r.sink} {
		if err := p.Start(); err != nil {
			return err
		}
	}
	addr, err := r.llm.Addr(wctx, "fake-llm listening")
	if err != nil {
		return err
	}
	r.llmURL = "http://" + addr
	if addr, err = r.sink.Addr(wctx, "webhook sink listening"); err != nil {
		return err
	}
	r.sinkURL = "http://" + addr
	apiPort, err := cluster.FreePort()
	if err != nil {
		return err
	}
	r.apiURL = fmt.Sprintf("http://127.0.0.1:%d", apiPort)
	r.env = []string{
		"ONCEFLOW_REDIS_URL=" + r.redisURL, "ONCEFLOW_DATABASE_URL=" + r.dbURL, "ONCEFLOW_PREFIX=chaos",
		fmt.Sprintf("ONCEFLOW_HTTP_ADDR=127.0.0.1:%d", apiPort), "ONCEFLOW_API_KEYS=chaos:" + apiKey,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + r.llmURL + "/v1", "OPENAI_API_KEY=sk-chaos",
		"ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + r.sinkURL + "/hook",
	}
	r.env = append(r.env, r.spec.settings...)
	if r.cfg.Shadow {
		r.env = append(r.env, "ONCEFLOW_SHADOW=summary=gpt-4.1@1")
	}
	if r.rc != nil {
		r.env = append(r.env, "ONCEFLOW_REDIS_CLUSTER_ADDRS="+strings.Join(r.rc.Addrs(), ","),
			fmt.Sprintf("ONCEFLOW_QUEUE_PARTITIONS=%d", clusterPartitions), fmt.Sprintf("ONCEFLOW_REDIS_WAIT_REPLICAS=%d", r.spec.waitReplicas))
	}
	r.serve = r.proc("serve", r.env, "serve")
	r.workers, r.workerURLs = nil, nil
	for i := range r.spec.workers {
		env := r.env
		if r.spec.metrics {
			port, err := cluster.FreePort()
			if err != nil {
				return err
			}
			env = append(slices.Clip(r.env), fmt.Sprintf("ONCEFLOW_METRICS_ADDR=127.0.0.1:%d", port))
			r.workerURLs = append(r.workerURLs, fmt.Sprintf("http://127.0.0.1:%d", port))
		}
		r.workers = append(r.workers, r.proc(fmt.Sprintf("work-%d", i+1), env, "work"))
	}
	r.relay = r.proc("relay", r.env, "relay")
	for _, p := range append([]*cluster.Proc{r.serve, r.relay}, r.workers...) {
		if err := p.Start(); err != nil {
			return err
		}
	}
	_, err = r.serve.WaitLog(wctx, "http listening")
	return err
}

func (r *run) all() []*cluster.Proc {
	return append([]*cluster.Proc{r.serve, r.relay}, r.workers...)
}

// client submits jobs until ctx ends, each retried with the same key and body until a
// final answer, like an SDK with idempotency keys; one in five is sent twice at once.
func (r *run) client(ctx context.Context, id int, rng *rand.Rand) {
	hc := &http.Client{Timeout: 5 * time.Second}
	for n := 0; ctx.Err() == nil; n++ {
		key := fmt.Sprintf("chaos-%d-c%d-%05d", r.cfg.Seed, id, n)
		poison := rng.Float64() < r.cfg.PoisonRate
		text := fmt.Sprintf("Client %d job %d: the customer asks why order %d shipped twice.", id, n, rng.IntN(1_000_000))
		if poison {
			text = strings.Repeat("An oversized attachment. ", maxInput/20)
		}
		body, _ := json.Marshal(map[string]string{"text": text, "notify": fmt.Sprintf("c%d-%d@example.com", id, n)})
		r.jobs.Add(1)
		if rng.IntN(5) == 0 {
			var two sync.WaitGroup
			two.Go(func() { r.submit(ctx, hc, key, body, poison) })
			two.Go(func() { r.submit(ctx, hc, key, body, poison) })
			two.Wait()
		} else {
			r.submit(ctx, hc, key, body, poison)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(2*int64(r.cfg.Think) + 1))):
		}
	}
}

// submit posts one job until it gets a final answer or ctx ends. After ctx ends it keeps
// trying for a while, so no job is left half-submitted by the end of the load phase.
func (r *run) submit(ctx context.Context, hc *http.Client, key string, body []byte, poison bool) {
	giveUp := time.Now().Add(r.cfg.Duration + time.Minute)
	for attempt := 0; time.Now().Before(giveUp); attempt++ {
		req, _ := http.NewRequest(http.MethodPost, r.apiURL+"/v1/summaries", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+apiKey)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		r.requests.Add(1)
		resp, err := hc.Do(req)
		if err == nil {
			var out struct {
				JobID  string `json:"job_id"`
				Detail string `json:"detail"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&out)
			_ = resp.Body.Close()
			switch {
			case resp.StatusCode == http.StatusAccepted:
				if resp.Header.Get("Idempotent-Replayed") == "true" {
					r.replayed.Add(1)
				}
				r.jobsMu.Lock()
				if prev, ok := r.accepted[key]; ok && prev != out.JobID {
					r.mismatch = append(r.mismatch, fmt.Sprintf("%s: %s then %s", key, prev, out.JobID))
				}
				r.accepted[key] = out.JobID
				if _, ok := r.acceptedAt[out.JobID]; !ok {
					r.acceptedAt[out.JobID] = time.Now()
				}
				if poison {
					r.poison[out.JobID] = true
				}
				r.jobsMu.Unlock()
				return
			case resp.StatusCode < 500 && resp.StatusCode != http.StatusConflict:
				r.jobsMu.Lock()
				r.rejected = append(r.rejected, fmt.Sprintf("%s: %d %s", key, resp.StatusCode, out.Detail))
				r.jobsMu.Unlock()
				return
			}
		}
		time.Sleep(time.Duration(min(1000, 50*(attempt+1))) * time.Millisecond)
	}
}

// faults kills processes until ctx ends: every KillMin..KillMax one of the workers, the
// relay or the API gets kill -9 and is restarted after a short pause; Redis is killed
// and restarted once (at 40% of the run) and PostgreSQL restarted in immediate mode once
// (at 70%). On a cluster, a primary is killed instead of Redis, and a partition's slot
// moved instead of the PostgreSQL restart.
func (r *run) faults(ctx context.Context) error {
	var redis, pg func(pause time.Duration) error
	if r.rc != nil {
		redis = func(pause time.Duration) error { return r.killPrimary(ctx, pause) }
		pg = func(time.Duration) error { return r.moveSlot(ctx) }
	} else {
		redis = func(pause time.Duration) error { return killRedis(r.event, r.redis, pause) }
		pg = func(pause time.Duration) error { return crashPostgres(r.event, r.pg, pause) }
	}
	return faultLoop(ctx, r.rng, r.cfg.KillMin, r.cfg.KillMax, r.all(), r.event,
		&onceFault{at: r.start.Add(r.cfg.Duration * 4 / 10), do: redis},
		&onceFault{at: r.start.Add(r.cfg.Duration * 7 / 10), do: pg})
}

// onceFault is a fault that faultLoop makes once, at the first turn after at.
type onceFault struct {
	at   time.Time
	do   func(pause time.Duration) error
	done bool
}

// faultLoop makes faults until ctx ends: every killMin..killMax (drawn from rng) the
// first once fault whose time has come, else kill -9 of a random target, restarted
// after a pause of 0.1 to 0.8 s.
func faultLoop(ctx context.Context, rng *rand.Rand, killMin, killMax time.Duration, targets []*cluster.Proc,
	event func(string, ...any), once ...*onceFault) error {
	for {
		wait := killMin + time.Duration(rng.Int64N(int64(killMax-killMin)+1))
		pause := time.Duration(100+rng.IntN(700)) * time.Millisecond
		target := targets[rng.IntN(len(targets))]
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		i := slices.IndexFunc(once, func(f *onceFault) bool { return !f.done && time.Now().After(f.at) })
		if i >= 0 {
			once[i].done = true
			if err := once[i].do(pause); err != nil {
				return err
			}
			continue
		}
		if err := killProc(event, target, pause); err != nil {
			return err
		}
	}
}

// ensureRunning restarts any process that is not running (one could have exited on its
// own during the faults; that would be a bug worth seeing in its log).
func (r *run) ensureRunning(ctx context.Context) error {
	for _, p := range append(r.all(), r.llm, r.sink) {
		if !p.Running() {
			r.event("%s was not running after the faults (see %s); restarting", p.Name, p.LogPath())
			if err := p.Start(); err != nil {
				return err
			}
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err := r.serve.WaitLog(wctx, "http listening")
	return err
}

func (r *run) audit(ctx context.Context) (*summaries.Report, error) {
	cmd := exec.CommandContext(ctx, r.cfg.Bin, "audit", "--json") // #nosec G204 -- the onceflow binary the chaos run built
	cmd.Env = append(r.env, "PATH=/usr/bin:/bin", "ONCEFLOW_CLAIM_IDLE=4s", "ONCEFLOW_AUDIT_MAX_AGE=10m")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 4) {
		return nil, fmt.Errorf("audit: %v: %s", err, errb.String())
	}
	var a summaries.Report
	if err := json.Unmarshal(out.Bytes(), &a); err != nil {
		return nil, fmt.Errorf("audit output %q: %w", out.String(), err)
	}
	return &a, nil
}

type sinkDelivery struct {
	Key string `json:"idempotency_key"`
}

type sinkStats struct {
	Deliveries   int            `json:"deliveries"`
	DistinctKeys int            `json:"distinct_keys"`
	Duplicates   map[string]int `json:"duplicates"`
	Delivered    []sinkDelivery `json:"delivered"`
}

func getJSON(ctx context.Context, url string, v any) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// drainAndCheck waits until the backlog is gone (or DrainTimeout) and checks the
// invariants.
func (r *run) drainAndCheck(ctx context.Context) (*Report, error) {
	want := len(r.accepted) - len(r.poison)
	deadline := time.Now().Add(r.cfg.DrainTimeout)
	var a *summaries.Report
	var sink sinkStats
	for {
		var err error
		if a, err = r.audit(ctx); err != nil {
			return nil, err
		}
		if err := getJSON(ctx, r.sinkURL+"/", &sink); err != nil {
			return nil, err
		}
		drained := a.Summaries >= int64(want) && a.OutboxUnsent == 0 && a.StreamPending == 0 &&
			a.DLQ >= int64(len(r.poison)) && sink.DistinctKeys >= int(a.Summaries)
		r.logf("drain: summaries %d/%d, unsent %d, pending %d, dead %d, emails %d", a.Summaries, want, a.OutboxUnsent, a.StreamPending, a.DLQ, sink.DistinctKeys)
		if drained || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(time.Second)
	}
	// One more audit once quiet, so a row sent a moment ago is not reported as unsent.
	time.Sleep(500 * time.Millisecond)
	var err error
	if a, err = r.audit(ctx); err != nil {
		return nil, err
	}
	if err := getJSON(ctx, r.sinkURL+"/?deliveries=1", &sink); err != nil {
		return nil, err
	}
	rep, err := r.check(ctx, a, sink)
	if err != nil || !r.cfg.Shadow {
		return rep, err
	}
	return rep, r.checkShadows(ctx, rep)
}

// checkShadows waits for the shadow queue to drain and checks that every summary's
// call has its shadow recorded once (but those the workers logged they could not
// enqueue), and none of a job without a summary.
func (r *run) checkShadows(ctx context.Context, rep *Report) error {
	conn, err := pgx.Connect(ctx, r.dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for _, w := range r.workers {
		rep.ShadowsDropped += w.CountLog("onceflow: shadow run not enqueued; production goes on without it")
	}
	var runs, orphans, summarised int
	deadline := time.Now().Add(r.cfg.DrainTimeout)
	for {
		if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM shadow_runs), (SELECT count(*) FROM summaries),
	(SELECT count(*) FROM shadow_runs s WHERE NOT EXISTS (SELECT 1 FROM summaries m WHERE m.job_id::text = s.job_id))`).Scan(&runs, &summarised, &orphans); err != nil {
			return err
		}
		if runs+rep.ShadowsDropped >= summarised || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	rep.ShadowRuns = runs
	switch {
	case runs > summarised:
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d shadow runs for %d summaries: a call shadowed twice", runs, summarised))
	case runs+rep.ShadowsDropped < summarised:
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d shadow runs and %d dropped for %d summaries: shadows lost", runs, rep.ShadowsDropped, summarised))
	}
	if orphans > 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d shadow runs of jobs without a summary", orphans))
	}
	return nil
}

func (r *run) check(ctx context.Context, a *summaries.Report, sink sinkStats) (*Report, error) {
	rep := &Report{Seed: r.cfg.Seed, Jobs: int(r.jobs.Load()), Accepted: len(r.accepted), Poison: len(r.poison),
		Requests: r.requests.Load(), Replayed: r.replayed.Load(), Summaries: a.Summaries, DeadLettered: a.DLQ,
		Deliveries: sink.Deliveries, DistinctKeys: sink.DistinctKeys, Events: r.events}
	for _, n := range sink.Duplicates {
		rep.DuplicateDeliveries += n - 1
	}
	violate := func(format string, args ...any) {
		rep.Violations = append(rep.Violations, fmt.Sprintf(format, args...))
	}
	for _, v := range a.Violations {
		violate("audit: %s", v)
	}
	if len(r.mismatch) > 0 {
		violate("keys answered with two job ids: %s", clip(r.mismatch))
	}
	if len(r.rejected) > 0 {
		violate("requests refused with a 4xx: %s", clip(r.rejected))
	}
	if a.OutboxExhausted != 0 {
		violate("%d outbox rows exhausted", a.OutboxExhausted)
	}

	// Summaries, dead letters and deliveries, job by job.
	hasSummary, err := r.summaryCounts(ctx)
	if err != nil {
		return nil, err
	}
	delivered := deliveriesByJob(sink)
	letters, err := r.deadLetters(ctx)
	if err != nil {
		return nil, err
	}
	dead := map[string]bool{}
	for _, d := range letters {
		dead[d.JobID] = true
	}
	var noSummary, twoSummaries, noEmail, wrongDead, notDead []string
	for _, id := range r.accepted {
		switch {
		case r.poison[id]:
			if !dead[id] {
				notDead = append(notDead, id)
			}
		case hasSummary[id] == 0 && r.rc != nil && r.spec.waitReplicas == 0:
			rep.Lost++ // the loss window without WAIT: measured
		case hasSummary[id] == 0:
			noSummary = append(noSummary, id)
		case hasSummary[id] > 1:
			twoSummaries = append(twoSummaries, id)
		case delivered[id] == 0:
			noEmail = append(noEmail, id)
		}
	}
	for id := range dead {
		if !r.poison[id] {
			wrongDead = append(wrongDead, id)
		}
	}
	var strayEmail, summaryNoEmail []string
	for id := range delivered {
		if hasSummary[id] == 0 {
			strayEmail = append(strayEmail, id)
		}
	}
	// A summary of a job whose 202 never reached its client is possible (the API was
	// killed after the accept script ran and the client then gave up); it must still
	// have its email.
	for id := range hasSummary {
		if delivered[id] == 0 {
			summaryNoEmail = append(summaryNoEmail, id)
		}
	}
	for _, c := range []struct {
		ids  []string
		what string
	}{
		{noSummary, "accepted jobs without a summary"},
		{twoSummaries, "jobs with more than one summary"},
		{noEmail, "accepted jobs without a delivered email"},
		{summaryNoEmail, "summaries without a delivered email"},
		{strayEmail, "emails without a summary"},
		{notDead, "poison jobs not dead-lettered"},
		{wrongDead, "dead-lettered jobs that were not poison"},
	} {
		if len(c.ids) > 0 {
			slices.Sort(c.ids)
			violate("%s (%d): %s", c.what, len(c.ids), clip(c.ids))
		}
	}

	var llm struct {
		Requests int64 `json:"requests"`
	}
	if err := getJSON(ctx, r.llmURL+"/stats", &llm); err == nil {
		rep.ModelRequests = llm.Requests
	}
	for _, w := range r.workers {
		rep.Redelivered += w.CountLog("summary exists: duplicate delivery acknowledged") +
			w.CountLog("a concurrent delivery stored the summary first: duplicate")
	}
	return rep, nil
}

// summaryCounts returns the number of summary rows of each job id.
func (r *run) summaryCounts(ctx context.Context) (map[string]int, error) {
	conn, err := pgx.Connect(ctx, r.dbURL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT job_id::text FROM summaries`)
	if err != nil {
		return nil, err
	}
	summarised, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	n := map[string]int{}
	for _, id := range summarised {
		n[id]++
	}
	return n, nil
}

// deliveriesByJob counts the sink's deliveries per job id (its dedupe key is
// "summary_ready:" and the job id).
func deliveriesByJob(sink sinkStats) map[string]int {
	delivered := map[string]int{}
	for _, d := range sink.Delivered {
		delivered[strings.TrimPrefix(d.Key, "summary_ready:")]++
	}
	return delivered
}

// deadLetters lists the summaries queue's dead-letter streams (of every partition on a
// cluster).
func (r *run) deadLetters(ctx context.Context) ([]queue.DeadLetter, error) {
	rdb := r.redisClient()
	defer rdb.Close()
	parts := 1
	if r.rc != nil {
		parts = clusterPartitions
	}
	var all []queue.DeadLetter
	for _, keys := range (queue.Keys{Prefix: "chaos", Queue: summaries.QueueName}).Partitions(parts) {
		for start := "-"; start != ""; {
			page, next, err := queue.ListDead(ctx, rdb, keys, start, 1000)
			if err != nil {
				return nil, err
			}
			all = append(all, page...)
			start = next
		}
	}
	return all, nil
}

// redisClient returns a client of the run's Redis: its cluster's, or the one server's.
func (r *run) redisClient() redis.UniversalClient {
	if r.rc != nil {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: r.rc.Addrs()})
	}
	return redis.NewClient(&redis.Options{Addr: strings.TrimSuffix(strings.TrimPrefix(r.redisURL, "redis://"), "/0")})
}

func clip(ids []string) string {
	if len(ids) > 10 {
		return strings.Join(ids[:10], ", ") + fmt.Sprintf(" and %d more", len(ids)-10)
	}
	return strings.Join(ids, ", ")
}

// stopAll stops every process, the stores last.
func (r *run) stopAll() {
	for _, p := range append(r.all(), r.llm, r.sink) {
		if p != nil {
			p.Stop(10 * time.Second)
		}
	}
	if r.pg != nil {
		r.pg.Down()
	}
	if r.redis != nil {
		r.redis.Down()
	}
	if r.rc != nil {
		r.rc.Kill()
	}
}
