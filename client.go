package onceflow

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// Defaults of Config and QueueConfig.
const (
	// DefaultQueue is the queue of a kind that names none.
	DefaultQueue = "default"
	// DefaultPrefix starts every Redis key.
	DefaultPrefix = "onceflow"
	// DefaultJobBudget is the deadline of one delivery's model calls, across attempts and
	// sleeps (Config.JobBudget).
	DefaultJobBudget = 60 * time.Second
	// DefaultResultTTL is how long an idempotency key is remembered (a duplicate enqueue
	// or POST replays the first answer) and how long a finished job's index is kept.
	DefaultResultTTL = 24 * time.Hour
	// DefaultModelFailureProbe is how often the model's breaker, opened by a run of
	// failing calls (a 503 window), lets one call probe the provider
	// (Config.ModelFailureProbe).
	DefaultModelFailureProbe = 10 * time.Second
	// DefaultHealthInterval is how often the workers' process checks Redis and
	// PostgreSQL, and probes one whose breaker is open (Config.HealthInterval).
	DefaultHealthInterval = time.Second
)

// Config configures a Client. Redis is required; the other fields have defaults.
type Config struct {
	// Redis holds the queues and the idempotency records: a *redis.Client or
	// *redis.ClusterClient whose options CheckRedis accepts. Required.
	Redis redis.UniversalClient
	// DB is the PostgreSQL pool of the job completion records, the outbox and the model
	// ledger (onceflow's tables, created by the migrations package, beside the user's
	// own). Required for Job.Commit, EnqueueTx, JobState of finished jobs, model calls
	// and senders; a Client without it only enqueues and runs jobs.
	DB *pgxpool.Pool
	// Prefix starts every Redis key (ONCEFLOW_PREFIX). Default: DefaultPrefix.
	Prefix string
	// Queues are the queues Run works, by name; a queue not listed can still be enqueued
	// to (another process may work it). Set, it is the whole list (a process that works
	// some queues only). Default: the queues Workflows declare, plus the queue of every
	// registered kind (DefaultQueue for a kind that names none, JobArgsWithOpts), with
	// default settings; DefaultQueue alone when that is nothing.
	Queues map[string]QueueConfig
	// QueueDefaults are the settings of every queue (Queues, Workflows' and the kinds')
	// where its own QueueConfig leaves them zero: Concurrency, ClaimIdle,
	// MaxDeliveries, ShutdownTimeout, StatsInterval and DeadLetterRetention (the onceflow
	// command sets them from ONCEFLOW_*). Default: none (queue's defaults).
	QueueDefaults QueueConfig
	// Workers holds the Worker of each kind. A job of a kind without one fails with
	// ErrUnknownKind, spending a delivery: retried after ClaimIdle (another process, a
	// newer version in a rolling deploy, may know the kind), it is dead-lettered after
	// the queue's MaxDeliveries, the reason naming the kind. Default: none (an
	// enqueue-only Client).
	Workers *Workers
	// Middleware wraps every job run, the first the outermost. Default: none.
	Middleware []Middleware
	// Workflows are the program's workflows: NewClient merges their queues, workers and
	// senders into this Config, Client.Mount mounts their routes (see Workflow).
	// Default: none.
	Workflows []Workflow

	// Senders deliver the effects jobs commit (Commit.Emit), by topic: a key is a topic
	// ("payments.refund") or a prefix ending in "." or "*" ("email." or "email.*"); the
	// exact topic, else the longest prefix, wins. Run runs the outbox relay whenever DB
	// is set (it also sends EnqueueTx's jobs); it claims only the topics it has senders
	// for, so an effect whose topic has no sender here waits in the outbox, never tried
	// nor exhausted, for a process that has one (and audit reports it). Keys may not
	// start with "onceflow.". Default: none.
	Senders map[string]outbox.Sender
	// Relay configures the outbox relay (lease, batch, attempts, backoff); its Logger
	// and Registerer default to the client's. Default: outbox's defaults.
	Relay outbox.Config

	// Model is the language model Job.Complete and Job.Stream call, through the
	// llm_calls ledger (a recorded answer is never asked for twice), under ModelRetry,
	// the per-call timeout and the delivery's JobBudget. Default: none (those methods
	// fail permanently).
	Model llm.Client
	// Provider names the model's provider in ledger rows and metrics ("openai").
	// Default: "llm".
	Provider string
	// ModelRetry is the in-process retry policy of model calls: attempts, per-call
	// timeout (ONCEFLOW_LLM_TIMEOUT), backoff. Zero fields take package retry's
	// defaults.
	ModelRetry retry.Policy
	// Ledger configures the llm_calls ledger (lease, retention); its Logger and
	// Registerer default to the client's. Default: ledger's defaults.
	Ledger ledger.Config
	// Limits is the admission control of the model's calls (package limiter, see
	// docs/limits.md): limits per model shared by every process (requests and tokens per
	// minute, calls in flight: ONCEFLOW_LLM_RPM, _TPM, _CONCURRENCY, ONCEFLOW_LLM_LIMITS),
	// learnt from the provider's rate-limit headers where not configured; a 429 pauses
	// the model for every process; tenants share the capacity fairly
	// (ONCEFLOW_TENANT_CONCURRENCY caps one) and spend daily token budgets
	// (ONCEFLOW_TENANT_TOKEN_BUDGET, and tenant_budgets rows when DB is set). A job whose
	// call must wait holds its worker at most Limits.MaxWait, then waits in its queue's
	// scheduled set without spending an attempt, its reason in JobState.Waiting. Its
	// Prefix, Provider, Logger and Registerer default to the client's, and Budgets to the
	// tenant_budgets table when DB is set. Default: on, with nothing configured (only
	// what the provider's headers teach, and its 429s).
	Limits limiter.Config
	// NoLimits turns the limiter off (ONCEFLOW_LLM_ADMISSION=off): every process then
	// meets the provider's limits on its own, retrying its own 429s. Default: false.
	NoLimits bool
	// QuotaProbe is how often, while the model's breaker is open (an exhausted quota, a
	// run of failures), one call probes whether the provider is back
	// (ONCEFLOW_LLM_QUOTA_PROBE); meanwhile the queues take no work. Default:
	// breaker.DefaultProbeInterval (1m).
	QuotaProbe time.Duration
	// BreakerThreshold is how many transient failures of a dependency in a row, across
	// jobs, open its circuit breaker (ONCEFLOW_BREAKER_THRESHOLD): failing health
	// checks of Redis or PostgreSQL, commits and ledger calls that found PostgreSQL
	// unreachable, model calls that failed with a 5xx, a timeout or a lost connection
	// after their retries. See Client.Breakers. Default: breaker.DefaultThreshold (5).
	BreakerThreshold int
	// HealthInterval is how often Run and RunWorkers check Redis (PING) and PostgreSQL
	// (a pool ping), and, while one's breaker is open, probe it; a passing probe closes
	// the breaker (ONCEFLOW_HEALTH_INTERVAL). Default: DefaultHealthInterval (1s).
	HealthInterval time.Duration
	// ModelFailureProbe is how often the model's breaker, once a run of
	// BreakerThreshold failing calls opened it, lets one call probe the provider (an
	// exhausted quota is probed every QuotaProbe instead). Default:
	// DefaultModelFailureProbe (10s).
	ModelFailureProbe time.Duration
	// JobBudget is the deadline of one delivery's model calls (Job.Complete and
	// Job.Stream), across their attempts and backoff sleeps, counted from the start of
	// the delivery (ONCEFLOW_JOB_BUDGET). It does not cancel the Worker's context: a
	// Worker that needs a deadline for its own calls sets one (context.WithTimeout), and
	// Commit still runs after the budget is spent. Default: DefaultJobBudget (60s).
	JobBudget time.Duration
	// ResultTTL is how long an idempotency key is remembered and a finished job's index
	// kept (ONCEFLOW_RESULT_TTL). Default: DefaultResultTTL (24h).
	ResultTTL time.Duration
	// WaitReplicas, above 0, answers an accepted POST (and a keyed Enqueue) only once that many
	// Redis replicas confirmed its write (WAIT, in the same round trip;
	// ONCEFLOW_REDIS_WAIT_REPLICAS), so a failover cannot lose an accepted job; fewer in
	// WaitTimeout (ONCEFLOW_REDIS_WAIT_TIMEOUT, default 1s) is an error (503). See
	// redisstore.Config.WaitReplicas. Default: 0.
	WaitReplicas int
	WaitTimeout  time.Duration
	// TraceParent returns the W3C traceparent a job enqueued from ctx carries (the
	// onceflowotel package provides one). Default: none.
	TraceParent func(ctx context.Context) string
	// AuditMaxAge is how long an outbox row may stay unsent, or exhausted, before
	// Client.Audit reports it (ONCEFLOW_AUDIT_MAX_AGE). Default: DefaultAuditMaxAge (10m).
	AuditMaxAge time.Duration
	// Logger receives the client's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer exports the metrics of every part the client runs: the queues' workers,
	// the outbox relay, the model calls (llmmetrics, counted inside the ledger: do not
	// wrap Config.Model in llmmetrics yourself), the ledger, the breakers (Breakers), and the jobs
	// Enqueue, EnqueueTx's relay and Route add (onceflow_queue_enqueued_total, replays
	// not counted). Default: nil, not exported.
	Registerer prometheus.Registerer
}

