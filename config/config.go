// Package config reads onceflow's settings from the environment and command-line flags,
// applies the documented defaults and validates every value.
//
// Every setting has an environment variable (ONCEFLOW_CLAIM_IDLE) and a flag of the same
// meaning (--claim-idle); a flag that is set wins over the variable, and the variable wins
// over the default. An empty variable counts as unset. The first invalid value stops
// loading with an *Error that names the variable or flag and the value, for example
//
//	invalid ONCEFLOW_CLAIM_IDLE="abc": time: invalid duration "abc"
//
// Secrets (API keys, provider keys, passwords inside URLs) are never printed: Config
// implements slog.LogValuer and String with them redacted.
package config

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/mail"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/queue"
)

// Config holds every setting of the onceflow service. The zero value is not useful;
// obtain one from Defaults or from a Loader.
type Config struct {
	// RedisURL is the Redis server (redis:// or rediss://). Default: redis://127.0.0.1:6379/0.
	RedisURL string
	// RedisClusterAddrs are seed nodes (host:port) of a Redis Cluster: when set, every
	// client is a cluster client, with RedisURL's user, password and TLS (RedisURL's
	// host and database are not used). Default: none (a single server).
	RedisClusterAddrs []string
	// RedisWaitReplicas, above 0, makes an accept wait for that many replicas to have
	// its write (WAIT) before answering 202; RedisWaitTimeout bounds the wait.
	// Defaults: 0 (no WAIT), 250ms.
	RedisWaitReplicas int
	RedisWaitTimeout  time.Duration
	// DatabaseURL is the PostgreSQL server.
	// Default: postgres://onceflow@127.0.0.1:5432/onceflow?sslmode=disable.
	DatabaseURL string
	// Prefix starts every Redis key, followed by a colon. Default: onceflow.
	Prefix string
	// HTTPAddr is the API's listen address. Default: 127.0.0.1:8080.
	HTTPAddr string
	// HTTPReadHeaderTimeout bounds reading a request's line and headers on every HTTP
	// listener (API, gateway, metrics, fake-llm, webhook sink); a slower client is
	// disconnected without an answer. Default: 10s.
	HTTPReadHeaderTimeout time.Duration
	// HTTPReadTimeout bounds reading a request's body on every HTTP listener, counted
	// from the end of its headers; a slower body is answered 408 and its connection
	// closed. It does not limit how long an answer takes (the gateway's streams).
	// Default: 30s.
	HTTPReadTimeout time.Duration
	// HTTPIdleTimeout is how long a kept-alive connection may wait for its next request.
	// Default: 2m.
	HTTPIdleTimeout time.Duration
	// HTTPMaxHeaderBytes bounds the size of a request's line and headers, in bytes;
	// larger ones get 431. Default: 65536.
	HTTPMaxHeaderBytes int
	// APIKeys maps each API key to its tenant. Default: none (serve refuses to start).
	APIKeys map[string]string
	// AdminKeys open the operator UI under /ui/ of serve and run (package adminui);
	// each at least 16 printable characters, none of them a tenant's API key. Default:
	// none (no UI).
	AdminKeys []string
	// UISecureCookies marks the UI's cookies Secure even on requests that arrived
	// without TLS (behind a proxy that terminates it). Default: false (Secure over TLS).
	UISecureCookies bool
	// RecordSuccesses adds each successful run (consumer, times) to its job's history
	// in Redis, which the UI's job page shows; failures are always recorded. It costs a
	// write per job: 0.83 to 0.92 of the throughput of a worker with no-op handlers.
	RecordSuccesses bool
	// QueuePartitions is the partitions of every queue, each on a hash tag of its own,
	// so a Redis Cluster spreads a queue's work over its nodes (docs/queue.md,
	// "Partitions"). Default: 1.
	QueuePartitions int

	// LLM selects the model provider: openai, anthropic or fake. Default: fake.
	LLM string
	// LLMBaseURL overrides the provider's endpoint. Default: the provider's own.
	LLMBaseURL string
	// LLMModel is the model name. Default: gpt-4.1-mini.
	LLMModel string
	// OpenAIAPIKey and AnthropicAPIKey are provider credentials. Default: none.
	OpenAIAPIKey, AnthropicAPIKey string
	// LLMTimeout is the wall-clock limit of one model call, capped by the job budget.
	// Default: 20s.
	LLMTimeout time.Duration
	// LLMMaxAttempts is the number of model calls per delivery, the first included.
	// Default: 4.
	LLMMaxAttempts int
	// LLMQuotaProbe is how often, while the provider's quota or spend limit is
	// exhausted, one model call probes whether it is back (the provider's Retry-After
	// wins when it sent one). Default: 1m.
	LLMQuotaProbe time.Duration
	// LLMAdmission turns the model limiter on or off (docs/limits.md). Default: true.
	LLMAdmission bool
	// LLMRPM, LLMTPM and LLMConcurrency are the model's requests per minute, tokens per
	// minute and calls in flight across every process (0: none configured; learnt from
	// the provider's rate-limit headers). Default: 0.
	LLMRPM, LLMTPM, LLMConcurrency int
	// LLMLimits are per-model limits ("gpt-4.1-mini rpm=500 tpm=200000; other rpm=50"),
	// for the models not named the three above. Default: none.
	LLMLimits map[string]limiter.Limits
	// LLMPrices are per-model prices in US dollars per million tokens
	// ("gpt-4.1-mini input=0.40 output=1.60"), over limiter.DefaultPrices. Default: none.
	LLMPrices map[string]limiter.Price
	// Shadows run candidate models beside production model steps, a sampled share of
	// their calls each, never causing an effect (onceflow.ParseShadows:
	// "STEP=MODEL@RATE,..."; docs/shadows.md). Default: none.
	Shadows []onceflow.Shadow
	// SummariesLane is the lane of the summaries workflow's model calls: "sync" (each
	// call made at once) or "batch" (through the provider's batch API at its batch price,
	// exactly once; docs/batch.md). Default: sync.
	SummariesLane string
	// BatchMaxItems, BatchMaxAge, BatchPollInterval and BatchMaxBytes configure the
	// batch lane (onceflow.BatchConfig). Defaults: 1000, 1m, 5s, 100 MB.
	BatchMaxItems     int
	BatchMaxAge       time.Duration
	BatchPollInterval time.Duration
	BatchMaxBytes     int64
	// BatchSubmitTimeout bounds a batch's upload and creation; a submission left
	// unrecorded is settled after twice it (BatchConfig.SubmitTimeout). Default: 2m.
	BatchSubmitTimeout time.Duration
	// BatchEnqueuedTokens bounds the estimated input tokens of the batch lane's batches
	// in flight, per model (BatchConfig.EnqueuedTokens["*"]). Default: 0, none.
	BatchEnqueuedTokens int64
	// LLMAdmissionWait is how long a job waits in its worker for the limiter's capacity
	// before it waits in its queue instead (holding no worker). Default: 2s.
	LLMAdmissionWait time.Duration
	// TenantConcurrency caps one tenant's model calls in flight (0: its fair share
	// only). Default: 0.
	TenantConcurrency int
	// TenantTokenBudget is every tenant's tokens per UTC day unless `onceflow tenants set`
	// gave it its own (0: unlimited). Default: 0.
	TenantTokenBudget int64
	// BreakerThreshold is how many transient failures of a dependency in a row (Redis,
	// PostgreSQL, the model provider) open its circuit breaker, which stops the
	// workers taking work until a probe passes. Default: 5.
	BreakerThreshold int
	// HealthInterval is how often the workers check Redis and PostgreSQL, and probe one
	// whose breaker is open. Default: 2s.
	HealthInterval time.Duration

	// Sender selects how outbox rows are delivered: webhook, smtp or log. Default: log.
	Sender string
	// WebhookURL receives outbox rows when Sender is webhook.
	WebhookURL string
	// SMTPURL (smtp://user:pass@host:port) and SMTPFrom configure Sender smtp.
	SMTPURL, SMTPFrom string

	// WorkerConcurrency is the number of jobs in flight per worker process. Default: 64.
	WorkerConcurrency int
	// ClaimIdle is the idle time after which another worker may reclaim a message.
	// Default: 2m.
	ClaimIdle time.Duration
	// MaxDeliveries is a job's budget of failed attempts (the name is kept from when it
	// counted deliveries): runs that failed on the job, and deliveries whose process
	// died; outages, snoozes and shutdowns spend none. Default: 5.
	MaxDeliveries int
	// RetryBase and RetryMax bound the full-jitter wait before the attempt after a
	// failure, unless the failure carried a Retry-After. Defaults: 1s and 5m.
	RetryBase, RetryMax time.Duration
	// MaxRunTime bounds one run of a job: after it the run is cancelled, its lease
	// lapses, and it counts as a failed attempt. Default: 15m.
	MaxRunTime time.Duration
	// LockTTL is the lifetime of an idempotency in-progress marker. Default: 30s.
	LockTTL time.Duration
	// ResultTTL is how long a stored idempotent response is replayed, and how long a job's
	// index (its tenant and state, for GET) is kept once the job was acknowledged or its
	// dead letter deleted. Default: 24h.
	ResultTTL time.Duration
	// DLQRetention is how long a dead letter is kept before the workers delete it (and
	// its job index expires ResultTTL later); 0 keeps dead letters for ever.
	// Default: 720h (30 days).
	DLQRetention time.Duration
	// IdempotencyTimeout bounds each idempotency store call; a claim that runs out is
	// answered 503. Default: 500ms.
	IdempotencyTimeout time.Duration
	// IdempotencyResponseLimit is the largest response body stored for replay, in bytes;
	// larger responses are stored without their body. Default: 65536.
	IdempotencyResponseLimit int
	// JobBudget is the deadline of one delivery, across attempts and sleeps. Default: 60s.
	JobBudget time.Duration
	// LedgerLease is how long an llm_calls row stays owned by an attempt that stopped
	// renewing it. Default: 15s.
	LedgerLease time.Duration
	// LedgerRetention is how long an llm_calls row is kept after its first attempt, and
	// after its success (its expires_at). It must cover the retry horizon, MaxDeliveries × (ClaimIdle +
	// JobBudget), and should cover the longest a job can wait in the queue (a queue
	// paused overnight, a dead letter replayed the next morning). Default: 24h.
	LedgerRetention time.Duration
	// LedgerRelaxedInsert commits the ledger's in-flight insert with synchronous_commit
	// off: a PostgreSQL crash can then lose that accounting record, never an effect.
	// Default: false.
	LedgerRelaxedInsert bool
	// LedgerKeepRequests has the ledger store each model call's request, the inputs
	// `onceflow eval` replays. Default: false.
	LedgerKeepRequests bool
	// LedgerGroupLinger is how long the first ledger write of a group transaction waits
	// for concurrent calls' writes to join it when other calls are in progress
	// (ledger.Config.GroupLinger), 1µs to 5ms; negative (the value "off") turns group
	// commit off. Default: 100µs.
	LedgerGroupLinger time.Duration
	// LedgerDurableAnswers commits each model step's answer durably on its own before
	// the step returns, instead of recording it with the job's Commit
	// (onceflow.Config.DurableAnswers). Default: false.
	LedgerDurableAnswers bool
	// RelayInterval is the relay's poll interval when idle. Default: 250ms.
	RelayInterval time.Duration
	// RelayLease is how long a claimed outbox batch stays claimed. Default: 30s.
	RelayLease time.Duration
	// RelayMaxAttempts is the number of send attempts before an outbox row is exhausted.
	// Default: 10.
	RelayMaxAttempts int
	// RelayBatchSize is the number of outbox rows a relay claims at once. Default: 100.
	RelayBatchSize int
	// RelayConcurrency is the number of sends in flight within a relay's batch.
	// Default: 16.
	RelayConcurrency int
	// OutboxRetention is how long sent outbox rows are kept. Default: 168h (7 days).
	OutboxRetention time.Duration
	// ShutdownTimeout bounds how long SIGTERM waits for in-flight work. Default: 30s.
	ShutdownTimeout time.Duration
	// MetricsAddr is an extra /metrics listener for work and relay; empty means none.
	MetricsAddr string
	// StatsInterval is how often work samples the stream gauges (length, pending,
	// oldest pending idle, dead letters) and relay the oldest unsent outbox row's age.
	// Default: 15s.
	StatsInterval time.Duration
	// GatewayAddr is the listen address of onceflow gateway. Default: 127.0.0.1:8090.
	GatewayAddr string
	// GatewayTimeout bounds each upstream exchange through onceflow gateway, reading the
	// answer included. Default: 5m.
	GatewayTimeout time.Duration
	// GatewayMaxBody is the largest request body onceflow gateway accepts, in bytes;
	// larger ones get 413. Default: 8388608 (8 MiB).
	GatewayMaxBody int
	// GatewayJoinTimeout is how long a request whose key is in flight waits for the call
	// to answer (a stream: to begin) before onceflow gateway answers 409. Default: 0,
	// meaning GatewayTimeout.
	GatewayJoinTimeout time.Duration
	// GatewayDeriveKeys is "off" or "retry-count": give requests without a key that
	// the official SDKs number (X-Stainless-Retry-Count) keys of the gateway's own, so
	// that their automatic retries are joined or replayed. Default: off.
	GatewayDeriveKeys string
	// GatewayDeriveWindow is how long after a first attempt its retries are
	// recognised. Default: 15m.
	GatewayDeriveWindow time.Duration
	// GatewayTenantHeader names the request header that identifies a caller to the
	// limiter in onceflow gateway. Default: "" (by protocol: x-api-key on Anthropic's
	// /v1/messages, else Authorization, or api-key without Authorization).
	GatewayTenantHeader string
	// GatewayCredentialHeaders names request headers that carry credentials besides
	// Authorization, x-api-key and api-key, which always do: onceflow gateway scopes
	// keys by all of them. Default: none.
	GatewayCredentialHeaders []string
	// AuditMaxAge is how old an unsent or exhausted outbox row may be before audit
	// reports it. Default: 10m.
	AuditMaxAge time.Duration
	// LogFormat is json or text. Default: json.
	LogFormat string

	raw map[string]string // the resolved text of every setting, by variable name
}

