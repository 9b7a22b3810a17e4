package summaries

import (
	"context"
	"errors"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/queue"
)

// The statuses each route answers, initialised at zero in onceflow_http_requests_total.
var (
	postCodes = []int{http.StatusAccepted, http.StatusBadRequest, http.StatusUnauthorized, http.StatusRequestTimeout,
		http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity, http.StatusServiceUnavailable}
	getCodes = []int{http.StatusOK, http.StatusUnauthorized, http.StatusNotFound, http.StatusServiceUnavailable}
)

// apiMetrics are the POST route's collectors.
type apiMetrics struct {
	enqueued prometheus.Counter
}

func newAPIMetrics(reg prometheus.Registerer) *apiMetrics {
	vec := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "queue", Name: "enqueued_total",
		Help: "Jobs added to the stream by the API: new requests only (a replayed response enqueues nothing).",
	}, []string{"queue"}))
	return &apiMetrics{enqueued: vec.WithLabelValues(QueueName)}
}

// Job outcomes, the values of onceflow_summaries_jobs_total's "outcome" label.
const (
	jobDone      = "done"      // this delivery stored the summary and its outbox row
	jobDuplicate = "duplicate" // the summary existed: nothing written
	jobRetry     = "retry"     // transient failure: left pending for redelivery
	jobPermanent = "permanent" // dead-lettered
	// jobUnavailable: the model provider is stopped (quota): handed back, no delivery spent
	jobUnavailable = "unavailable"
)

// handlerMetrics are the job handler's collectors: what each delivery did, and the
// effects it wrote.
type handlerMetrics struct {
	jobs    map[string]prometheus.Counter
	written prometheus.Counter
}

func newHandlerMetrics(reg prometheus.Registerer) *handlerMetrics {
	jobs := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "summaries", Name: "jobs_total",
		Help: "Deliveries of summaries jobs by outcome: done (summary and outbox row written), duplicate (summary existed, nothing written), retry (left pending), permanent (dead-lettered), unavailable (the provider is stopped: handed back without spending a delivery).",
	}, []string{"outcome"}))
	written := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "outbox", Name: "written_total",
		Help: "Outbox rows written by job handlers (committed with their result), by topic.",
	}, []string{"topic"}))
	m := &handlerMetrics{jobs: map[string]prometheus.Counter{}, written: written.WithLabelValues(TopicSummaryReady)}
	for _, o := range []string{jobDone, jobDuplicate, jobRetry, jobPermanent, jobUnavailable} {
		m.jobs[o] = jobs.WithLabelValues(o)
	}
	return m
}

// Instrument returns h as a queue.Handler that also counts each delivery's outcome
// (onceflow_summaries_jobs_total{outcome}) and the outbox rows it wrote
// (onceflow_outbox_written_total{topic}) on reg; nil reg counts without exporting. It
// is safe for concurrent use, like h.
func Instrument(h *Handler, reg prometheus.Registerer) queue.Handler {
	m := newHandlerMetrics(reg)
	return queue.HandlerFunc(func(ctx context.Context, job *queue.Job) error {
		outcome, err := h.Process(ctx, job)
		switch {
		case err == nil && outcome == OutcomeDone:
			m.jobs[jobDone].Inc()
			m.written.Inc() // storeSQL writes the outbox row with the summary, or neither
		case err == nil:
			m.jobs[jobDuplicate].Inc()
		case errors.Is(err, queue.ErrPermanent):
			m.jobs[jobPermanent].Inc()
		case errors.Is(err, queue.ErrUnavailable):
			m.jobs[jobUnavailable].Inc()
		default:
			m.jobs[jobRetry].Inc()
		}
		return err
	})
}