// QueueConfig configures one queue's workers in this process.
type QueueConfig struct {
	// Concurrency is the most jobs of this queue run at once in this process
	// (ONCEFLOW_WORKER_CONCURRENCY). Default: queue.DefaultConcurrency (64).
	Concurrency int
	// ClaimIdle is how long a job may stay unacknowledged without a renewal before
	// another worker takes it over (ONCEFLOW_CLAIM_IDLE). Default: queue.DefaultClaimIdle.
	ClaimIdle time.Duration
	// MaxDeliveries is a job's budget of failed attempts (ONCEFLOW_MAX_DELIVERIES): a run
	// whose Worker failed on the job spends one, and so does a delivery that never
	// reported (its process died); an outage (Unavailable), a snooze and a shutdown
	// spend none. The failure that spends the last dead-letters the job, unless its
	// completion record says it completed. Default: queue.DefaultMaxDeliveries (5).
	MaxDeliveries int
	// RetryBase and RetryMax bound the full-jitter wait before the attempt after a
	// failure (ONCEFLOW_RETRY_BASE, ONCEFLOW_RETRY_MAX); a failure's Retry-After wins.
	// Defaults: queue.DefaultRetryBase (1s), queue.DefaultRetryMax (5m).
	RetryBase, RetryMax time.Duration
	// MaxRunTime bounds one run of a job (ONCEFLOW_MAX_RUN_TIME): its context is
	// cancelled, its lease lapses, and the run is a failed attempt. Negative: none.
	// Default: queue.DefaultMaxRunTime (15m).
	MaxRunTime time.Duration
	// RecordSuccesses adds each successful run's consumer and times to its job's
	// history, as the operator UI's job page shows it (ONCEFLOW_RECORD_SUCCESSES; see
	// queue.WorkerConfig.RecordSuccesses for its cost). Set in QueueDefaults, it holds
	// for every queue. Default: false.
	RecordSuccesses bool
	// Partitions is the queue's partitions (ONCEFLOW_QUEUE_PARTITIONS), 1 to
	// queue.MaxPartitions: each has a hash tag of its own (queue.Keys), so on a Redis
	// Cluster the queue's jobs spread over the nodes. A job's partition is
	// queue.PartitionOf its id, derived from its idempotency key when it has one. Run
	// consumes every partition, with one reader per partition sharing Concurrency, and
	// also those a higher count recorded before (queue.RegisterPartitions); ordering
	// holds within a partition only. Set in QueueDefaults, it holds for every queue,
	// also those the Client only enqueues to. See docs/queue.md, "Partitions".
	// Default: 1.
	Partitions int
	// ShutdownTimeout is how long Run waits for running jobs once its context ends
	// (ONCEFLOW_SHUTDOWN_TIMEOUT). Default: queue.DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// DefaultKind is the kind of a message without one: what producers from before job
	// kinds wrote (queue wire format version 1). Default: none (such messages fail with
	// ErrUnknownKind, as a job of a kind without a Worker does).
	DefaultKind string
	// Gate, when set, holds the queue's workers back while a dependency is down (see
	// queue.WorkerConfig.Gate). Default: the client's breakers (Client.Breakers)
	// combined in a breaker.Set: no job is taken while Redis, PostgreSQL or the model is
	// known to be down, except one to probe the model.
	Gate queue.Gate
	// StatsInterval is how often the queue's gauges are sampled (only with a
	// Registerer). Default: queue.DefaultStatsInterval.
	StatsInterval time.Duration
	// DeadLetterRetention is how long the queue's dead letters are kept before the
	// workers' maintenance deletes them; negative keeps them for ever
	// (ONCEFLOW_DLQ_RETENTION, where 0 means for ever). Default:
	// queue.DefaultDeadLetterRetention (30 days).
	DeadLetterRetention time.Duration
}

