// Command demo is `make demo`: onceflow end to end on real Redis and PostgreSQL, with
// real processes. It starts `onceflow fake-llm` with 429 and 503 faults, a webhook sink
// that counts deliveries per dedupe key, and `onceflow run` pointed at both; then it sends
// a burst of jobs over HTTP the way clients with idempotency keys do (retries of the same
// key, some of them concurrent, some with a lost response), a few oversized texts that the
// model refuses with a 400, shows progress while the jobs drain, prints a table of effect
// counts and stops everything it started.
//
// It expects ONCEFLOW_REDIS_URL and ONCEFLOW_DATABASE_URL (scripts/demo exports them) and
// uses a Redis prefix and a PostgreSQL schema of its own, dropped at the end.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/queue"
)

const (
	apiKey    = "demo-key-0123456789abcdef"
	maxInput  = 4000 // fake-llm answers 400 context_length_exceeded above this
	drainWait = 45 * time.Second
	// batchDelay is how long fake-llm takes to end a batch (--lane batch).
	batchDelay = 2 * time.Second
)

func main() {
	jobs := flag.Int("jobs", 240, "distinct jobs to submit")
	poison := flag.Int("poison", 4, "of which oversized texts the model refuses (400)")
	bin := flag.String("bin", "bin/onceflow", "the onceflow binary")
	keep := flag.Bool("keep", false, "keep the demo's Redis keys and PostgreSQL schema")
	onCluster := flag.Bool("cluster", false, "run on a local Redis Cluster of its own (3 primaries, 3 replicas; the queue in 3 partitions, WAIT 1 on every accept)")
	lane := flag.String("lane", "sync", "the summaries' lane: sync, or batch (every model call through fake-llm's OpenAI Batch API, exactly once)")
	flag.Parse()
	if *lane != "sync" && *lane != "batch" {
		fmt.Fprintf(os.Stderr, "demo: --lane %q: want sync or batch\n", *lane)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *bin, *jobs, *poison, *keep, *onCluster, *lane == "batch"); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// demo holds what the run started.
type demo struct {
	redisURL, dbURL, prefix, schema, dsn string
	logDir                               string
	procs                                []*cluster.Proc
	api, llmURL, sinkURL                 string
	// clusterAddrs are the nodes of the demo's own Redis Cluster (--cluster), else nil.
	clusterAddrs []string
	// batch sends the summaries' model calls through the batch lane (--lane batch).
	batch bool
}

// demoPartitions is the summaries queue's partitions on the demo's cluster.
const demoPartitions = 3

// redis returns a client of the demo's Redis: its cluster, or ONCEFLOW_REDIS_URL's.
func (d *demo) redis() (redis.UniversalClient, error) {
	if d.clusterAddrs != nil {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: d.clusterAddrs}), nil
	}
	opt, err := redis.ParseURL(d.redisURL)
	if err != nil {
		return nil, err
	}
	return redis.NewClient(opt), nil
}