// Error reports one invalid setting. Name is the variable (ONCEFLOW_CLAIM_IDLE) or the
// flag (--claim-idle) the value came from.
type Error struct {
	Name  string
	Value string // redacted when the setting is a secret
	Err   error
}

func (e *Error) Error() string {
	return fmt.Sprintf("invalid %s=%q: %v", e.Name, e.Value, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// setting describes one configuration value: where it comes from and how it is parsed.
type setting struct {
	env    string // ONCEFLOW_CLAIM_IDLE
	def    string // default, in the same syntax as the variable
	usage  string
	secret bool
	parse  func(c *Config, v string) error
}

// Flag returns the flag name of a setting: the variable without ONCEFLOW_, lower case,
// underscores as dashes (ONCEFLOW_CLAIM_IDLE is --claim-idle, OPENAI_API_KEY is
// --openai-api-key).
func (s setting) flag() string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(s.env, "ONCEFLOW_")), "_", "-")
}

var settings = []setting{
	{env: "ONCEFLOW_REDIS_URL", def: "redis://127.0.0.1:6379/0", usage: "Redis URL (redis:// or rediss://); with master_name=NAME, the Sentinels of a primary (addr= for more of them)", parse: func(c *Config, v string) error {
		return parseURL(&c.RedisURL, v, "redis", "rediss", "unix")
	}},
	{env: "ONCEFLOW_REDIS_CLUSTER_ADDRS", usage: "comma-separated host:port seed nodes of a Redis Cluster (a cluster client; user, password and TLS from ONCEFLOW_REDIS_URL)", parse: parseClusterAddrs},
	{env: "ONCEFLOW_REDIS_WAIT_REPLICAS", def: "0", usage: "replicas that must confirm an accepted job's write (WAIT) before the API answers 202; fewer in time answers 503 (0: no WAIT)", parse: func(c *Config, v string) error {
		return parseInt(&c.RedisWaitReplicas, v, 0, 16)
	}},
	{env: "ONCEFLOW_REDIS_WAIT_TIMEOUT", def: "250ms", usage: "how long an accept waits for ONCEFLOW_REDIS_WAIT_REPLICAS replicas (at most 2s: under the Redis read timeout)", parse: func(c *Config, v string) error {
		if err := parseDuration(&c.RedisWaitTimeout, v); err != nil {
			return err
		}
		if c.RedisWaitTimeout < time.Millisecond || c.RedisWaitTimeout > 2*time.Second {
			return errors.New("must be between 1ms and 2s")
		}
		return nil
	}},
	{env: "ONCEFLOW_DATABASE_URL", def: "postgres://onceflow@127.0.0.1:5432/onceflow?sslmode=disable", usage: "PostgreSQL URL", parse: func(c *Config, v string) error {
		return parseURL(&c.DatabaseURL, v, "postgres", "postgresql")
	}},
	{env: "ONCEFLOW_PREFIX", def: "onceflow", usage: "prefix of every Redis key", parse: func(c *Config, v string) error {
		if strings.ContainsAny(v, "{}: \t\r\n") {
			return errors.New("must not contain braces, colons or whitespace")
		}
		c.Prefix = v
		return nil
	}},
	{env: "ONCEFLOW_HTTP_ADDR", def: "127.0.0.1:8080", usage: "API listen address", parse: func(c *Config, v string) error {
		return parseAddr(&c.HTTPAddr, v)
	}},
	{env: "ONCEFLOW_HTTP_READ_HEADER_TIMEOUT", def: "10s", usage: "bound of reading a request's headers (slower: disconnected)", parse: func(c *Config, v string) error {
		return parseDuration(&c.HTTPReadHeaderTimeout, v)
	}},
	{env: "ONCEFLOW_HTTP_READ_TIMEOUT", def: "30s", usage: "bound of reading a request's body after its headers (slower: 408)", parse: func(c *Config, v string) error {
		return parseDuration(&c.HTTPReadTimeout, v)
	}},
	{env: "ONCEFLOW_HTTP_IDLE_TIMEOUT", def: "2m", usage: "how long a kept-alive connection waits for its next request", parse: func(c *Config, v string) error {
		return parseDuration(&c.HTTPIdleTimeout, v)
	}},
	{env: "ONCEFLOW_HTTP_MAX_HEADER_BYTES", def: "65536", usage: "largest request line and headers, in bytes (larger: 431)", parse: func(c *Config, v string) error {
		return parseInt(&c.HTTPMaxHeaderBytes, v, 4096, 16<<20)
	}},
	{env: "ONCEFLOW_API_KEYS", usage: "comma-separated TENANT:KEY pairs", secret: true, parse: parseAPIKeys},
	{env: "ONCEFLOW_ADMIN_KEYS", usage: "comma-separated admin keys (16+ characters) that open the operator UI under /ui/", secret: true, parse: parseAdminKeys},
	{env: "ONCEFLOW_UI_SECURE_COOKIES", def: "false", usage: "mark the operator UI's cookies Secure also without TLS (behind a TLS proxy)", parse: func(c *Config, v string) error {
		return parseBool(&c.UISecureCookies, v)
	}},
	{env: "ONCEFLOW_RECORD_SUCCESSES", def: "false", usage: "add each successful run (consumer, times) to its job's history, shown by the operator UI (failures are always recorded)", parse: func(c *Config, v string) error {
		return parseBool(&c.RecordSuccesses, v)
	}},
	{env: "ONCEFLOW_QUEUE_PARTITIONS", def: "1", usage: "partitions per queue, each on its own hash tag, so a Redis Cluster spreads the work (lowering it is safe: workers keep consuming the partitions a queue had)", parse: func(c *Config, v string) error {
		return parseInt(&c.QueuePartitions, v, 1, queue.MaxPartitions)
	}},
	{env: "ONCEFLOW_LLM", def: "fake", usage: "model provider: openai, anthropic or fake", parse: func(c *Config, v string) error {
		return parseEnum(&c.LLM, v, Providers()...)
	}},
	{env: "ONCEFLOW_LLM_BASE_URL", usage: "model provider endpoint (default: the provider's)", parse: func(c *Config, v string) error {
		if v == "" {
			return nil
		}
		return parseURL(&c.LLMBaseURL, v, "http", "https")
	}},
	{env: "ONCEFLOW_LLM_MODEL", def: "gpt-4.1-mini", usage: "model name", parse: func(c *Config, v string) error {
		if v == "" {
			return errors.New("must not be empty")
		}
		c.LLMModel = v
		return nil
	}},
	{env: "OPENAI_API_KEY", usage: "OpenAI credentials", secret: true, parse: func(c *Config, v string) error {
		c.OpenAIAPIKey = v
		return nil
	}},
	{env: "ANTHROPIC_API_KEY", usage: "Anthropic credentials", secret: true, parse: func(c *Config, v string) error {
		c.AnthropicAPIKey = v
		return nil
	}},
	{env: "ONCEFLOW_LLM_TIMEOUT", def: "20s", usage: "wall-clock limit of one model call", parse: func(c *Config, v string) error {
		return parseDuration(&c.LLMTimeout, v)
	}},
	{env: "ONCEFLOW_LLM_MAX_ATTEMPTS", def: "4", usage: "model calls per delivery, the first included", parse: func(c *Config, v string) error {
		return parseInt(&c.LLMMaxAttempts, v, 1, 100)
	}},
	{env: "ONCEFLOW_LLM_QUOTA_PROBE", def: "1m", usage: "how often one model call probes an exhausted quota", parse: func(c *Config, v string) error {
		return parseDuration(&c.LLMQuotaProbe, v)
	}},
	{env: "ONCEFLOW_LLM_ADMISSION", def: "on", usage: "model limiter: on or off", parse: func(c *Config, v string) error {
		var mode string
		if err := parseEnum(&mode, v, "on", "off"); err != nil {
			return err
		}
		c.LLMAdmission = mode == "on"
		return nil
	}},
	{env: "ONCEFLOW_LLM_RPM", def: "0", usage: "model requests per minute across all processes (0: none configured)", parse: func(c *Config, v string) error {
		return parseInt(&c.LLMRPM, v, 0, 1e9)
	}},
	{env: "ONCEFLOW_LLM_TPM", def: "0", usage: "model tokens per minute across all processes (0: none configured)", parse: func(c *Config, v string) error {
		return parseInt(&c.LLMTPM, v, 0, 1e12)
	}},
	{env: "ONCEFLOW_LLM_CONCURRENCY", def: "0", usage: "model calls in flight across all processes (0: none configured)", parse: func(c *Config, v string) error {
		return parseInt(&c.LLMConcurrency, v, 0, 1e6)
	}},
	{env: "ONCEFLOW_LLM_LIMITS", usage: "per-model limits: \"MODEL rpm=N tpm=N concurrency=N; MODEL ...\"", parse: func(c *Config, v string) error {
		m, err := limiter.ParseModelLimits(v)
		c.LLMLimits = m
		return err
	}},
	{env: "ONCEFLOW_SUMMARIES_LANE", def: "sync", usage: "the summaries' model calls: sync, or batch (the provider's batch API at its batch price)", parse: func(c *Config, v string) error {
		if v != "sync" && v != "batch" {
			return errors.New("want sync or batch")
		}
		c.SummariesLane = v
		return nil
	}},
	{env: "ONCEFLOW_BATCH_MAX_ITEMS", def: "1000", usage: "the most requests per batch of the batch lane (1 to 50000)", parse: func(c *Config, v string) error {
		return parseInt(&c.BatchMaxItems, v, 1, 50000)
	}},
	{env: "ONCEFLOW_BATCH_MAX_AGE", def: "1m", usage: "send a batch once its oldest request has waited this long", parse: func(c *Config, v string) error {
		return parseDuration(&c.BatchMaxAge, v)
	}},
	{env: "ONCEFLOW_BATCH_POLL_INTERVAL", def: "5s", usage: "how often the batch lane sends due batches and looks for ended ones", parse: func(c *Config, v string) error {
		return parseDuration(&c.BatchPollInterval, v)
	}},
	{env: "ONCEFLOW_BATCH_MAX_SIZE", def: "104857600", usage: "the most bytes of requests per batch of the batch lane (1024 to 209715200)", parse: func(c *Config, v string) error {
		return parseInt64(&c.BatchMaxBytes, v, 1024, 200<<20)
	}},
	{env: "ONCEFLOW_BATCH_SUBMIT_TIMEOUT", def: "2m", usage: "the longest a batch's upload and creation may take; a submission a crash left unrecorded is settled after twice this", parse: func(c *Config, v string) error {
		return parseDuration(&c.BatchSubmitTimeout, v)
	}},
	{env: "ONCEFLOW_BATCH_ENQUEUED_TOKENS", def: "0", usage: "the most input tokens (estimated) of a model's batches in flight (0: no limit; the provider's batch queue limit)", parse: func(c *Config, v string) error {
		return parseInt64(&c.BatchEnqueuedTokens, v, 0, 1e15)
	}},
	{env: "ONCEFLOW_SHADOW", usage: "shadow runs: \"STEP=MODEL@RATE,...\" (a share of a step's model calls also made to MODEL, never causing an effect)", parse: func(c *Config, v string) error {
		sh, err := onceflow.ParseShadows(v)
		c.Shadows = sh
		return err
	}},
	{env: "ONCEFLOW_LLM_PRICES", usage: "per-model prices, US dollars per million tokens: \"MODEL input=N output=N; ...\"", parse: func(c *Config, v string) error {
		m, err := limiter.ParsePrices(v)
		c.LLMPrices = m
		return err
	}},
	{env: "ONCEFLOW_LLM_ADMISSION_WAIT", def: "2s", usage: "how long a job waits in its worker for model capacity before it waits in its queue", parse: func(c *Config, v string) error {
		return parseDuration(&c.LLMAdmissionWait, v)
	}},
	{env: "ONCEFLOW_TENANT_CONCURRENCY", def: "0", usage: "model calls in flight per tenant (0: fair share only)", parse: func(c *Config, v string) error {
		return parseInt(&c.TenantConcurrency, v, 0, 1e6)
	}},
	{env: "ONCEFLOW_TENANT_TOKEN_BUDGET", def: "0", usage: "default tokens per tenant per UTC day (0: unlimited)", parse: func(c *Config, v string) error {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 || n > 1e15 {
			return errors.New("must be an integer between 0 and 10^15")
		}
		c.TenantTokenBudget = n
		return nil
	}},
	{env: "ONCEFLOW_BREAKER_THRESHOLD", def: "5", usage: "transient failures of a dependency in a row that stop the workers until a probe passes", parse: func(c *Config, v string) error {
		return parseInt(&c.BreakerThreshold, v, 1, 1000)
	}},
	{env: "ONCEFLOW_HEALTH_INTERVAL", def: "1s", usage: "how often the workers check Redis and PostgreSQL (and probe one that is down)", parse: func(c *Config, v string) error {
		return parseDuration(&c.HealthInterval, v)
	}},
	{env: "ONCEFLOW_SENDER", def: "log", usage: "outbox sender: webhook, smtp or log", parse: func(c *Config, v string) error {
		return parseEnum(&c.Sender, v, "webhook", "smtp", "log")
	}},
	{env: "ONCEFLOW_WEBHOOK_URL", usage: "webhook receiving outbox rows (sender webhook)", secret: true, parse: func(c *Config, v string) error {
		if v == "" {
			return nil
		}
		return parseURL(&c.WebhookURL, v, "http", "https")
	}},
	{env: "ONCEFLOW_SMTP_URL", usage: "smtp://user:pass@host:port (sender smtp)", secret: true, parse: func(c *Config, v string) error {
		if v == "" {
			return nil
		}
		return parseURL(&c.SMTPURL, v, "smtp", "smtps")
	}},
	{env: "ONCEFLOW_SMTP_FROM", usage: "sender address of emails (sender smtp)", parse: func(c *Config, v string) error {
		if v == "" {
			return nil
		}
		if _, err := mail.ParseAddress(v); err != nil {
			return err
		}
		c.SMTPFrom = v
		return nil
	}},
	{env: "ONCEFLOW_WORKER_CONCURRENCY", def: "64", usage: "jobs in flight per worker process", parse: func(c *Config, v string) error {
		return parseInt(&c.WorkerConcurrency, v, 1, 100_000)
	}},
	{env: "ONCEFLOW_CLAIM_IDLE", def: "2m", usage: "idle time after which another worker may reclaim a message", parse: func(c *Config, v string) error {
		return parseDuration(&c.ClaimIdle, v)
	}},
	{env: "ONCEFLOW_MAX_DELIVERIES", def: "5", usage: "failed attempts before a job is dead-lettered (outages, snoozes and shutdowns spend none)", parse: func(c *Config, v string) error {
		return parseInt(&c.MaxDeliveries, v, 1, 1000)
	}},
	{env: "ONCEFLOW_RETRY_BASE", def: "1s", usage: "base of the full-jitter exponential wait before the attempt after a failure", parse: func(c *Config, v string) error {
		return parseDuration(&c.RetryBase, v)
	}},
	{env: "ONCEFLOW_RETRY_MAX", def: "5m", usage: "longest wait before the attempt after a failure (a Retry-After wins)", parse: func(c *Config, v string) error {
		return parseDuration(&c.RetryMax, v)
	}},
	{env: "ONCEFLOW_MAX_RUN_TIME", def: "15m", usage: "longest run of one job: then it is cancelled and counts as a failed attempt", parse: func(c *Config, v string) error {
		return parseDuration(&c.MaxRunTime, v)
	}},
	{env: "ONCEFLOW_LOCK_TTL", def: "30s", usage: "idempotency in-progress marker lifetime", parse: func(c *Config, v string) error {
		return parseDuration(&c.LockTTL, v)
	}},
	{env: "ONCEFLOW_RESULT_TTL", def: "24h", usage: "how long a stored idempotent response is replayed", parse: func(c *Config, v string) error {
		return parseDuration(&c.ResultTTL, v)
	}},
	{env: "ONCEFLOW_DLQ_RETENTION", def: "720h", usage: "how long a dead letter is kept (0: for ever)", parse: func(c *Config, v string) error {
		return parseDurationOrZero(&c.DLQRetention, v)
	}},
	{env: "ONCEFLOW_IDEMPOTENCY_TIMEOUT", def: "500ms", usage: "bound of each idempotency store call (slower: 503)", parse: func(c *Config, v string) error {
		return parseDuration(&c.IdempotencyTimeout, v)
	}},
	{env: "ONCEFLOW_IDEMPOTENCY_RESPONSE_LIMIT", def: "65536", usage: "largest response body stored for replay, in bytes", parse: func(c *Config, v string) error {
		return parseInt(&c.IdempotencyResponseLimit, v, 1, 16<<20)
	}},
	{env: "ONCEFLOW_JOB_BUDGET", def: "60s", usage: "deadline of one delivery, across attempts and sleeps", parse: func(c *Config, v string) error {
		return parseDuration(&c.JobBudget, v)
	}},
	{env: "ONCEFLOW_LEDGER_LEASE", def: "15s", usage: "how long an llm_calls row stays owned by a silent attempt", parse: func(c *Config, v string) error {
		return parseDuration(&c.LedgerLease, v)
	}},
	{env: "ONCEFLOW_LEDGER_RETENTION", def: "24h", usage: "how long an llm_calls row is kept after its first attempt and after its success", parse: func(c *Config, v string) error {
		return parseDuration(&c.LedgerRetention, v)
	}},
	{env: "ONCEFLOW_LEDGER_RELAXED_INSERT", def: "false", usage: "commit the ledger's in-flight insert with synchronous_commit off", parse: func(c *Config, v string) error {
		return parseBool(&c.LedgerRelaxedInsert, v)
	}},
	{env: "ONCEFLOW_LEDGER_KEEP_REQUESTS", def: "false", usage: "store each model call's request in the ledger: the inputs onceflow eval replays", parse: func(c *Config, v string) error {
		return parseBool(&c.LedgerKeepRequests, v)
	}},
	{env: "ONCEFLOW_LEDGER_GROUP_LINGER", def: "100us", usage: "how long a ledger write waits for concurrent calls' writes to share its commit (1us to 5ms; off: each commits alone)", parse: func(c *Config, v string) error {
		if v == "off" {
			c.LedgerGroupLinger = -1
			return nil
		}
		if err := parseDuration(&c.LedgerGroupLinger, v); err != nil {
			return fmt.Errorf("%w (or off)", err)
		}
		if c.LedgerGroupLinger < time.Microsecond || c.LedgerGroupLinger > ledger.MaxGroupLinger {
			return fmt.Errorf("must be from 1us to %s (or off)", ledger.MaxGroupLinger)
		}
		return nil
	}},
	{env: "ONCEFLOW_LEDGER_DURABLE_ANSWERS", def: "false", usage: "commit each model step's answer durably on its own, not with the job's commit", parse: func(c *Config, v string) error {
		return parseBool(&c.LedgerDurableAnswers, v)
	}},
	{env: "ONCEFLOW_RELAY_INTERVAL", def: "250ms", usage: "relay poll interval when idle", parse: func(c *Config, v string) error {
		return parseDuration(&c.RelayInterval, v)
	}},
	{env: "ONCEFLOW_RELAY_LEASE", def: "30s", usage: "how long a claimed outbox batch stays claimed", parse: func(c *Config, v string) error {
		return parseDuration(&c.RelayLease, v)
	}},
	{env: "ONCEFLOW_RELAY_MAX_ATTEMPTS", def: "10", usage: "send attempts before an outbox row is exhausted", parse: func(c *Config, v string) error {
		return parseInt(&c.RelayMaxAttempts, v, 1, 1000)
	}},
	{env: "ONCEFLOW_RELAY_BATCH_SIZE", def: "100", usage: "outbox rows a relay claims at once", parse: func(c *Config, v string) error {
		return parseInt(&c.RelayBatchSize, v, 1, 10_000)
	}},
	{env: "ONCEFLOW_RELAY_CONCURRENCY", def: "16", usage: "sends in flight within a relay's batch", parse: func(c *Config, v string) error {
		return parseInt(&c.RelayConcurrency, v, 1, 1000)
	}},
	{env: "ONCEFLOW_OUTBOX_RETENTION", def: "168h", usage: "how long sent outbox rows are kept", parse: func(c *Config, v string) error {
		return parseDuration(&c.OutboxRetention, v)
	}},
	{env: "ONCEFLOW_SHUTDOWN_TIMEOUT", def: "30s", usage: "how long SIGTERM waits for in-flight work", parse: func(c *Config, v string) error {
		return parseDuration(&c.ShutdownTimeout, v)
	}},
	{env: "ONCEFLOW_METRICS_ADDR", usage: "extra /metrics listener of work and relay (empty: none)", parse: func(c *Config, v string) error {
		if v == "" {
			return nil
		}
		return parseAddr(&c.MetricsAddr, v)
	}},
	{env: "ONCEFLOW_STATS_INTERVAL", def: "15s", usage: "how often work and relay sample the queue and outbox gauges", parse: func(c *Config, v string) error {
		return parseDuration(&c.StatsInterval, v)
	}},
	{env: "ONCEFLOW_GATEWAY_ADDR", def: "127.0.0.1:8090", usage: "listen address of onceflow gateway", parse: func(c *Config, v string) error {
		return parseAddr(&c.GatewayAddr, v)
	}},
	{env: "ONCEFLOW_GATEWAY_TIMEOUT", def: "5m", usage: "limit of one upstream exchange through onceflow gateway", parse: func(c *Config, v string) error {
		return parseDuration(&c.GatewayTimeout, v)
	}},
	{env: "ONCEFLOW_GATEWAY_MAX_BODY", def: "8388608", usage: "largest request body onceflow gateway accepts, in bytes", parse: func(c *Config, v string) error {
		return parseInt(&c.GatewayMaxBody, v, 1, 1<<30)
	}},
	{env: "ONCEFLOW_GATEWAY_JOIN_TIMEOUT", usage: "how long a request whose Idempotency-Key is in flight waits for the call before 409 (default: ONCEFLOW_GATEWAY_TIMEOUT)", parse: func(c *Config, v string) error {
		if v == "" {
			c.GatewayJoinTimeout = 0
			return nil
		}
		return parseDuration(&c.GatewayJoinTimeout, v)
	}},
	{env: "ONCEFLOW_GATEWAY_DERIVE_KEYS", def: "off", usage: "off or retry-count: answer the official SDKs' automatic retries of requests without a key (X-Stainless-Retry-Count) from the first attempt", parse: func(c *Config, v string) error {
		return parseEnum(&c.GatewayDeriveKeys, v, "off", "retry-count")
	}},
	{env: "ONCEFLOW_GATEWAY_DERIVE_WINDOW", def: "15m", usage: "how long after a first attempt onceflow gateway recognises its retries (ONCEFLOW_GATEWAY_DERIVE_KEYS)", parse: func(c *Config, v string) error {
		return parseDuration(&c.GatewayDeriveWindow, v)
	}},
	{env: "ONCEFLOW_GATEWAY_TENANT_HEADER", usage: "the request header whose value identifies a caller to the limiter in onceflow gateway (default: x-api-key on /v1/messages, else Authorization, or api-key without Authorization)", parse: func(c *Config, v string) error {
		if v != "" && !httpguts.ValidHeaderFieldName(v) {
			return fmt.Errorf("%q is not a valid HTTP header name", v)
		}
		c.GatewayTenantHeader = v
		return nil
	}},
	{env: "ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS", usage: "comma-separated request headers that carry credentials, besides Authorization, x-api-key and api-key", parse: parseHeaderNames},
	{env: "ONCEFLOW_AUDIT_MAX_AGE", def: "10m", usage: "age at which audit reports an unsent or exhausted outbox row", parse: func(c *Config, v string) error {
		return parseDuration(&c.AuditMaxAge, v)
	}},
	{env: "ONCEFLOW_LOG_FORMAT", def: "json", usage: "log format: json or text", parse: func(c *Config, v string) error {
		return parseEnum(&c.LogFormat, v, "json", "text")
	}},
}