// Client enqueues jobs, runs the workers of its queues and the relay of their effects,
// and reads jobs' states. Create it with NewClient; its methods are safe for concurrent
// use.
type Client struct {
	cfg     Config
	log     *slog.Logger
	rdb     redis.UniversalClient
	store   *redisstore.Store
	workers map[string]*kindWorker
	queues  map[string]QueueConfig

	// enqueued counts the jobs added to the queues (onceflow_queue_enqueued_total).
	enqueued *prometheus.CounterVec
	// elsewhere are the queues, other than those it works, that this Client enqueued to
	// or routes to (queue name -> struct{}): JobState looks in them too.
	elsewhere sync.Map
	// known caches knownPartitions' answer per queue name.
	known sync.Map
	// registered has the queues whose partitions enqueueKeys recorded.
	registered sync.Map

	// background are the parts Run runs besides the queue workers (the outbox relay,
	// the ledger's purge), added by the features NewClient sets up.
	background []func(context.Context) error
	// model is the machinery of Job.Complete and Job.Stream (setupModel); nil without
	// Config.Model.
	model *model
	// redisBreaker and pgBreaker are the circuit breakers of Redis and PostgreSQL
	// (setupBreakers; pgBreaker nil without Config.DB).
	redisBreaker, pgBreaker *breaker.Breaker
	// router sends the outbox's topics: Config.Senders and EnqueueTx's (senders.go).
	router *outbox.Router
	// relay is the outbox relay Run and RunRelay run; nil without Config.DB.
	relay *outbox.Relay

	runMu   sync.Mutex
	running bool
}

