package onceflow

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
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
	// DurableAnswers records every model step's answer with a durable commit of its
	// own before the step returns, as the ledger does for direct callers. Off (the
	// default), a job's step holds its answer, and the job's Commit right after it
	// records it in its own transaction (anything else the delivery does first records
	// it on its own, made durable by the next durable commit; a delivery that does not
	// commit records it at its end): a job with a model step costs two commits instead
	// of three. A crash of the worker or of PostgreSQL before the Commit then loses the
	// answer: the Commit did not happen either, and the next delivery asks again,
	// counted as ambiguous (docs/providers.md, "Two commits per model step"). Set it
	// when a Worker acts on an answer outside onceflow (an HTTP call of its own) before
	// its Commit. Default: false.
	DurableAnswers bool
	// Shadows run candidates beside production model steps, a sampled share of their
	// calls each, never causing an effect, and record the comparison in shadow_runs
	// (see Shadow, docs/shadows.md; ONCEFLOW_SHADOW, ParseShadows). They need Model
	// and DB. Default: none.
	Shadows []Shadow
	// ShadowRetention is how long a shadow run is kept in shadow_runs (purged every
	// minute by Run and RunWorkers). Default: DefaultShadowRetention (30 days).
	ShadowRetention time.Duration
	// Gates check model steps' answers before their jobs act on them: an answer that
	// fails is asked again of a fallback model, or holds its job (StatusHeld) until an
	// operator releases or rejects it (see Gate). They need DB. Default: none.
	Gates []Gate
	// Batch is the batch lane: model steps given InBatch are sent through the provider's
	// batch API, at its batch price, exactly once (see BatchConfig). It needs DB and
	// Model. Default: none (such steps take the synchronous lane).
	Batch BatchConfig
	// StepRetention is how long a recorded step (Do, Job.Tool, Job.ToolAtMostOnce) is
	// kept after it was recorded; it must cover every queue's retry horizon, as
	// Ledger.Retention must. Default: DefaultStepRetention (24h).
	StepRetention time.Duration
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
	// consumes every partition with one queue worker of Concurrency slots, which reads
	// the partitions one Redis node holds in one round trip, and also those a higher
	// count recorded before (queue.RegisterPartitions); ordering
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