// Providers returns the values ONCEFLOW_LLM accepts: the model providers onceflow knows
// (which of them a program links is package cli's App.Providers).
func Providers() []string { return []string{"openai", "anthropic", "fake"} }

// Defaults returns the configuration with every documented default applied.
func Defaults() *Config {
	c := &Config{raw: make(map[string]string, len(settings))}
	for _, s := range settings {
		if err := s.parse(c, s.def); err != nil {
			panic(fmt.Sprintf("config: default of %s: %v", s.env, err)) // a bug in this file
		}
		c.raw[s.env] = s.def
	}
	return c
}

// Group is a family of settings that one part of onceflow reads: the Redis connection,
// the API, the workers, the relay... A command's -h lists the flags of the groups it
// reads, one group after another; it still accepts (and checks) the flag of every
// setting.
type Group string

// The groups, in the order a command's -h shows them. Every setting is in exactly one.
const (
	GroupRedis      Group = "Redis"
	GroupPostgres   Group = "PostgreSQL"
	GroupAPI        Group = "HTTP API"
	GroupUI         Group = "operator UI"
	GroupJobs       Group = "jobs"
	GroupWorkers    Group = "workers"
	GroupModel      Group = "model"
	GroupModelLanes Group = "model lanes (shadows, batch)"
	GroupModelCalls Group = "model calls"
	GroupLimits     Group = "model limits and budgets"
	GroupLedger     Group = "ledger (llm_calls)"
	GroupSender     Group = "outbox sender"
	GroupRelay      Group = "outbox relay"
	GroupGateway    Group = "gateway"
	GroupAudit      Group = "audit"
	GroupHTTP       Group = "HTTP listeners"
	GroupMetrics    Group = "metrics listener"
	GroupShutdown   Group = "shutdown"
	GroupLogs       Group = "logs"
)

