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
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/ledger"
	"github.com/onceflow/onceflow/llm/llmmetrics"
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

// modelBreaker returns the breaker of the process's model calls, made on first use: the
// roles that call the model (work, run) make it before their HTTP server, so /readyz
// reports it.
func (d *deps) modelBreaker() (*breaker.Breaker, error) {
	if d.llmBreaker != nil {
		return d.llmBreaker, nil
	}
	b, err := breaker.New(breaker.Config{Name: "llm", ProbeInterval: d.cfg.LLMQuotaProbe, Logger: d.log, Registerer: d.reg})
	if err != nil {
		return nil, &config.Error{Name: "ONCEFLOW_LLM_QUOTA_PROBE", Err: err}
	}
	d.llmBreaker = b
	return b, nil
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

func (d *deps) buildAPI(s *httpapi.Server) error {
	if err := d.cfg.RequireAPIKeys(); err != nil {
		return err
	}
	store, err := redisstore.New(d.rdb, redisstore.Config{
		Prefix:    d.cfg.Prefix,
		ResultTTL: d.cfg.ResultTTL,
		Logger:    d.log,
	})
	if err != nil {
		return err
	}
	mw, err := idempotency.New(idempotency.Config{
		Store: store,
		Tenant: func(r *http.Request) (string, error) {
			if t, ok := httpapi.TenantFrom(r.Context()); ok {
				return t, nil
			}
			return "", idempotency.ErrUnauthenticated
		},
		LockTTL:          d.cfg.LockTTL,
		ResultTTL:        d.cfg.ResultTTL,
		StoreTimeout:     d.cfg.IdempotencyTimeout,
		MaxResponseBytes: d.cfg.IdempotencyResponseLimit,
		Logger:           d.log,
		Registerer:       d.reg,
	})
	if err != nil {
		return err
	}
	api, err := summaries.NewAPI(summaries.APIConfig{
		Redis: d.rdb, DB: d.pool, Keys: d.keys(), Idempotency: mw, Store: store,
		Timeout: d.cfg.IdempotencyTimeout, Logger: d.log,
		Registerer: d.reg, TraceParent: d.traceParent(),
	})
	if err != nil {
		return err
	}
	api.Register(s, httpapi.NewAuthenticator(d.cfg.APIKeys))
	return nil
}

// buildHandler returns the summaries job handler with the configured model, its calls
// going through the llm_calls ledger (seed 001).
func (d *deps) buildHandler() (queue.Handler, error) {
	m := llmmetrics.New(d.reg)
	client, err := newLLMClient(d.cfg)
	if err != nil {
		return nil, err
	}
	l, err := ledger.New(d.pool, ledger.Config{
		Lease: d.cfg.LedgerLease, Retention: d.cfg.LedgerRetention, RelaxedInsert: d.cfg.LedgerRelaxedInsert,
		Models: []string{d.cfg.LLMModel}, Logger: d.log, Registerer: d.reg,
	})
	if err != nil {
		return nil, &config.Error{Name: "ledger settings", Err: err}
	}
	d.ledger = l
	b, err := d.modelBreaker()
	if err != nil {
		return nil, err
	}
	// Inside the ledger: llmmetrics counts and traces real calls only, not replays.
	client = m.Instrument(d.cfg.LLM, client)
	if d.tp != nil {
		client = onceflowotel.LLMClient(d.tp, d.cfg.LLM, client)
	}
	h, err := summaries.NewHandler(summaries.HandlerConfig{
		DB:       d.pool,
		LLM:      client,
		Model:    d.cfg.LLMModel,
		Ledger:   l,
		Breaker:  b,
		Provider: d.cfg.LLM,
		Retry: retry.Policy{
			MaxAttempts:    d.cfg.LLMMaxAttempts,
			PerCallTimeout: d.cfg.LLMTimeout,
			OnRetry:        m.OnRetry,
		},
		Budget: d.cfg.JobBudget,
		Logger: d.log,
	})
	if err != nil {
		return nil, err
	}
	return d.traceJobs(summaries.Instrument(h, d.reg)), nil
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
