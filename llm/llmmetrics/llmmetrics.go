// Package llmmetrics exports Prometheus metrics for model calls and their retries,
// following internal/metrics: collectors built from a prometheus.Registerer (nil: not
// exported), bounded labels initialised up front, registration with metrics.Register
// so several components can share one registry.
//
//	onceflow_llm_calls_total{provider, outcome}         outcome "ok" or a retry.Class
//	onceflow_llm_call_duration_seconds{provider}        one attempt, success or not
//	onceflow_llm_retries_total{class, source}           source "backoff" or "retry_after"
//	onceflow_llm_retry_delay_seconds                    the sleeps before retries
//	onceflow_llm_retry_wait_seconds_total{source}       time slept before retries, by source
//	onceflow_llm_ambiguous_failures_total{provider}     failed attempts the provider may have run
//
// An attempt is one request to the provider: onceflow_llm_calls_total counts attempts,
// and since every retry is followed by one attempt, first attempts are calls minus
// retries.
package llmmetrics

import (
	"context"
	"errors"
	"iter"
	"net"
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
	retryWait  *prometheus.CounterVec
	ambiguous  *prometheus.CounterVec
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
		retryWait: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "retry_wait_seconds_total",
			Help: "Time slept before in-process retries, by source: the jittered backoff or the server's Retry-After.",
		}, []string{"source"})),
		ambiguous: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "ambiguous_failures_total",
			Help: "Failed attempts without an answer after the request may have reached the provider (timeout, reset, stream cut): the provider may have run, and billed, them.",
		}, []string{"provider"})),
	}
	var classes []string
	for _, c := range retry.Classes() {
		classes = append(classes, string(c))
	}
	metrics.Init(m.retries, classes, []string{"backoff", "retry_after"})
	metrics.Init(m.retryWait, []string{"backoff", "retry_after"})
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
	m.retryWait.WithLabelValues(source).Add(r.Delay.Seconds())
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
	metrics.Init(m.ambiguous, []string{provider})
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
		if Ambiguous(err) {
			i.m.ambiguous.WithLabelValues(i.provider).Inc()
		}
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

// Ambiguous reports whether a failed model call ended without an answer after its
// request may have reached the provider, so the provider may have run (and billed) it:
// a timeout or a broken connection (reset, unexpected EOF, a stream cut halfway). An
// answer with a status (429, 500, ...) is not ambiguous, nor is a connection that was
// never made (refused, DNS), nor a cancellation by the caller (shutdown), nor a failure
// the server said it did not process (retry.NotProcessed: REFUSED_STREAM, a GOAWAY
// below the request's stream), as the llm_calls ledger counts it.
func Ambiguous(err error) bool {
	if err == nil || retry.NotProcessed(err) {
		return false
	}
	var st retry.HTTPStatuser
	if errors.As(err, &st) && st.HTTPStatus() != 0 {
		return false
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return false
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return false
	}
	switch retry.Classify(err).Class {
	case retry.ClassTimeout, retry.ClassConnection:
		return true
	}
	return false
}
