package cli

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// deps are the connections and the metrics registry the roles of one process share:
// `onceflow run` builds one set for serve, work and relay, so all their metrics appear on
// one /metrics.
type deps struct {
	cfg  *config.Config
	log  *slog.Logger
	reg  *prometheus.Registry
	rdb  redis.UniversalClient // a *redis.ClusterClient with ONCEFLOW_REDIS_CLUSTER_ADDRS
	pool *pgxpool.Pool
	// tp traces the roles' work; nil when tracing is off (see startTracing).
	tp trace.TracerProvider
	// stopTracing flushes the last spans; Close calls it. Nil when tracing is off.
	stopTracing func()
	// breakers are the circuit breakers of the Client whose workers this process runs
	// (Inspector.Breakers: redis, postgres, llm), by name, which /readyz reports; nil until
	// appClient made a Client with the model (run, work).
	breakers map[string]*breaker.Breaker
	// routeStatuses are the statuses of the workflows' routes, by pattern
	// (Host.RouteStatuses), created at zero by appServer.
	routeStatuses map[string][]int
	// redisDegraded makes /readyz report Redis without failing on it: the relay needs it
	// only for EnqueueTx's jobs and sends every other effect without it.
	redisDegraded bool
	// background are the parts appServer added that run beside the HTTP server (the
	// operator UI's sampler); runAll runs them.
	background []func(context.Context) error
}

// newRoleDeps is newDeps for the long-running roles (serve, work, relay, run): it also
// starts tracing when OTEL_EXPORTER_OTLP_ENDPOINT is set, and Close flushes it.
func newRoleDeps(ctx context.Context, e *env, cfg *config.Config, log *slog.Logger, redisToo, postgresToo bool) (*deps, error) {
	d, err := newDeps(ctx, cfg, log, redisToo, postgresToo)
	if err != nil {
		return nil, err
	}
	if err := d.startTracing(ctx, e); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// newDeps opens the clients a process needs (they connect lazily, so a process starts
// while a store is down and reports it through /readyz). Close releases them.
func newDeps(ctx context.Context, cfg *config.Config, log *slog.Logger, redisToo, postgresToo bool) (*deps, error) {
	d := &deps{cfg: cfg, log: log, reg: newRegistry()}
	if redisToo {
		rdb, err := newRedis(cfg)
		if err != nil {
			return nil, err
		}
		d.rdb = rdb
	}
	if postgresToo {
		pool, err := onceflow.NewPostgres(ctx, cfg.DatabaseURL)
		if err != nil {
			d.Close()
			return nil, &config.Error{Name: "ONCEFLOW_DATABASE_URL", Value: config.RedactURL(cfg.DatabaseURL), Err: err}
		}
		d.pool = pool
	}
	return d, nil
}

// Close flushes tracing, then releases the clients. Call it once the roles stopped.
func (d *deps) Close() {
	if d.stopTracing != nil {
		d.stopTracing()
	}
	if d.rdb != nil {
		_ = d.rdb.Close()
	}
	if d.pool != nil {
		d.pool.Close()
	}
}

// checks returns the readiness checks of the stores d holds.
func (d *deps) checks() map[string]httpapi.Check {
	c := map[string]httpapi.Check{}
	if d.rdb != nil {
		// While the workers' breaker of a store is open, /readyz says since when and why
		// (and answers without waiting for the store).
		// On a cluster, every primary is pinged, and those that do not answer named: some
		// of them silent is degraded (reported, 200), all of them down.
		c["redis"] = httpapi.BreakerCheck(d.breakers["redis"], func(ctx context.Context) error {
			if err := onceflow.PingRedis(ctx, d.rdb); errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
				return httpapi.Degraded(err)
			} else {
				return err
			}
		})
		if d.redisDegraded {
			c["redis"] = func(ctx context.Context) error { return httpapi.Degraded(onceflow.PingRedis(ctx, d.rdb)) }
		}
	}
	if d.pool != nil {
		c["postgres"] = httpapi.BreakerCheck(d.breakers["postgres"], d.pool.Ping)
	}
	if b := d.breakers["llm"]; b != nil {
		// Reported, never failing: the API still accepts jobs while the provider is
		// stopped (an exhausted quota, a run of 5xx), and the workers hold theirs.
		c["llm"] = func(context.Context) error { return httpapi.Degraded(b.Err()) }
	}
	return c
}