func run(ctx context.Context, bin string, jobs, poison int, keep, onCluster, batch bool) error {
	start := time.Now()
	d := &demo{redisURL: os.Getenv("ONCEFLOW_REDIS_URL"), dbURL: os.Getenv("ONCEFLOW_DATABASE_URL"), batch: batch}
	if d.redisURL == "" || d.dbURL == "" {
		return fmt.Errorf("ONCEFLOW_REDIS_URL and ONCEFLOW_DATABASE_URL must be set: run `make demo`")
	}
	stamp := time.Now().Format("150405")
	d.prefix, d.schema = "demo"+stamp, "demo_"+stamp
	d.logDir = filepath.Join(".dev", "demo-logs", stamp)
	defer d.stopAll()
	if onCluster {
		dir := filepath.Join(".dev", "demo-cluster", stamp)
		c, err := cluster.NewRedisCluster(dir, 3, 1, "everysec", 0)
		if err != nil {
			return fmt.Errorf("redis cluster: %w", err)
		}
		// The cluster goes whole at the end, --keep or not (it is the demo's own).
		defer func() { c.Kill(); _ = os.RemoveAll(dir) }()
		if err := c.Up(); err != nil {
			return fmt.Errorf("redis cluster: %w", err)
		}
		d.clusterAddrs = c.Addrs()
		fmt.Printf("Redis Cluster: 3 primaries with a replica each on %s; the queue in %d partitions, WAIT 1 on every accept\n",
			strings.Join(d.clusterAddrs, " "), demoPartitions)
	}
	if !keep {
		defer d.cleanup()
	}
	if err := d.setup(ctx); err != nil {
		return err
	}
	if err := d.startProcs(ctx, bin); err != nil {
		return err
	}
	fmt.Printf("onceflow run on %s, fake-llm (10%% 429 with Retry-After 1s, 5%% 503) on %s, webhook sink on %s\n",
		d.api, d.llmURL, d.sinkURL)
	if batch {
		fmt.Printf("the batch lane: every summary's model call goes in a batch of fake-llm's OpenAI Batch API (ended after %s), sent once a second\n", batchDelay)
	}
	fmt.Printf("logs: %s\n\n", d.logDir)

	fmt.Printf("submitting %d jobs (%d oversized) with retries of the same keys ...\n", jobs, poison)
	res := d.burst(ctx, jobs, poison)
	fmt.Printf("accepted %d jobs (%d requests: %d replayed, %d answered 5xx or lost and retried)\n\n",
		len(res.jobIDs), res.requests.Load(), res.replayed.Load(), res.retried.Load())

	want := len(res.jobIDs) - poison
	final, err := d.drain(ctx, want, poison)
	if err != nil {
		return err
	}
	return d.report(res, final, want, poison, time.Since(start))
}

// setup makes the demo's schema and migrates it.
func (d *demo) setup(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, d.dbURL)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+d.schema); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	u, err := url.Parse(d.dbURL)
	if err != nil {
		return err
	}
	q := u.Query()
	q.Set("search_path", d.schema)
	u.RawQuery = q.Encode()
	d.dsn = u.String()
	_, err = migrations.Up(ctx, d.dsn, slog.New(slog.NewTextHandler(io.Discard, nil)))
	return err
}

func (d *demo) proc(name, bin string, env []string, args ...string) *cluster.Proc {
	p := &cluster.Proc{Name: name, Bin: bin, Args: args, Env: env, LogDir: d.logDir}
	d.procs = append(d.procs, p)
	return p
}

