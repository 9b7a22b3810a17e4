package cli

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/ledger"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

// deps are the connections and the metrics registry the roles of one process share:
// `onceflow run` builds one set for serve, work and relay, so all their metrics appear on
// one /metrics.
type deps struct {
	cfg  *config.Config
	log  *slog.Logger
	reg  *prometheus.Registry
	rdb  *redis.Client
	pool *pgxpool.Pool
	// tp traces the roles' work; nil when tracing is off (see startTracing).
	tp trace.TracerProvider
	// stopTracing flushes the last spans; Close calls it. Nil when tracing is off.
	stopTracing func()
	// ledger is the llm_calls ledger buildHandler made (nil before); its Run purges
	// expired rows and runs beside the worker.
	ledger *ledger.Ledger
	// llmBreaker stops model calls while the provider's quota is exhausted, and holds
	// the worker back meanwhile (its Gate); nil until buildHandler made it.
	llmBreaker *breaker.Breaker
	// client hosts the summaries workflow with the model, apiClient without it (serve
	// alone); see summariesClient. Nil until made.
	client, apiClient *onceflow.Client
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
		rdb, err := onceflow.NewRedis(cfg.RedisURL)
		if err != nil {
			return nil, &config.Error{Name: "ONCEFLOW_REDIS_URL", Value: config.RedactURL(cfg.RedisURL), Err: err}
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
		c["redis"] = func(ctx context.Context) error { return d.rdb.Ping(ctx).Err() }
	}
	if d.pool != nil {
		c["postgres"] = d.pool.Ping
	}
	if b := d.llmBreaker; b != nil {
		// Reported, never failing: the API still accepts jobs while the provider is
		// stopped, and the workers hold theirs.
		c["llm"] = func(context.Context) error { return httpapi.Degraded(b.Err()) }
	}
	return c
}

// modelBreaker returns the breaker of the process's model calls, the summaries
// Client's (made on first use with the model): the roles that call the model (work, run)
// make it before their HTTP server, so /readyz reports it.
func (d *deps) modelBreaker() (*breaker.Breaker, error) {
	if d.llmBreaker != nil {
		return d.llmBreaker, nil
	}
	c, err := d.summariesClient(true)
	if err != nil {
		return nil, err
	}
	d.llmBreaker = c.ModelBreaker()
	return d.llmBreaker, nil
}

// summariesClient returns the process's onceflow.Client hosting the summaries workflow,
// made on first use from the settings: with the model (the llm_calls ledger, the
// breaker) when withModel, as the roles that run jobs need; without it for the routes of
// serve alone. `onceflow run` makes it with the model first, so its API and worker
// share one.
func (d *deps) summariesClient(withModel bool) (*onceflow.Client, error) {
	switch {
	case d.client != nil:
		return d.client, nil
	case !withModel && d.apiClient != nil:
		return d.apiClient, nil
	}
	cfg, err := d.clientConfig(withModel)
	if err != nil {
		return nil, err
	}
	cfg.Workflows = []onceflow.Workflow{summaries.Workflow(summaries.Options{
		Tenant: tenantFromAuth,
		Model:  d.cfg.LLMModel,
		Queue: onceflow.QueueConfig{
			Concurrency: d.cfg.WorkerConcurrency, ClaimIdle: d.cfg.ClaimIdle, MaxDeliveries: d.cfg.MaxDeliveries,
			ShutdownTimeout: d.cfg.ShutdownTimeout, StatsInterval: d.cfg.StatsInterval,
		},
		Timeout: d.cfg.IdempotencyTimeout, LockTTL: d.cfg.LockTTL, MaxResponseBytes: d.cfg.IdempotencyResponseLimit,
		AuditMaxAge: d.cfg.AuditMaxAge, AuditRetention: d.cfg.OutboxRetention,
		Logger: d.log, Registerer: d.reg,
	})}
	c, err := onceflow.NewClient(cfg)
	if err != nil {
		return nil, &config.Error{Name: "summaries settings", Err: err}
	}
	if withModel {
		d.client, d.ledger = c, c.Ledger()
	} else {
		d.apiClient = c
	}
	return c, nil
}

