package queue

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
)

// Handler outcomes, the bounded values of the handler duration's "outcome" label.
const (
	outcomeOK        = "ok"
	outcomeError     = "error"
	outcomePermanent = "permanent"
	outcomePanic     = "panic"
	// outcomeUnavailable: the handler said a dependency is down (ErrUnavailable).
	outcomeUnavailable = "unavailable"
	// outcomeSnoozed: the handler asked to run later without spending an attempt (a
	// *SnoozeError, or a limiter's *retry.WaitError).
	outcomeSnoozed = "snoozed"
)

// workerMetrics are a Worker's collectors. Every series carries the queue name, a
// configured (bounded) value; none carries a job id or tenant.
type workerMetrics struct {
	deliveries         prometheus.Counter
	reclaimed          prometheus.Counter
	redeliveries       prometheus.Counter
	deadLettered       map[string]prometheus.Counter // by reason label
	deletedPending     prometheus.Counter
	acks               prometheus.Counter
	leaseRenewals      prometheus.Counter
	leasesLost         prometheus.Counter
	trimmed            prometheus.Counter
	deadTrimmed        prometheus.Counter
	consumersDeleted   prometheus.Counter
	handedBack         prometheus.Counter
	snoozed            prometheus.Counter
	retries            prometheus.Counter
	moved              prometheus.Counter
	completedNotBuried prometheus.Counter
	errors             map[string]prometheus.Counter  // by operation (errorOps)
	handlerDuration    map[string]prometheus.Observer // by outcome
	inFlight           prometheus.Gauge

	streamLength      prometheus.Gauge
	pending           prometheus.Gauge
	oldestPendingIdle prometheus.Gauge
	deadLetters       prometheus.Gauge
	scheduled         prometheus.Gauge
}

// Operations whose Redis errors are counted, the bounded values of the "op" label.
var errorOps = []string{"read", "reclaim", "pending", "ack", "renew", "dead_letter", "hand_back", "move", "trim", "trim_dead", "consumers", "stats", "group"}

func newWorkerMetrics(reg prometheus.Registerer, queue string) *workerMetrics {
	q := []string{"queue"}
	counter := func(name, help string) prometheus.Counter {
		return metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "queue", Name: name, Help: help,
		}, q)).WithLabelValues(queue)
	}
	gauge := func(name, help string) prometheus.Gauge {
		return metrics.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "queue", Name: name, Help: help,
		}, q)).WithLabelValues(queue)
	}
	m := &workerMetrics{
		deliveries:         counter("deliveries_total", "Messages handed to the worker (new and reclaimed), malformed and over-delivered ones included."),
		reclaimed:          counter("reclaimed_total", "Messages taken over with XAUTOCLAIM after ClaimIdle (a dead or stuck consumer's, or a failed run's)."),
		redeliveries:       counter("redeliveries_total", "Deliveries whose delivery count was above 1."),
		deletedPending:     counter("deleted_while_pending_total", "Pending entries Redis reported deleted from the stream (XDEL or MAXLEN trimming by someone else) before they were acknowledged: jobs lost outside the queue's control."),
		acks:               counter("acks_total", "Entries acknowledged after a successful run."),
		leaseRenewals:      counter("lease_renewals_total", "In-flight entries whose idle time the lease renewer reset."),
		leasesLost:         counter("leases_lost_total", "In-flight entries found owned by another consumer at renewal (the run outlived its lease)."),
		trimmed:            counter("trimmed_entries_total", "Acknowledged entries removed from the stream by XTRIM MINID."),
		deadTrimmed:        counter("dead_letters_trimmed_total", "Dead letters older than the retention (ONCEFLOW_DLQ_RETENTION) deleted by maintenance."),
		consumersDeleted:   counter("consumers_deleted_total", "Idle consumers with no pending entries deleted from the group."),
		handedBack:         counter("handed_back_total", "Runs handed back without spending an attempt because the handler reported a dependency down (ErrUnavailable)."),
		snoozed:            counter("snoozed_total", "Runs that snoozed (Snooze): run again later without spending an attempt."),
		retries:            counter("retries_scheduled_total", "Failed runs whose next attempt was scheduled after a backoff or Retry-After."),
		moved:              counter("scheduled_moved_total", "Scheduled jobs (retries, snoozes, hand-backs, EnqueueAt) moved to the stream when due."),
		completedNotBuried: counter("completed_not_dead_lettered_total", "Jobs whose budget was spent but which had completed (Completer): acknowledged instead of dead-lettered."),
		inFlight:           gauge("in_flight", "Jobs whose handler is running."),
		streamLength:       gauge("stream_length", "Entries in the job stream (sampled)."),
		pending:            gauge("pending", "Entries delivered to the group and not yet acknowledged (sampled)."),
		oldestPendingIdle:  gauge("oldest_pending_idle_seconds", "Idle time of the oldest pending entry, 0 when none (sampled)."),
		deadLetters:        gauge("dead_letters", "Entries in the dead-letter stream (sampled)."),
		scheduled:          gauge("scheduled", "Jobs in the scheduled set, waiting for their time (sampled)."),
	}
	dead := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "queue", Name: "dead_lettered_total",
		Help: "Jobs moved to the dead-letter stream, by reason (malformed, permanent, max_deliveries).",
	}, []string{"queue", "reason"}))
	reasons := []string{reasonMalformed, reasonPermanent, reasonMaxDeliveries}
	metrics.Init(dead, []string{queue}, reasons)
	m.deadLettered = make(map[string]prometheus.Counter, len(reasons))
	for _, r := range reasons {
		m.deadLettered[r] = dead.WithLabelValues(queue, r)
	}
	errs := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "queue", Name: "redis_errors_total",
		Help: "Failed Redis operations of the worker, by operation.",
	}, []string{"queue", "op"}))
	m.errors = make(map[string]prometheus.Counter, len(errorOps))
	for _, op := range errorOps {
		m.errors[op] = errs.WithLabelValues(queue, op)
	}
	dur := metrics.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metrics.Namespace, Subsystem: "queue", Name: "handler_duration_seconds",
		Help:    "Time a job handler ran, by outcome (ok, error, permanent, panic, unavailable, snoozed).",
		Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
	}, []string{"queue", "outcome"}))
	outcomes := []string{outcomeOK, outcomeError, outcomePermanent, outcomePanic, outcomeUnavailable, outcomeSnoozed}
	m.handlerDuration = make(map[string]prometheus.Observer, len(outcomes))
	for _, o := range outcomes {
		m.handlerDuration[o] = dur.WithLabelValues(queue, o)
	}
	return m
}

// redisError counts a failed Redis operation; op is one of errorOps.
func (m *workerMetrics) redisError(op string) { m.errors[op].Inc() }