// ErrClientRunning is returned by a second concurrent call of Client.Run.
var ErrClientRunning = errors.New("onceflow: client already running")

// NewClient checks cfg, applies its defaults and returns a Client. It does not touch
// Redis or PostgreSQL. Its errors name the first invalid setting.
func NewClient(cfg Config) (*Client, error) {
	if cfg.Redis == nil {
		return nil, errors.New("onceflow: Config.Redis is required")
	}
	if err := CheckRedis(cfg.Redis); err != nil {
		return nil, err
	}
	cfg.Prefix = cmp.Or(cfg.Prefix, DefaultPrefix)
	cfg.JobBudget = cmp.Or(cfg.JobBudget, DefaultJobBudget)
	cfg.ResultTTL = cmp.Or(cfg.ResultTTL, DefaultResultTTL)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.TraceParent == nil {
		cfg.TraceParent = func(context.Context) string { return "" }
	}
	explicit := len(cfg.Queues) > 0
	if err := mergeWorkflows(&cfg); err != nil {
		return nil, err
	}
	if !explicit {
		// Every queue a registered kind's jobs go to: a worker registered for a kind is a
		// worker its jobs reach, whatever queues the workflows declared settings for.
		queues := maps.Clone(cfg.Queues)
		if queues == nil {
			queues = map[string]QueueConfig{}
		}
		for _, kw := range cfg.Workers.snapshot() {
			if q := cmp.Or(kw.queue, DefaultQueue); !hasQueue(queues, q) {
				queues[q] = QueueConfig{}
			}
		}
		if len(queues) == 0 {
			queues[DefaultQueue] = QueueConfig{}
		}
		cfg.Queues = queues
	}
	for name, qc := range cfg.Queues {
		cfg.Queues[name] = qc.withDefaults(cfg.QueueDefaults)
	}
	c := &Client{cfg: cfg, log: cfg.Logger, rdb: cfg.Redis, workers: cfg.Workers.snapshot(), queues: maps.Clone(cfg.Queues)}
	store, err := redisstore.New(cfg.Redis, redisstore.Config{Prefix: cfg.Prefix, ResultTTL: cfg.ResultTTL, Logger: cfg.Logger,
		WaitReplicas: cfg.WaitReplicas, WaitTimeout: cfg.WaitTimeout})
	if err != nil {
		return nil, fmt.Errorf("onceflow: %w", err)
	}
	c.store = store
	c.enqueued = newEnqueuedCounter(cfg.Registerer, c.Queues())
	for name, qc := range c.queues {
		if err := c.keys(name).Validate(); err != nil {
			return nil, fmt.Errorf("onceflow: queue %q: %w", name, err)
		}
		if qc.Partitions < 1 || qc.Partitions > queue.MaxPartitions {
			return nil, fmt.Errorf("onceflow: queue %q: Partitions %d: want 1 to %d", name, qc.Partitions, queue.MaxPartitions)
		}
		if qc.DefaultKind != "" && !queue.ValidKind(qc.DefaultKind) {
			return nil, fmt.Errorf("onceflow: queue %q: DefaultKind %q is not a valid kind", name, qc.DefaultKind)
		}
	}
	if cfg.JobBudget < 0 || cfg.ResultTTL < 0 {
		return nil, errors.New("onceflow: JobBudget and ResultTTL must not be negative")
	}
	if cfg.AuditMaxAge < 0 {
		return nil, fmt.Errorf("onceflow: Config.AuditMaxAge %v must not be negative", cfg.AuditMaxAge)
	}
	for _, setup := range []func() error{c.setupBreakers, c.setupModel, c.setupOutbox} {
		if err := setup(); err != nil {
			return nil, err
		}
	}
	gate := breaker.Set(c.Breakers())
	for name, qc := range c.queues {
		if qc.Gate == nil {
			qc.Gate = gate
			c.queues[name] = qc
		}
	}
	return c, nil
}