// clientConfig is the onceflow.Config of the command's Client (appClient):
// d's connections, logger, metrics and tracing, the ONCEFLOW_* budget and TTL, and with
// withModel the model of ONCEFLOW_LLM (app's provider) with its retry policy and
// ledger settings.
func (d *deps) clientConfig(app App, withModel bool) (onceflow.Config, error) {
	cfg := onceflow.Config{
		Redis: d.rdb, DB: d.pool, Prefix: d.cfg.Prefix, ResultTTL: d.cfg.ResultTTL, JobBudget: d.cfg.JobBudget,
		Logger: d.log, Registerer: d.reg, TraceParent: d.traceParent(),
		BreakerThreshold: d.cfg.BreakerThreshold, HealthInterval: d.cfg.HealthInterval,
		WaitReplicas: d.cfg.RedisWaitReplicas, WaitTimeout: d.cfg.RedisWaitTimeout,
	}
	if !withModel {
		return cfg, nil
	}
	client, err := app.newLLMClient(d.cfg)
	if err != nil {
		return cfg, err
	}
	// The Client counts the calls (llmmetrics, inside the ledger) on cfg.Registerer.
	if d.tp != nil {
		client = onceflowotel.LLMClient(d.tp, d.cfg.LLM, client)
	}
	cfg.Model, cfg.Provider, cfg.QuotaProbe = client, d.cfg.LLM, d.cfg.LLMQuotaProbe
	cfg.Shadows = d.cfg.Shadows
	if d.cfg.SummariesLane == "batch" {
		api, err := app.newBatchAPI(d.cfg)
		if err != nil {
			return cfg, err
		}
		cfg.Batch = batchConfig(d.cfg, api)
	}
	cfg.NoLimits = !d.cfg.LLMAdmission
	cfg.Limits = limitsConfig(d.cfg)
	cfg.ModelRetry = retry.Policy{MaxAttempts: d.cfg.LLMMaxAttempts, PerCallTimeout: d.cfg.LLMTimeout}
	cfg.Ledger = ledger.Config{
		Lease: d.cfg.LedgerLease, Retention: d.cfg.LedgerRetention, RelaxedInsert: d.cfg.LedgerRelaxedInsert,
		KeepRequests: d.cfg.LedgerKeepRequests, GroupLinger: d.cfg.LedgerGroupLinger,
		Models: []string{d.cfg.LLMModel},
	}
	cfg.DurableAnswers = d.cfg.LedgerDurableAnswers
	return cfg, nil
}

// limitsConfig is the model limiter's configuration from the ONCEFLOW_LLM_* and
// ONCEFLOW_TENANT_* limits (docs/limits.md); the caller adds its connections.
func limitsConfig(c *config.Config) limiter.Config {
	return limiter.Config{
		DefaultModel: c.LLMModel,
		Limits:       limiter.Limits{RPM: c.LLMRPM, TPM: c.LLMTPM, Concurrency: c.LLMConcurrency},
		Models:       c.LLMLimits, Prices: c.LLMPrices, MaxWait: c.LLMAdmissionWait,
		TenantConcurrency: c.TenantConcurrency, TenantTokenBudget: c.TenantTokenBudget,
	}
}

// httpServer returns the health, readiness and metrics endpoints over d's stores and
// the role's extra readiness checks (by name; nil for none); the API adds its routes to
// it, work and relay serve it on ONCEFLOW_METRICS_ADDR.
func (d *deps) httpServer(extra map[string]httpapi.Check) *httpapi.Server {
	checks := d.checks()
	maps.Copy(checks, extra)
	return httpapi.New(httpapi.Config{Logger: d.log, Registry: d.reg, Checks: checks})
}