func (d *demo) startProcs(ctx context.Context, bin string) error {
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	llm := d.proc("fake-llm", bin, nil, "fake-llm", "--addr", "127.0.0.1:0",
		"--fail-429", "0.10", "--retry-after", "1", "--fail-503", "0.05",
		"--max-input-chars", fmt.Sprint(maxInput), "--seed", "7", "--batch-delay", batchDelay.String())
	sink := d.proc("webhook-sink", bin, nil, "webhook-sink", "--addr", "127.0.0.1:0")
	for _, p := range []*cluster.Proc{llm, sink} {
		if err := p.Start(); err != nil {
			return err
		}
	}
	addr, err := llm.Addr(wctx, "fake-llm listening")
	if err != nil {
		return err
	}
	d.llmURL = "http://" + addr
	if addr, err = sink.Addr(wctx, "webhook sink listening"); err != nil {
		return err
	}
	d.sinkURL = "http://" + addr
	run := d.proc("onceflow-run", bin, []string{
		"ONCEFLOW_REDIS_URL=" + d.redisURL, "ONCEFLOW_DATABASE_URL=" + d.dsn, "ONCEFLOW_PREFIX=" + d.prefix,
		"ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_API_KEYS=demo:" + apiKey,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + d.llmURL + "/v1", "OPENAI_API_KEY=sk-demo",
		"ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + d.sinkURL + "/hook",
		"ONCEFLOW_WORKER_CONCURRENCY=128", "ONCEFLOW_CLAIM_IDLE=20s", "ONCEFLOW_JOB_BUDGET=15s",
		"ONCEFLOW_LLM_TIMEOUT=5s", "ONCEFLOW_RELAY_INTERVAL=100ms", "ONCEFLOW_SHUTDOWN_TIMEOUT=10s",
	}, "run")
	if d.batch {
		run.Env = append(run.Env, "ONCEFLOW_SUMMARIES_LANE=batch", "ONCEFLOW_BATCH_MAX_ITEMS=100", "ONCEFLOW_BATCH_MAX_AGE=1s",
			"ONCEFLOW_BATCH_POLL_INTERVAL=250ms")
	}
	if d.clusterAddrs != nil {
		run.Env = append(run.Env, "ONCEFLOW_REDIS_CLUSTER_ADDRS="+strings.Join(d.clusterAddrs, ","),
			fmt.Sprintf("ONCEFLOW_QUEUE_PARTITIONS=%d", demoPartitions), "ONCEFLOW_REDIS_WAIT_REPLICAS=1")
	}
	if err := run.Start(); err != nil {
		return err
	}
	if addr, err = run.Addr(wctx, "http listening"); err != nil {
		return err
	}
	d.api = "http://" + addr
	return nil
}

// burstResult is what the clients saw.
type burstResult struct {
	mu                          sync.Mutex
	jobIDs                      map[string]string // key -> job id
	mismatched                  []string          // keys that got two job ids
	requests, replayed, retried atomic.Int64
}

// burst submits jobs the way a client SDK with idempotency keys does: one key per job,
// retried with the same key and body until a final answer; a third of the jobs are sent
// again after their 202 (a retry whose first response was lost), and a fifth are sent
// twice at once (a double click).
func (d *demo) burst(ctx context.Context, jobs, poison int) *burstResult {
	res := &burstResult{jobIDs: map[string]string{}}
	client := &http.Client{Timeout: 10 * time.Second}
	rng := rand.New(rand.NewPCG(1, 2)) // #nosec G404 -- a fixed, replayable mix of client behaviour
	type job struct {
		key  string
		body []byte
		dup  int // extra sends after the first answer
		dbl  bool
	}
	var all []job
	for i := range jobs {
		text := fmt.Sprintf("Ticket %d: the customer reports that invoices for March were sent twice and asks for a refund of the duplicate charge.", i)
		if i < poison {
			text = strings.Repeat("An oversized attachment. ", maxInput/20)
		}
		body, _ := json.Marshal(map[string]string{"text": text, "notify": fmt.Sprintf("customer%d@example.com", i)})
		all = append(all, job{key: fmt.Sprintf("demo-%s-job-%04d", d.prefix, i), body: body,
			dup: map[bool]int{true: 1 + rng.IntN(2), false: 0}[rng.IntN(3) == 0], dbl: rng.IntN(5) == 0})
	}
	send := func(j job) {
		for attempt := 0; ; attempt++ {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.api+"/v1/summaries", bytes.NewReader(j.body))
			req.Header.Set("Authorization", "Bearer "+apiKey)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", j.key)
			res.requests.Add(1)
			resp, err := client.Do(req)
			if err == nil && resp.StatusCode < 500 && resp.StatusCode != http.StatusConflict {
				var out struct {
					JobID string `json:"job_id"`
				}
				_ = json.NewDecoder(resp.Body).Decode(&out)
				_ = resp.Body.Close()
				if resp.Header.Get("Idempotent-Replayed") == "true" {
					res.replayed.Add(1)
				}
				res.mu.Lock()
				if prev, ok := res.jobIDs[j.key]; ok && prev != out.JobID {
					res.mismatched = append(res.mismatched, j.key)
				}
				res.jobIDs[j.key] = out.JobID
				res.mu.Unlock()
				return
			}
			if resp != nil {
				_ = resp.Body.Close()
			}
			if ctx.Err() != nil || attempt > 20 {
				return
			}
			res.retried.Add(1)
			time.Sleep(time.Duration(50*(attempt+1)) * time.Millisecond)
		}
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for _, j := range all {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if j.dbl {
				var two sync.WaitGroup
				two.Go(func() { send(j) })
				two.Go(func() { send(j) })
				two.Wait()
			} else {
				send(j)
			}
			for range j.dup {
				send(j)
			}
		})
	}
	wg.Wait()
	return res
}