// groups lists the settings of each group, by variable, in the documented order.
var groups = []struct {
	group Group
	envs  []string
}{
	{GroupRedis, []string{"ONCEFLOW_REDIS_URL", "ONCEFLOW_REDIS_CLUSTER_ADDRS", "ONCEFLOW_PREFIX"}},
	{GroupPostgres, []string{"ONCEFLOW_DATABASE_URL"}},
	{GroupAPI, []string{"ONCEFLOW_HTTP_ADDR", "ONCEFLOW_API_KEYS", "ONCEFLOW_IDEMPOTENCY_TIMEOUT", "ONCEFLOW_IDEMPOTENCY_RESPONSE_LIMIT",
		"ONCEFLOW_LOCK_TTL", "ONCEFLOW_REDIS_WAIT_REPLICAS", "ONCEFLOW_REDIS_WAIT_TIMEOUT"}},
	{GroupUI, []string{"ONCEFLOW_ADMIN_KEYS", "ONCEFLOW_UI_SECURE_COOKIES"}},
	{GroupJobs, []string{"ONCEFLOW_RESULT_TTL", "ONCEFLOW_QUEUE_PARTITIONS"}},
	{GroupWorkers, []string{"ONCEFLOW_WORKER_CONCURRENCY", "ONCEFLOW_CLAIM_IDLE", "ONCEFLOW_MAX_DELIVERIES", "ONCEFLOW_RETRY_BASE",
		"ONCEFLOW_RETRY_MAX", "ONCEFLOW_MAX_RUN_TIME", "ONCEFLOW_JOB_BUDGET", "ONCEFLOW_DLQ_RETENTION", "ONCEFLOW_RECORD_SUCCESSES",
		"ONCEFLOW_BREAKER_THRESHOLD", "ONCEFLOW_HEALTH_INTERVAL", "ONCEFLOW_STATS_INTERVAL"}},
	{GroupModel, []string{"ONCEFLOW_LLM", "ONCEFLOW_LLM_BASE_URL", "ONCEFLOW_LLM_MODEL"}},
	// The lanes the workers' model steps take besides the synchronous one: read by the
	// commands that run the steps (work, run), not by those that make calls of their own.
	{GroupModelLanes, []string{"ONCEFLOW_SHADOW", "ONCEFLOW_SUMMARIES_LANE", "ONCEFLOW_BATCH_MAX_ITEMS", "ONCEFLOW_BATCH_MAX_AGE",
		"ONCEFLOW_BATCH_POLL_INTERVAL", "ONCEFLOW_BATCH_MAX_SIZE", "ONCEFLOW_BATCH_SUBMIT_TIMEOUT", "ONCEFLOW_BATCH_ENQUEUED_TOKENS"}},
	{GroupModelCalls, []string{"OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ONCEFLOW_LLM_TIMEOUT", "ONCEFLOW_LLM_MAX_ATTEMPTS",
		"ONCEFLOW_LLM_QUOTA_PROBE"}},
	{GroupLimits, []string{"ONCEFLOW_LLM_ADMISSION", "ONCEFLOW_LLM_RPM", "ONCEFLOW_LLM_TPM", "ONCEFLOW_LLM_CONCURRENCY",
		"ONCEFLOW_LLM_LIMITS", "ONCEFLOW_LLM_PRICES", "ONCEFLOW_LLM_ADMISSION_WAIT", "ONCEFLOW_TENANT_CONCURRENCY",
		"ONCEFLOW_TENANT_TOKEN_BUDGET"}},
	{GroupLedger, []string{"ONCEFLOW_LEDGER_LEASE", "ONCEFLOW_LEDGER_RETENTION", "ONCEFLOW_LEDGER_RELAXED_INSERT", "ONCEFLOW_LEDGER_KEEP_REQUESTS",
		"ONCEFLOW_LEDGER_GROUP_LINGER", "ONCEFLOW_LEDGER_DURABLE_ANSWERS"}},
	{GroupSender, []string{"ONCEFLOW_SENDER", "ONCEFLOW_WEBHOOK_URL", "ONCEFLOW_SMTP_URL", "ONCEFLOW_SMTP_FROM"}},
	{GroupRelay, []string{"ONCEFLOW_RELAY_INTERVAL", "ONCEFLOW_RELAY_LEASE", "ONCEFLOW_RELAY_MAX_ATTEMPTS", "ONCEFLOW_RELAY_BATCH_SIZE",
		"ONCEFLOW_RELAY_CONCURRENCY", "ONCEFLOW_OUTBOX_RETENTION"}},
	{GroupGateway, []string{"ONCEFLOW_GATEWAY_ADDR", "ONCEFLOW_GATEWAY_TIMEOUT", "ONCEFLOW_GATEWAY_MAX_BODY", "ONCEFLOW_GATEWAY_JOIN_TIMEOUT",
		"ONCEFLOW_GATEWAY_DERIVE_KEYS", "ONCEFLOW_GATEWAY_DERIVE_WINDOW", "ONCEFLOW_GATEWAY_TENANT_HEADER",
		"ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS"}},
	{GroupAudit, []string{"ONCEFLOW_AUDIT_MAX_AGE"}},
	{GroupHTTP, []string{"ONCEFLOW_HTTP_READ_HEADER_TIMEOUT", "ONCEFLOW_HTTP_READ_TIMEOUT", "ONCEFLOW_HTTP_IDLE_TIMEOUT",
		"ONCEFLOW_HTTP_MAX_HEADER_BYTES"}},
	{GroupMetrics, []string{"ONCEFLOW_METRICS_ADDR"}},
	{GroupShutdown, []string{"ONCEFLOW_SHUTDOWN_TIMEOUT"}},
	{GroupLogs, []string{"ONCEFLOW_LOG_FORMAT"}},
}