// hasQueue reports whether queues has name.
func hasQueue(queues map[string]QueueConfig, name string) bool { _, ok := queues[name]; return ok }

// withDefaults returns qc with its zero settings taken from d (Config.QueueDefaults).
func (qc QueueConfig) withDefaults(d QueueConfig) QueueConfig {
	qc.Concurrency = cmp.Or(qc.Concurrency, d.Concurrency)
	qc.ClaimIdle = cmp.Or(qc.ClaimIdle, d.ClaimIdle)
	qc.MaxDeliveries = cmp.Or(qc.MaxDeliveries, d.MaxDeliveries)
	qc.ShutdownTimeout = cmp.Or(qc.ShutdownTimeout, d.ShutdownTimeout)
	qc.StatsInterval = cmp.Or(qc.StatsInterval, d.StatsInterval)
	qc.DeadLetterRetention = cmp.Or(qc.DeadLetterRetention, d.DeadLetterRetention)
	qc.RetryBase = cmp.Or(qc.RetryBase, d.RetryBase)
	qc.RetryMax = cmp.Or(qc.RetryMax, d.RetryMax)
	qc.MaxRunTime = cmp.Or(qc.MaxRunTime, d.MaxRunTime)
	qc.RecordSuccesses = qc.RecordSuccesses || d.RecordSuccesses
	qc.Partitions = cmp.Or(qc.Partitions, d.Partitions, 1)
	return qc
}

