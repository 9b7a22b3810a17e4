// Package llmmetrics exports Prometheus metrics for model calls and their retries,
// following internal/metrics: collectors built from a prometheus.Registerer (nil: not
// exported), bounded labels initialised up front, registration with metrics.Register
// so several components can share one registry.
//
//	onceflow_llm_calls_total{provider, outcome}         outcome "ok" or a retry.Class
//	onceflow_llm_call_duration_seconds{provider}        one attempt, success or not
//	onceflow_llm_retries_total{class, source}           source "backoff" or "retry_after"
//	onceflow_llm_retry_delay_seconds                    the sleeps before retries
package llmmetrics

import (
	"context"
	"iter"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// Metrics holds the collectors. Its methods are safe for concurrent use.
type Metrics struct {
	calls      *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	retries    *prometheus.CounterVec
	retryDelay prometheus.Histogram
}

// New builds the collectors and registers them with reg (nil: not exported).
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		calls: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "calls_total",
			Help: "Model calls (attempts) by provider and outcome: ok, or the retry class of the failure.",
		}, []string{"provider", "outcome"})),
		duration: metrics.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "call_duration_seconds",
			Help:    "Duration of one model call (attempt), success or not.",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40},
		}, []string{"provider"})),
		retries: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "retries_total",
			Help: "In-process retries by the failure's class and whether the delay came from the backoff or the server's Retry-After.",
		}, []string{"class", "source"})),
		retryDelay: metrics.Register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "retry_delay_seconds",
			Help:    "Sleep before an in-process retry.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 30},
		})),
	}
	var classes []string
	for _, c := range retry.Classes() {
		classes = append(classes, string(c))
	}
	metrics.Init(m.retries, classes, []string{"backoff", "retry_after"})
	return m
}

// OnRetry records one retry; use it as retry.Policy.OnRetry (or call it from yours).
func (m *Metrics) OnRetry(r retry.Retry) {
	source := "backoff"
	if r.FromRetryAfter {
		source = "retry_after"
	}
	m.retries.WithLabelValues(string(r.Class), source).Inc()
	m.retryDelay.Observe(r.Delay.Seconds())
}

// Instrument returns c counting every Complete and Stream under provider, which must
// be a fixed name ("openai", "anthropic", "fake") so labels stay bounded.
func (m *Metrics) Instrument(provider string, c llm.Client) llm.Client {
	outcomes := []string{"ok"}
	for _, cl := range retry.Classes() {
		outcomes = append(outcomes, string(cl))
	}
	metrics.Init(m.calls, []string{provider}, outcomes)
	metrics.InitHistogram(m.duration, []string{provider})
	return &instrumented{m: m, provider: provider, next: c}
}

type instrumented struct {
	m        *Metrics
	provider string
	next     llm.Client
}

func (i *instrumented) observe(start time.Time, err error) {
	outcome := "ok"
	if err != nil {
		outcome = string(retry.Classify(err).Class)
	}
	i.m.calls.WithLabelValues(i.provider, outcome).Inc()
	i.m.duration.WithLabelValues(i.provider).Observe(time.Since(start).Seconds())
}

func (i *instrumented) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	start := time.Now()
	resp, err := i.next.Complete(ctx, req)
	i.observe(start, err)
	return resp, err
}

func (i *instrumented) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		start := time.Now()
		var failed error
		done := false
		defer func() {
			if done || failed != nil {
				i.observe(start, failed)
			}
		}()
		for c, err := range i.next.Stream(ctx, req) {
			if err != nil {
				failed = err
			}
			if c.Done {
				done = true
			}
			if !yield(c, err) {
				return
			}
		}
	}
}