// clientConfig is the onceflow.Config of the command's Clients, built-in and hosted:
// d's connections, logger, metrics and tracing, the ONCEFLOW_* budget and TTL, and with
// withModel the model of ONCEFLOW_LLM with its retry policy and ledger settings.
func (d *deps) clientConfig(withModel bool) (onceflow.Config, error) {
	cfg := onceflow.Config{
		Redis: d.rdb, DB: d.pool, Prefix: d.cfg.Prefix, ResultTTL: d.cfg.ResultTTL, JobBudget: d.cfg.JobBudget,
		Logger: d.log, Registerer: d.reg, TraceParent: d.traceParent(),
	}
	if !withModel {
		return cfg, nil
	}
	client, err := newLLMClient(d.cfg)
	if err != nil {
		return cfg, err
	}
	// The Client counts the calls (llmmetrics, inside the ledger) on cfg.Registerer.
	if d.tp != nil {
		client = onceflowotel.LLMClient(d.tp, d.cfg.LLM, client)
	}
	cfg.Model, cfg.Provider, cfg.QuotaProbe = client, d.cfg.LLM, d.cfg.LLMQuotaProbe
	cfg.ModelRetry = retry.Policy{MaxAttempts: d.cfg.LLMMaxAttempts, PerCallTimeout: d.cfg.LLMTimeout}
	cfg.Ledger = ledger.Config{
		Lease: d.cfg.LedgerLease, Retention: d.cfg.LedgerRetention, RelaxedInsert: d.cfg.LedgerRelaxedInsert,
		Models: []string{d.cfg.LLMModel},
	}
	return cfg, nil
}

// tenantFromAuth is the tenant httpapi's bearer-key authentication put in the request's
// context.
func tenantFromAuth(r *http.Request) (string, error) {
	if t, ok := httpapi.TenantFrom(r.Context()); ok {
		return t, nil
	}
	return "", idempotency.ErrUnauthenticated
}

// keys names the service's queue under ONCEFLOW_PREFIX.
func (d *deps) keys() queue.Keys { return serviceKeys(d.cfg) }

// serviceKeys names the service's queue, summaries, under ONCEFLOW_PREFIX.
func serviceKeys(cfg *config.Config) queue.Keys {
	return queue.Keys{Prefix: cfg.Prefix, Queue: summaries.QueueName}
}

// httpServer returns the health, readiness and metrics endpoints over d's stores; the
// API adds its routes to it, work and relay serve it on ONCEFLOW_METRICS_ADDR.
func (d *deps) httpServer() *httpapi.Server {
	return httpapi.New(httpapi.Config{Logger: d.log, Registry: d.reg, Checks: d.checks()})
}

// apiServer returns the HTTP server of serve and run: d's health, readiness and metrics
// endpoints plus the summaries routes behind bearer-key authentication (the
// single-round-trip idempotent accept and the status read).
func (d *deps) apiServer() (*httpapi.Server, error) {
	s := d.httpServer()
	return s, d.buildAPI(s)
}

// The statuses each summaries route answers, initialised at zero in
// onceflow_http_requests_total.
var (
	postCodes = []int{http.StatusAccepted, http.StatusBadRequest, http.StatusUnauthorized, http.StatusRequestTimeout,
		http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity, http.StatusServiceUnavailable}
	getCodes = []int{http.StatusOK, http.StatusUnauthorized, http.StatusNotFound, http.StatusServiceUnavailable}
)

// buildAPI mounts the summaries workflow's routes (Client.Mount) on s behind bearer-key
// authentication, each under its own route label.
func (d *deps) buildAPI(s *httpapi.Server) error {
	if err := d.cfg.RequireAPIKeys(); err != nil {
		return err
	}
	c, err := d.summariesClient(false)
	if err != nil {
		return err
	}
	// Optional: the first accept then costs one round trip rather than two.
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.IdempotencyTimeout)
	defer cancel()
	if err := c.LoadScripts(ctx); err != nil {
		d.log.Warn("cannot load the accept script; it is sent with the first accept", "err", err)
	}
	mux := http.NewServeMux()
	if err := c.Mount(mux); err != nil {
		return err
	}
	auth := httpapi.NewAuthenticator(d.cfg.APIKeys)
	s.Handle("POST /v1/summaries", "/v1/summaries", auth.Require(mux), postCodes...)
	s.Handle("GET /v1/summaries/{job_id}", "/v1/summaries/{job_id}", auth.Require(mux), getCodes...)
	return nil
}

