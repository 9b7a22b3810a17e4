package limiter

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
)

// limiterMetrics are the limiter's Prometheus metrics (docs/limits.md lists them). Unlike
// most of onceflow's, some carry a tenant label: the issue of a budget is per tenant,
// and a deployment's tenants are its API keys, a bounded set.
type limiterMetrics struct {
	wait               *prometheus.HistogramVec
	deferred           *prometheus.CounterVec
	pauses             *prometheus.CounterVec
	pausedUntil        *prometheus.GaugeVec
	rateLimited        *prometheus.CounterVec
	tokens             *prometheus.CounterVec
	cost               *prometheus.CounterVec
	budgetWaits        *prometheus.CounterVec
	redisErrors        prometheus.Counter
	settlementsDropped prometheus.Counter
}

// newMetrics returns the limiter's metrics, registered with reg; the series of model
// (the default model) and of calls of no tenant start at zero.
func newMetrics(reg prometheus.Registerer, model string) *limiterMetrics {
	m := &limiterMetrics{
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "onceflow_llm_admission_wait_seconds",
			Help:    "How long admitted model calls waited in-process for capacity, by model.",
			Buckets: []float64{0, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2, 5}}, []string{"model"}),
		deferred: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_llm_admission_deferred_total",
			Help: "Model calls put off by the limiter (the job waits without spending an attempt), by model and reason: requests or tokens per minute, concurrency, line, fair share, paused, budget, tenant concurrency. Each one put off for a rate limit is a 429 avoided."},
			[]string{"model", "reason"}),
		pauses: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_llm_pauses_total",
			Help: "Pauses of a model for the whole fleet this process started (a 429, an exhausted quota, no capacity left until a reset), by model."},
			[]string{"model"}),
		pausedUntil: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "onceflow_llm_paused_until_timestamp_seconds",
			Help: "The end of the latest pause of a model this process knows of (Unix seconds), by model."}, []string{"model"}),
		rateLimited: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_llm_rate_limited_total",
			Help: "Answers 429 (rate limited) from the provider, by model: with the limiter on, a few at most."}, []string{"model"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_llm_tokens_total",
			Help: "Tokens of model calls by tenant, model and kind: reserved at admission (estimate plus output), used (charged: the answer's usage, or the reservation when the answer was lost), wasted (charged for calls whose answer was lost)."},
			[]string{"tenant", "model", "kind"}),
		cost: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_llm_cost_usd_total",
			Help: "What the model calls cost in US dollars by the price table (limiter.DefaultPrices, ONCEFLOW_LLM_PRICES), by tenant and model."},
			[]string{"tenant", "model"}),
		budgetWaits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "onceflow_llm_budget_waits_total",
			Help: "Model calls put off because their tenant's daily token budget is spent (the job stays queued until the next UTC day), by tenant."},
			[]string{"tenant"}),
		redisErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_llm_limiter_redis_errors_total",
			Help: "Round trips of the limiter that Redis failed."}),
		settlementsDropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "onceflow_llm_limiter_settlements_dropped_total",
			Help: "Settlements dropped while Redis was down and too many were waiting: their permits' leases end them."}),
	}
	m.wait = metrics.Register(reg, m.wait)
	m.deferred = metrics.Register(reg, m.deferred)
	m.pauses = metrics.Register(reg, m.pauses)
	m.pausedUntil = metrics.Register(reg, m.pausedUntil)
	m.rateLimited = metrics.Register(reg, m.rateLimited)
	m.tokens = metrics.Register(reg, m.tokens)
	m.cost = metrics.Register(reg, m.cost)
	m.budgetWaits = metrics.Register(reg, m.budgetWaits)
	m.redisErrors = metrics.Register(reg, m.redisErrors)
	m.settlementsDropped = metrics.Register(reg, m.settlementsDropped)
	models, none := []string{model}, []string{tenantLabel("")}
	metrics.InitHistogram(m.wait, models)
	metrics.Init(m.deferred, models, []string{"requests per minute", "tokens per minute", "concurrency", "fair share", "paused", "recovering", "budget", "budget reserved", "tenant concurrency"})
	metrics.Init(m.pauses, models)
	metrics.Init(m.rateLimited, models)
	metrics.Init(m.tokens, none, models, []string{"reserved", "used", "wasted"})
	metrics.Init(m.cost, none, models)
	metrics.Init(m.budgetWaits, none)
	m.pausedUntil.WithLabelValues(model)
	return m
}

func (m *limiterMetrics) admitted(model string, waited time.Duration) {
	m.wait.WithLabelValues(model).Observe(waited.Seconds())
}