// keys names the Redis keys of queue name (its partition 0).
func (c *Client) keys(name string) queue.Keys { return queue.Keys{Prefix: c.cfg.Prefix, Queue: name} }

// partitions returns the partitions jobs of queue name are enqueued to: its
// QueueConfig's, or QueueDefaults' for a queue the Client does not work.
func (c *Client) partitions(name string) int {
	if qc, ok := c.queues[name]; ok {
		return qc.Partitions
	}
	return max(c.cfg.QueueDefaults.Partitions, 1)
}

// jobKeys names the Redis keys of the partition of queue name that job id is enqueued
// to.
func (c *Client) jobKeys(name, id string) queue.Keys {
	return c.keys(name).InPartition(queue.PartitionOf(id, c.partitions(name)))
}

// enqueueKeys is jobKeys for an enqueue: a Client that enqueues to several partitions
// first records them (queue.RegisterPartitions, once per queue and process), so that
// the workers of a process configured with fewer still consume them.
func (c *Client) enqueueKeys(ctx context.Context, name, id string) (queue.Keys, error) {
	keys := c.jobKeys(name, id)
	n := c.partitions(name)
	if n == 1 {
		return keys, nil
	}
	if _, done := c.registered.Load(name); done {
		return keys, nil
	}
	if _, err := queue.RegisterPartitions(ctx, c.rdb, keys, n); err != nil {
		return keys, err
	}
	c.registered.Store(name, true)
	return keys, nil
}

// QueuePartitions returns the keys of every partition of queue name that may hold jobs:
// its configured partitions, and more when a higher count was recorded before
// (queue.KnownPartitions, read at most every 30 seconds: a UI page asks several times;
// without Redis's answer, the configured ones and the error).
// For the queue package's inspection functions over a whole queue.
func (c *Client) QueuePartitions(ctx context.Context, name string) ([]queue.Keys, error) {
	n, err := c.knownPartitions(ctx, name)
	if err != nil {
		n = c.partitions(name)
	}
	return c.keys(name).Partitions(n), err
}

// DB returns Config.DB, the PostgreSQL pool of the client's tables (nil without one),
// for a workflow's own reads of its tables (a GET of its rows, its audit).
func (c *Client) DB() *pgxpool.Pool { return c.cfg.DB }

// Redis returns Config.Redis, for reads of a queue's state (queue.ReadStats,
// queue.ListDead) by a workflow's audit.
func (c *Client) Redis() redis.UniversalClient { return c.rdb }

// QueueKeys returns the Redis keys of queue name under Config.Prefix (of its partition
// 0; QueuePartitions gives them all), for the queue package's inspection functions.
func (c *Client) QueueKeys(name string) queue.Keys { return c.keys(name) }

// Queues returns the names of the queues Run works, sorted.
func (c *Client) Queues() []string { return slices.Sorted(maps.Keys(c.queues)) }

// noteQueue records that the Client enqueues to queue name, for JobState.
func (c *Client) noteQueue(name string) {
	if _, works := c.queues[name]; !works {
		c.elsewhere.LoadOrStore(name, struct{}{})
	}
}

// stateQueues are the queues JobState looks in: those the Client works, then those it
// enqueued to or routes to, sorted.
func (c *Client) stateQueues() []string {
	out := c.Queues()
	var more []string
	c.elsewhere.Range(func(k, _ any) bool { more = append(more, k.(string)); return true })
	slices.Sort(more)
	return append(out, more...)
}

// Run works every configured queue until ctx is cancelled, then drains each within its
// ShutdownTimeout and returns nil. Redis and PostgreSQL errors do not stop it (its parts
// log, count and retry them). A second concurrent call returns ErrClientRunning.
func (c *Client) Run(ctx context.Context) error {
	c.runMu.Lock()
	if c.running {
		c.runMu.Unlock()
		return ErrClientRunning
	}
	c.running = true
	c.runMu.Unlock()
	defer func() {
		c.runMu.Lock()
		c.running = false
		c.runMu.Unlock()
	}()
	var parts []func(context.Context) error
	for _, name := range c.Queues() {
		run, err := c.queueRunner(ctx, name)
		if err != nil {
			return err
		}
		parts = append(parts, run)
	}
	parts = append(parts, c.watchers()...)
	return runParts(ctx, append(parts, c.background...))
}