// buildHandler returns the queue.Handler of the summaries queue: the summaries
// Client's (Client.Handler), its model calls going through the llm_calls ledger, traced
// when tracing is on.
func (d *deps) buildHandler() (queue.Handler, error) {
	if _, err := d.modelBreaker(); err != nil {
		return nil, err
	}
	c, err := d.summariesClient(true)
	if err != nil {
		return nil, err
	}
	return d.traceJobs(c.Handler(summaries.QueueName)), nil
}

// traceJobs wraps h with a span per delivery when tracing is on.
func (d *deps) traceJobs(h queue.Handler) queue.Handler {
	if d.tp == nil {
		return h
	}
	return onceflowotel.QueueHandler(d.tp, summaries.QueueName, h)
}

// traceParent returns what the API writes in a job's traceparent field: the request
// span's, when tracing is on.
func (d *deps) traceParent() func(context.Context) string {
	if d.tp == nil {
		return nil
	}
	return onceflowotel.TraceParent
}

// newLLMClient returns the model client ONCEFLOW_LLM selects.
func newLLMClient(cfg *config.Config) (llm.Client, error) {
	switch cfg.LLM {
	case "openai":
		return openai.New(openai.Config{BaseURL: cfg.LLMBaseURL, APIKey: cfg.OpenAIAPIKey, Model: cfg.LLMModel}), nil
	case "anthropic":
		// The Anthropic adapter's base URL has no /v1; accept one by habit.
		return anthropic.New(anthropic.Config{BaseURL: strings.TrimSuffix(strings.TrimSuffix(cfg.LLMBaseURL, "/"), "/v1"),
			APIKey: cfg.AnthropicAPIKey, Model: cfg.LLMModel}), nil
	case "fake":
		return fake.New(), nil
	}
	return nil, &config.Error{Name: "ONCEFLOW_LLM", Value: cfg.LLM, Err: errors.New("unknown provider")}
}

// background returns the background roles of what d built: the ledger's purge of
// expired rows once buildHandler ran.
func (d *deps) background() []func(context.Context) error {
	if d.ledger == nil {
		return nil
	}
	return []func(context.Context) error{d.ledger.Run}
}

// buildWorker returns the queue worker running h.
func (d *deps) buildWorker(h queue.Handler) (*queue.Worker, error) {
	wc := queue.WorkerConfig{
		Redis: d.rdb, Keys: d.keys(), Handler: h,
		Concurrency:     d.cfg.WorkerConcurrency,
		ClaimIdle:       d.cfg.ClaimIdle,
		MaxDeliveries:   d.cfg.MaxDeliveries,
		ShutdownTimeout: d.cfg.ShutdownTimeout,
		StatsInterval:   d.cfg.StatsInterval,
		Logger:          d.log,
		Registerer:      d.reg,

		// The job index lives ONCEFLOW_RESULT_TTL after the job, like the stored response.
		JobTTL:              d.cfg.ResultTTL,
		DeadLetterRetention: dlqRetention(d.cfg),
	}
	if d.llmBreaker != nil {
		wc.Gate = d.llmBreaker
	}
	w, err := queue.NewWorker(wc)
	if err != nil {
		return nil, &config.Error{Name: "worker settings", Err: err}
	}
	return w, nil
}

// buildRelay returns the outbox relay with the sender ONCEFLOW_SENDER selects.
func (d *deps) buildRelay() (*outbox.Relay, error) {
	sender, err := newOutboxSender(d.cfg, d.log)
	if err != nil {
		return nil, err
	}
	if d.tp != nil {
		sender = onceflowotel.Sender(d.tp, sender)
	}
	r, err := outbox.NewRelay(pgoutbox.New(d.pool), sender, relayConfig(d.cfg, d.log, d.reg))
	if err != nil {
		return nil, &config.Error{Name: "relay settings", Err: err}
	}
	return r, nil
}