// counts are the effects, read from the stores and the fakes.
type counts struct {
	summaries, outboxSent, dead int64
	deliveries, distinctKeys    int
	duplicatedKeys              int
	modelRequests, faults       int64
	badRequests                 int64
	// The batch lane's: batches created, requests submitted in them, custom_ids
	// submitted more than once, and chat completions asked synchronously.
	batches, batchRequests int64
	batchDuplicates        int
	syncCompletions        int64
}

func (d *demo) read(ctx context.Context) (counts, error) {
	var c counts
	conn, err := pgx.Connect(ctx, d.dsn)
	if err != nil {
		return c, err
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM summaries), (SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL)`).Scan(&c.summaries, &c.outboxSent); err != nil {
		return c, err
	}
	rdb, err := d.redis()
	if err != nil {
		return c, err
	}
	defer rdb.Close()
	for _, keys := range (queue.Keys{Prefix: d.prefix, Queue: "summaries"}).Partitions(demoPartitions) {
		n, err := rdb.XLen(ctx, keys.Dead()).Result()
		if err != nil {
			return c, err
		}
		c.dead += n
	}
	var sink struct {
		Deliveries   int            `json:"deliveries"`
		DistinctKeys int            `json:"distinct_keys"`
		Duplicates   map[string]int `json:"duplicates"`
	}
	if err := getJSON(ctx, d.sinkURL+"/", &sink); err != nil {
		return c, err
	}
	c.deliveries, c.distinctKeys, c.duplicatedKeys = sink.Deliveries, sink.DistinctKeys, len(sink.Duplicates)
	var llm struct {
		Requests        int64            `json:"requests"`
		ByStatus        map[string]int64 `json:"by_status"`
		ByFault         map[string]int64 `json:"by_fault"`
		ByEndpoint      map[string]int64 `json:"by_endpoint"`
		BatchByCustomID map[string]int64 `json:"batch_by_custom_id"`
		BatchesCreated  map[string]int64 `json:"batches_created"`
	}
	if err := getJSON(ctx, d.llmURL+"/stats", &llm); err != nil {
		return c, err
	}
	c.modelRequests, c.badRequests = llm.Requests, llm.ByStatus["400"]
	c.batches, c.syncCompletions = llm.BatchesCreated["openai"], llm.ByEndpoint["chat_completions"]
	for _, n := range llm.BatchByCustomID {
		c.batchRequests += n
		if n > 1 {
			c.batchDuplicates++
		}
	}
	for _, n := range llm.ByFault {
		c.faults += n
	}
	return c, nil
}

// drain shows progress until every accepted job has its email and every poison job is
// dead-lettered, or drainWait passes.
func (d *demo) drain(ctx context.Context, want, poison int) (counts, error) {
	deadline := time.Now().Add(drainWait)
	for {
		c, err := d.read(ctx)
		if err != nil {
			return c, err
		}
		fmt.Printf("\r  draining: %3d/%d summaries, %3d emails delivered, %d dead-lettered, %d model requests   ",
			c.summaries, want, c.distinctKeys, c.dead, c.modelRequests)
		done := c.summaries >= int64(want) && c.distinctKeys >= want && c.dead >= int64(poison) && c.outboxSent >= int64(want)
		if done || time.Now().After(deadline) || ctx.Err() != nil {
			fmt.Println()
			return c, ctx.Err()
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func (d *demo) report(res *burstResult, c counts, want, poison int, took time.Duration) error {
	fmt.Println()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	row := func(name string, v any, note string) { fmt.Fprintf(tw, "%s\t%6v\t%s\n", name, v, note) }
	row("jobs accepted (distinct job ids)", len(res.jobIDs), fmt.Sprintf("of which %d oversized", poison))
	row("POSTs sent", res.requests.Load(), "retries of the same keys included")
	row("replayed duplicates", res.replayed.Load(), "answered from the stored response: Idempotent-Replayed: true")
	row("model requests", c.modelRequests, fmt.Sprintf("%d injected 429/503 faults retried, %d refused with 400", c.faults, c.badRequests))
	row("summaries", c.summaries, "one per job (PRIMARY KEY job_id)")
	row("emails: distinct dedupe keys", c.distinctKeys, "")
	row("emails: deliveries", c.deliveries, fmt.Sprintf("%d keys delivered more than once (same key: deduped by the provider)", c.duplicatedKeys))
	row("dead-lettered", c.dead, "the oversized texts, after one model call each")
	if d.batch {
		row("batches created", c.batches, fmt.Sprintf("%d requests in them; %d submitted twice", c.batchRequests, c.batchDuplicates))
		row("synchronous chat completions", c.syncCompletions, "the oversized texts' fallback after their batch items failed")
	}
	_ = tw.Flush()
	fmt.Println()
	var broke []string
	if len(res.mismatched) > 0 {
		broke = append(broke, fmt.Sprintf("%d keys got two different job ids", len(res.mismatched)))
	}
	if int(c.summaries) != want {
		broke = append(broke, fmt.Sprintf("%d summaries for %d jobs", c.summaries, want))
	}
	if c.distinctKeys != want {
		broke = append(broke, fmt.Sprintf("%d distinct emails for %d jobs", c.distinctKeys, want))
	}
	if int(c.dead) != poison || int(c.badRequests) != poison {
		broke = append(broke, fmt.Sprintf("%d dead-lettered and %d model 400s for %d oversized texts", c.dead, c.badRequests, poison))
	}
	if d.batch && (c.batchDuplicates > 0 || c.batchRequests != int64(want+poison) || c.syncCompletions != int64(poison)) {
		broke = append(broke, fmt.Sprintf("the batch lane: %d requests in batches for %d jobs, %d submitted twice, %d synchronous calls for %d oversized texts",
			c.batchRequests, want+poison, c.batchDuplicates, c.syncCompletions, poison))
	}
	if len(broke) > 0 {
		fmt.Printf("verdict: BROKEN: %s (logs in %s)\n", strings.Join(broke, "; "), d.logDir)
		return fmt.Errorf("effects do not add up")
	}
	fmt.Printf("verdict: one email per job (%d jobs in %.1fs)\n", want, took.Seconds())
	return nil
}

func (d *demo) stopAll() {
	for i := len(d.procs) - 1; i >= 0; i-- {
		d.procs[i].Stop(15 * time.Second)
	}
}

func (d *demo) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, d.dbURL); err == nil {
		_, _ = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+d.schema+" CASCADE")
		_ = conn.Close(ctx)
	}
	if opt, err := redis.ParseURL(d.redisURL); err == nil && d.clusterAddrs == nil { // a cluster of its own goes whole
		rdb := redis.NewClient(opt)
		iter := rdb.Scan(ctx, 0, d.prefix+":*", 1000).Iterator()
		for iter.Next(ctx) {
			_ = rdb.Unlink(ctx, iter.Val()).Err() // best effort: the demo's own keys
		}
		_ = rdb.Close()
	}
}

func getJSON(ctx context.Context, u string, v any) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", u, resp.Status)
	}
	return json.Unmarshal(b, v)
}