// queueRunner returns the part of Run that works queue name: one queue worker per
// partition, running the registered workers; a partitioned queue's workers share one
// budget of Concurrency. It consumes the partitions a higher count recorded before
// (queue.RegisterPartitions), and every partitionsCheck looks again, so that partitions
// recorded later (by a process configured with more, or while Redis did not answer at
// start) get their workers too.
func (c *Client) queueRunner(ctx context.Context, name string) (func(context.Context) error, error) {
	qc := c.queues[name]
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	n, err := queue.RegisterPartitions(rctx, c.rdb, c.keys(name), qc.Partitions)
	cancel()
	if err != nil {
		c.log.WarnContext(ctx, "onceflow: cannot read the partitions recorded for the queue: consuming the configured ones, and looking again", "queue", name, "partitions", qc.Partitions, "err", err)
		n = qc.Partitions
	}
	q := &queueRun{c: c, name: name, qc: qc, h: c.handler(name, qc)}
	if n > 1 {
		q.budget = queue.NewBudget(cmp.Or(qc.Concurrency, queue.DefaultConcurrency))
	}
	ws, err := q.workers(0, n)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error { return q.run(ctx, ws) }, nil
}

// partitionsCheck is how often a running queue looks for partitions recorded since it
// started.
var partitionsCheck = 5 * time.Second

// queueRun is one queue's workers under Run.
type queueRun struct {
	c      *Client
	name   string
	qc     QueueConfig
	h      queue.Handler
	budget *queue.Budget // shared by the partitions' workers; nil for one partition
}

// workers returns the workers of partitions from to to-1.
func (q *queueRun) workers(from, to int) ([]*queue.Worker, error) {
	qc := q.qc
	var ws []*queue.Worker
	for p := from; p < to; p++ {
		w, err := queue.NewWorker(queue.WorkerConfig{
			Redis: q.c.rdb, Keys: q.c.keys(q.name).InPartition(p), Handler: q.h, Budget: q.budget,
			Concurrency: qc.Concurrency, ClaimIdle: qc.ClaimIdle, MaxDeliveries: qc.MaxDeliveries,
			ShutdownTimeout: qc.ShutdownTimeout, StatsInterval: qc.StatsInterval, Gate: qc.Gate,
			JobTTL: q.c.cfg.ResultTTL, DeadLetterRetention: qc.DeadLetterRetention,
			RetryBase: qc.RetryBase, RetryMax: qc.RetryMax, MaxRunTime: qc.MaxRunTime, RecordSuccesses: qc.RecordSuccesses,
			Logger: q.c.log, Registerer: q.c.cfg.Registerer,
		})
		if err != nil {
			return nil, fmt.Errorf("onceflow: queue %q: %w", q.name, err)
		}
		ws = append(ws, w)
	}
	return ws, nil
}

// run runs ws, and the workers of partitions recorded later, until ctx ends; it returns
// the first worker's error.
func (q *queueRun) run(ctx context.Context, ws []*queue.Worker) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	start := func(w *queue.Worker) {
		wg.Go(func() {
			if err := w.Run(ctx); err != nil {
				mu.Lock()
				first = cmp.Or(first, err)
				mu.Unlock()
				cancel()
			}
		})
	}
	for _, w := range ws {
		start(w)
	}
	n := len(ws)
	t := time.NewTicker(partitionsCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return first
		case <-t.C:
		}
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		got, err := queue.RegisterPartitions(rctx, q.c.rdb, q.c.keys(q.name), q.qc.Partitions)
		rcancel()
		if err != nil || got <= n {
			continue
		}
		if q.budget == nil {
			// Partition 0's worker has slots of its own: until a restart, the new
			// partitions share a budget of their own, as large.
			q.budget = queue.NewBudget(cmp.Or(q.qc.Concurrency, queue.DefaultConcurrency))
			q.c.log.WarnContext(ctx, "onceflow: the queue has more partitions than when this process started: working them with a second budget of Concurrency until a restart", "queue", q.name, "partitions", got)
		} else {
			q.c.log.InfoContext(ctx, "onceflow: the queue has more partitions than when this process started: working them too", "queue", q.name, "partitions", got)
		}
		more, err := q.workers(n, got)
		if err != nil {
			q.c.log.ErrorContext(ctx, "onceflow: cannot work the queue's new partitions", "queue", q.name, "err", err)
			continue
		}
		for _, w := range more {
			start(w)
		}
		n = got
	}
}