// traceParent returns what the API writes in a job's traceparent field: the request
// span's, when tracing is on.
func (d *deps) traceParent() func(context.Context) string {
	if d.tp == nil {
		return nil
	}
	return onceflowotel.TraceParent
}

// buildWorker returns a queue worker running h on the queue keys names, with the
// ONCEFLOW_* worker settings: `work --test-handler`'s (test builds only); the workflows'
// workers are their Client's (Client.RunWorkers).
func (d *deps) buildWorker(keys queue.Keys, h queue.Handler) (*queue.Worker, error) {
	wc := queue.WorkerConfig{
		Redis: d.rdb, Keys: keys, Handler: h,
		Concurrency:     d.cfg.WorkerConcurrency,
		ClaimIdle:       d.cfg.ClaimIdle,
		MaxDeliveries:   d.cfg.MaxDeliveries,
		ShutdownTimeout: d.cfg.ShutdownTimeout,
		StatsInterval:   d.cfg.StatsInterval,
		RecordSuccesses: d.cfg.RecordSuccesses,
		Logger:          d.log,
		Registerer:      d.reg,

		// The job index lives ONCEFLOW_RESULT_TTL after the job, like the stored response.
		JobTTL:              d.cfg.ResultTTL,
		DeadLetterRetention: dlqRetention(d.cfg),
	}
	w, err := queue.NewWorker(wc)
	if err != nil {
		return nil, &config.Error{Name: "worker settings", Err: err}
	}
	return w, nil
}

// newRedis returns the Redis client cfg names: a cluster client over
// ONCEFLOW_REDIS_CLUSTER_ADDRS when set, else a client of ONCEFLOW_REDIS_URL.
func newRedis(cfg *config.Config) (redis.UniversalClient, error) {
	if u := cfg.RedisClusterURL(); u != "" {
		rdb, err := onceflow.NewRedisCluster(u)
		if err != nil {
			return nil, &config.Error{Name: "ONCEFLOW_REDIS_CLUSTER_ADDRS", Value: strings.Join(cfg.RedisClusterAddrs, ","), Err: err}
		}
		return rdb, nil
	}
	rdb, err := onceflow.NewRedis(cfg.RedisURL)
	if err != nil {
		return nil, &config.Error{Name: "ONCEFLOW_REDIS_URL", Value: config.RedactURL(cfg.RedisURL), Err: err}
	}
	return rdb, nil
}

// warnTrialSettings warns, as a role starts, of the defaults meant for a trial that a
// production start may have left: the built-in fake model (for a role that calls the
// model) and the log sender (for a role that delivers effects).
func warnTrialSettings(ctx context.Context, log *slog.Logger, cfg *config.Config, model, sender bool) {
	if model && cfg.LLM == fakeProvider.Name {
		log.WarnContext(ctx, "ONCEFLOW_LLM is fake: the model's answers are made up by the built-in fake model, a setting for trials; "+
			"set ONCEFLOW_LLM to a provider (openai, anthropic) for real answers")
	}
	if sender && cfg.Sender == "log" {
		log.WarnContext(ctx, "ONCEFLOW_SENDER is log: effects sent with it are written to the log and marked sent, never delivered, "+
			"a setting for trials; set ONCEFLOW_SENDER to webhook or smtp to deliver them")
	}
}

// batchConfig is the batch lane's configuration from the ONCEFLOW_BATCH_* settings.
func batchConfig(c *config.Config, api onceflow.BatchAPI) onceflow.BatchConfig {
	b := onceflow.BatchConfig{API: api, MaxItems: c.BatchMaxItems, MaxAge: c.BatchMaxAge, PollInterval: c.BatchPollInterval, MaxBytes: c.BatchMaxBytes,
		SubmitTimeout: c.BatchSubmitTimeout}
	if c.BatchEnqueuedTokens > 0 {
		b.EnqueuedTokens = map[string]int64{"*": c.BatchEnqueuedTokens}
	}
	return b
}
