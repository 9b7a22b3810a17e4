package outbox

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
)

// relayMetrics are the relay's Prometheus collectors (see internal/metrics).
type relayMetrics struct {
	sent      prometheus.Counter
	failures  *prometheus.CounterVec
	exhausted prometheus.Counter
	released  prometheus.Counter
	fenced    prometheus.Counter
	purged    prometheus.Counter
	batches   prometheus.Counter
	latency   prometheus.Histogram
	oldest    prometheus.Gauge
}

func newRelayMetrics(reg prometheus.Registerer) *relayMetrics {
	counter := func(name, help string) prometheus.Counter {
		return metrics.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "outbox", Name: name, Help: help,
		}))
	}
	m := &relayMetrics{
		sent:      counter("sent_total", "Outbox rows sent and marked sent."),
		exhausted: counter("exhausted_total", "Outbox rows exhausted: a permanent error or the last attempt failed (an unavailable dependency never exhausts a row)."),
		released:  counter("released_total", "Claimed outbox rows released unsent at shutdown."),
		fenced:    counter("fenced_marks_total", "Outbox outcomes not recorded because another relay had claimed the row since (lease ran out)."),
		purged:    counter("purged_total", "Sent outbox rows deleted after the retention."),
		batches:   counter("claimed_batches_total", "Non-empty batches claimed."),
		failures: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "outbox", Name: "send_failures_total",
			Help: "Failed sends by class: retryable, timeout, permanent, or unavailable (a dependency is down: no attempt counted).",
		}, []string{"class"})),
		latency: metrics.Register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "outbox", Name: "send_duration_seconds",
			Help:    "Time of one send, successful or not.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		})),
		oldest: metrics.Register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "outbox", Name: "oldest_unsent_age_seconds",
			Help: "Age of the oldest unsent, not exhausted outbox row when last sampled; 0 when none.",
		})),
	}
	metrics.Init(m.failures, []string{classRetryable, classTimeout, classPermanent, classUnavailable})
	return m
}