// Handler returns the queue.Handler that runs the jobs of queue name: it routes each
// job by kind to its Worker through the middleware. Run uses it; it is exported for
// programs that build their own queue.Worker.
func (c *Client) Handler(name string) queue.Handler { return c.handler(name, c.queues[name]) }

func (c *Client) handler(name string, qc QueueConfig) queue.Handler {
	var run JobFunc = func(ctx context.Context, info *JobInfo) error {
		if err := c.storeDown(); err != nil {
			return err // read just before its breaker opened: handed back, not run
		}
		kw := c.workers[info.Kind]
		if kw == nil {
			// Not permanent: in a rolling deploy a job of a new kind may reach a worker
			// of the previous version first; retried after ClaimIdle, a worker that
			// knows the kind may take it. A kind no worker knows is dead-lettered after
			// MaxDeliveries, the reason naming it.
			return fmt.Errorf("%w %q on queue %q: no worker registered in this process", ErrUnknownKind, info.Kind, name)
		}
		return kw.run(ctx, info.rt, info.msg, info.Delivery)
	}
	for i := len(c.cfg.Middleware) - 1; i >= 0; i-- {
		run = c.cfg.Middleware[i](run)
	}
	return &queueHandler{c: c, run: func(ctx context.Context, j *queue.Job) error {
		kind := cmp.Or(j.Kind, qc.DefaultKind)
		info := &JobInfo{
			ID: j.JobID, Kind: kind, Queue: name, Tenant: j.Tenant, Delivery: int(j.Deliveries), EntryID: j.ID,
			Args: j.Payload, TraceParent: j.TraceParent,
			msg: j.Message,
			rt:  &runtime{client: c, queue: name, delivery: j, deadline: retry.After(c.cfg.JobBudget)},
		}
		err := run(ctx, info)
		c.observeJob(err)
		return err
	}}
}

// queueHandler is the queue.Handler of a queue: it runs jobs, and answers the worker's
// question whether a job whose budget is spent completed (queue.Completer) from the
// completion records.
type queueHandler struct {
	c   *Client
	run func(context.Context, *queue.Job) error
}

// Handle runs j.
func (h *queueHandler) Handle(ctx context.Context, j *queue.Job) error { return h.run(ctx, j) }

// Completed reports whether j has a completion record of its own tenant (a job of
// another tenant's that completed with this id does not make this one done). Without
// Config.DB nothing records completions: false.
func (h *queueHandler) Completed(ctx context.Context, j *queue.Job) (bool, error) {
	if h.c.cfg.DB == nil {
		return false, nil
	}
	_, err := h.c.completed(ctx, j.Tenant, j.JobID)
	switch {
	case errors.Is(err, ErrJobNotFound):
		return false, nil
	case err != nil:
		err = PostgresError(err)
		h.c.observeJob(err) // PostgreSQL unreachable: counts toward its breaker
		return false, err
	}
	h.c.postgresWorked()
	return true, nil
}

// runParts runs every part until ctx is cancelled or one of them fails, and returns the
// first failure.
func runParts(ctx context.Context, parts []func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(parts))
	for _, p := range parts {
		go func() { errs <- p(ctx) }()
	}
	var first error
	for range parts {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}