// Groups returns every group, in the order a command's -h shows them.
func Groups() []Group {
	out := make([]Group, len(groups))
	for i, g := range groups {
		out[i] = g.group
	}
	return out
}

// Flags returns the flag names of g's settings (Register's: --redis-url for
// ONCEFLOW_REDIS_URL), in the documented order; none for a Group this package does
// not define.
func (g Group) Flags() []string {
	for _, gr := range groups {
		if gr.group == g {
			out := make([]string, len(gr.envs))
			for i, env := range gr.envs {
				out[i] = setting{env: env}.flag()
			}
			return out
		}
	}
	return nil
}

// IsFlag reports whether name (without dashes) is the flag of a setting, one that
// Register adds.
func IsFlag(name string) bool {
	return slices.ContainsFunc(settings, func(s setting) bool { return s.flag() == name })
}

// Loader resolves a Config from defaults, the environment and the flags it registered.
type Loader struct {
	fs    *flag.FlagSet
	flags map[string]*string
}

// Register adds one string flag per setting to fs and returns the Loader that reads
// them. Call Load after fs.Parse.
func Register(fs *flag.FlagSet) *Loader {
	l := &Loader{fs: fs, flags: make(map[string]*string, len(settings))}
	for _, s := range settings {
		usage := fmt.Sprintf("%s (env %s", s.usage, s.env)
		if s.def != "" {
			usage += ", default " + s.def
		}
		usage += ")"
		l.flags[s.env] = fs.String(s.flag(), "", usage)
	}
	return l
}

// Load resolves every setting: a flag set on the command line wins over the variable
// from getenv, which wins over the default. It returns the first invalid value as an
// *Error, then any inconsistency between settings.
func (l *Loader) Load(getenv func(string) string) (*Config, error) {
	set := map[string]bool{}
	l.fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	c := Defaults()
	for _, s := range settings {
		v, name := s.def, s.env
		if e := getenv(s.env); e != "" {
			v = e
		}
		if set[s.flag()] {
			v, name = *l.flags[s.env], "--"+s.flag()
		}
		if err := s.parse(c, v); err != nil {
			shown := v
			if s.secret || strings.Contains(v, "://") || strings.Contains(v, "@") {
				shown = redactValue(v)
			}
			return nil, &Error{Name: name, Value: shown, Err: err}
		}
		c.raw[s.env] = v
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// validate checks settings that depend on each other.
func (c *Config) validate() error {
	switch {
	case c.Sender == "webhook" && c.WebhookURL == "":
		return &Error{Name: "ONCEFLOW_WEBHOOK_URL", Err: errors.New("required when ONCEFLOW_SENDER=webhook")}
	case c.Sender == "smtp" && c.SMTPURL == "":
		return &Error{Name: "ONCEFLOW_SMTP_URL", Err: errors.New("required when ONCEFLOW_SENDER=smtp")}
	case c.Sender == "smtp" && c.SMTPFrom == "":
		return &Error{Name: "ONCEFLOW_SMTP_FROM", Err: errors.New("required when ONCEFLOW_SENDER=smtp")}
	}
	for _, k := range c.AdminKeys {
		if _, tenant := c.APIKeys[k]; tenant {
			return &Error{Name: "ONCEFLOW_ADMIN_KEYS", Err: errors.New("an admin key is also a tenant's API key in ONCEFLOW_API_KEYS: tenant keys must never open the operator UI")}
		}
	}
	if c.RetryMax < c.RetryBase {
		return &Error{Name: "ONCEFLOW_RETRY_MAX", Value: c.raw["ONCEFLOW_RETRY_MAX"], Err: fmt.Errorf("must be at least ONCEFLOW_RETRY_BASE (%s)", c.RetryBase)}
	}
	if horizon := time.Duration(c.MaxDeliveries) * (max(c.ClaimIdle, c.RetryMax) + c.JobBudget); c.LedgerRetention < horizon {
		return &Error{Name: "ONCEFLOW_LEDGER_RETENTION", Value: c.raw["ONCEFLOW_LEDGER_RETENTION"],
			Err: fmt.Errorf("must cover the retry horizon ONCEFLOW_MAX_DELIVERIES × (max(ONCEFLOW_CLAIM_IDLE, ONCEFLOW_RETRY_MAX) + ONCEFLOW_JOB_BUDGET) = %s", horizon)}
	}
	return nil
}

// RequireAPIKeys reports an *Error when no API key is configured; serve calls it.
func (c *Config) RequireAPIKeys() error {
	if len(c.APIKeys) == 0 {
		return &Error{Name: "ONCEFLOW_API_KEYS", Err: errors.New("at least one TENANT:KEY pair is required")}
	}
	return nil
}

// Tenants returns the configured tenants, sorted.
func (c *Config) Tenants() []string {
	var ts []string
	for _, t := range c.APIKeys {
		if !slices.Contains(ts, t) {
			ts = append(ts, t)
		}
	}
	slices.Sort(ts)
	return ts
}

// Redacted returns every setting as NAME=value pairs in the documented order, with
// secrets replaced: API keys show only their tenants, provider keys show "[redacted]",
// URLs lose their passwords.
func (c *Config) Redacted() [][2]string {
	out := make([][2]string, 0, len(settings))
	for _, s := range settings {
		out = append(out, [2]string{s.env, c.shown(s)})
	}
	return out
}

// shown renders one setting of c for humans, secrets redacted.
func (c *Config) shown(s setting) string {
	v := c.raw[s.env]
	switch {
	case v == "":
		return ""
	case s.env == "ONCEFLOW_API_KEYS":
		return "tenants " + strings.Join(c.Tenants(), ",") + " [keys redacted]"
	case s.secret:
		return redactValue(v)
	case strings.Contains(v, "://"):
		return RedactURL(v)
	}
	return v
}

// String renders the configuration one NAME=value per line, secrets redacted.
func (c *Config) String() string {
	var b strings.Builder
	for _, kv := range c.Redacted() {
		fmt.Fprintf(&b, "%s=%s\n", kv[0], kv[1])
	}
	return b.String()
}

// LogValue renders the configuration for log/slog, secrets redacted.
func (c *Config) LogValue() slog.Value {
	attrs := make([]slog.Attr, 0, len(settings))
	for _, kv := range c.Redacted() {
		if kv[1] != "" {
			attrs = append(attrs, slog.String(kv[0], kv[1]))
		}
	}
	return slog.GroupValue(attrs...)
}

// RedactURL returns u with any password replaced by "xxxxx"; strings that do not parse
// as URLs are returned as "[redacted]" since they may hold anything.
func RedactURL(u string) string {
	if u == "" {
		return ""
	}
	p, err := url.Parse(u)
	if err != nil {
		return "[redacted]"
	}
	if p.RawQuery != "" {
		q := p.Query()
		for k, vs := range q {
			if secretParam(k) {
				for i := range vs {
					vs[i] = "[redacted]"
				}
			}
		}
		p.RawQuery = q.Encode()
	}
	return p.Redacted()
}

// secretParam reports whether a URL query parameter may carry a secret (pgx's
// password, an upstream's key or token): its name holds pass, key, token, secret,
// auth, cred or sig, whatever the case.
func secretParam(name string) bool {
	n := strings.ToLower(name)
	for _, s := range []string{"pass", "key", "token", "secret", "auth", "cred", "sig"} {
		if strings.Contains(n, s) {
			return true
		}
	}
	return false
}

// redactValue hides a secret: URLs keep scheme, host and path (password and query
// hidden), anything else becomes "[redacted]".
func redactValue(v string) string {
	if v == "" {
		return ""
	}
	if strings.Contains(v, "://") {
		p, err := url.Parse(v)
		if err != nil {
			return "[redacted]"
		}
		if p.RawQuery != "" {
			p.RawQuery = "[redacted]"
		}
		return p.Redacted()
	}
	return "[redacted]"
}

func parseURL(dst *string, v string, schemes ...string) error {
	u, err := url.Parse(v)
	if err != nil {
		return errors.New("not a URL") // url errors echo the value, which may hold a password
	}
	if !slices.Contains(schemes, u.Scheme) {
		return fmt.Errorf("scheme must be one of %s", strings.Join(schemes, ", "))
	}
	if u.Host == "" && u.Scheme != "unix" {
		return errors.New("missing host")
	}
	*dst = v
	return nil
}

func parseAddr(dst *string, v string) error {
	if _, port, err := net.SplitHostPort(v); err != nil {
		return err
	} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("invalid port %q", port)
	}
	*dst = v
	return nil
}

func parseEnum(dst *string, v string, allowed ...string) error {
	if !slices.Contains(allowed, v) {
		return fmt.Errorf("want one of %s", strings.Join(allowed, ", "))
	}
	*dst = v
	return nil
}

func parseDuration(dst *time.Duration, v string) error {
	d, err := time.ParseDuration(v)
	if err != nil {
		return err
	}
	if d <= 0 {
		return errors.New("must be positive")
	}
	*dst = d
	return nil
}

// parseDurationOrZero is parseDuration that also accepts 0 (the setting's "off").
func parseDurationOrZero(dst *time.Duration, v string) error {
	d, err := time.ParseDuration(v)
	if err != nil {
		return err
	}
	if d < 0 {
		return errors.New("must not be negative")
	}
	*dst = d
	return nil
}

func parseBool(dst *bool, v string) error {
	b, err := strconv.ParseBool(v)
	if err != nil {
		return errors.New("want true or false")
	}
	*dst = b
	return nil
}

// parseInt64 is parseInt for an int64.
func parseInt64(dst *int64, v string, lo, hi int64) error {
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || n < lo || n > hi {
		return fmt.Errorf("must be an integer between %d and %d", lo, hi)
	}
	*dst = n
	return nil
}

func parseInt(dst *int, v string, lo, hi int) error {
	n, err := strconv.Atoi(v)
	if err != nil {
		return errors.New("not an integer")
	}
	if n < lo || n > hi {
		return fmt.Errorf("must be between %d and %d", lo, hi)
	}
	*dst = n
	return nil
}

// parseAPIKeys reads "tenant:key,tenant:key". A key may map to only one tenant; tenants
// are 1 to 64 characters of [A-Za-z0-9._-]; keys are at least 16 printable characters.
func parseAPIKeys(c *Config, v string) error {
	keys := map[string]string{}
	if v == "" {
		c.APIKeys = keys
		return nil
	}
	for i, pair := range strings.Split(v, ",") {
		tenant, key, ok := strings.Cut(strings.TrimSpace(pair), ":")
		switch {
		case !ok:
			return fmt.Errorf("pair %d: want TENANT:KEY", i+1)
		case !validTenant(tenant):
			return fmt.Errorf("pair %d: tenant must be 1-64 characters of A-Z a-z 0-9 . _ -", i+1)
		case len(key) < 16 || strings.ContainsFunc(key, func(r rune) bool { return r <= ' ' || r > '~' }):
			return fmt.Errorf("pair %d (tenant %s): key must be at least 16 printable characters", i+1, tenant)
		}
		if other, dup := keys[key]; dup && other != tenant {
			return fmt.Errorf("pair %d: the same key is given to tenants %s and %s", i+1, other, tenant)
		}
		keys[key] = tenant
	}
	c.APIKeys = keys
	return nil
}

// parseClusterAddrs reads "host:port,host:port".
func parseClusterAddrs(c *Config, v string) error {
	c.RedisClusterAddrs = nil
	if v == "" {
		return nil
	}
	for i, a := range strings.Split(v, ",") {
		a = strings.TrimSpace(a)
		host, port, err := net.SplitHostPort(a)
		if n, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
			return fmt.Errorf("address %d: want host:port", i+1)
		}
		if !slices.Contains(c.RedisClusterAddrs, a) {
			c.RedisClusterAddrs = append(c.RedisClusterAddrs, a)
		}
	}
	return nil
}

// RedisClusterURL returns the cluster URL the cluster client is built from
// (onceflow.NewRedisCluster): RedisURL's scheme, user, password and query with the
// seed nodes RedisClusterAddrs; "" when no cluster is configured.
func (c *Config) RedisClusterURL() string {
	if len(c.RedisClusterAddrs) == 0 {
		return ""
	}
	u, err := url.Parse(c.RedisURL)
	if err != nil || u.Scheme == "unix" {
		u = &url.URL{Scheme: "redis"}
	}
	u.Host, u.Path = c.RedisClusterAddrs[0], ""
	q := u.Query()
	q.Del("db")
	for _, a := range c.RedisClusterAddrs[1:] {
		q.Add("addr", a)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// parseAdminKeys reads "key,key": each at least 16 printable characters.
func parseAdminKeys(c *Config, v string) error {
	c.AdminKeys = nil
	if v == "" {
		return nil
	}
	for i, k := range strings.Split(v, ",") {
		k = strings.TrimSpace(k)
		if len(k) < 16 || strings.ContainsFunc(k, func(r rune) bool { return r <= ' ' || r > '~' }) {
			return fmt.Errorf("key %d: an admin key must be at least 16 printable characters", i+1)
		}
		if !slices.Contains(c.AdminKeys, k) {
			c.AdminKeys = append(c.AdminKeys, k)
		}
	}
	return nil
}

// parseHeaderNames reads a comma-separated list of HTTP header names into
// GatewayCredentialHeaders.
func parseHeaderNames(c *Config, v string) error {
	c.GatewayCredentialHeaders = nil
	if v == "" {
		return nil
	}
	for i, name := range strings.Split(v, ",") {
		name = strings.TrimSpace(name)
		if !httpguts.ValidHeaderFieldName(name) {
			return fmt.Errorf("name %d: %q is not a valid HTTP header name", i+1, name)
		}
		c.GatewayCredentialHeaders = append(c.GatewayCredentialHeaders, name)
	}
	return nil
}

func validTenant(t string) bool {
	if len(t) == 0 || len(t) > 64 {
		return false
	}
	for _, r := range t {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}
