package summaries

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/metrics"
)

// Job outcomes, the values of onceflow_summaries_jobs_total's "outcome" label.
const (
	jobDone      = "done"      // this delivery stored the summary and its outbox row
	jobDuplicate = "duplicate" // the summary existed: nothing written
	jobRetry     = "retry"     // transient failure: left pending for redelivery
	jobPermanent = "permanent" // dead-lettered
	// jobUnavailable: the model provider is stopped (quota): handed back, no delivery spent
	jobUnavailable = "unavailable"
	// jobWaiting: the model's limiter put the call off: the job waits, no attempt spent
	jobWaiting = "waiting"
)

// metrics are the workflow's collectors: what the route enqueued, what each delivery
// did, and the effects it wrote.
type workflowMetrics struct {
	jobs    map[string]prometheus.Counter
	written prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *workflowMetrics {
	jobs := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "summaries", Name: "jobs_total",
		Help: "Deliveries of summaries jobs by outcome: done (summary and outbox row written), duplicate (summary existed, nothing written), retry (left pending), permanent (dead-lettered), unavailable (the provider is stopped: handed back without spending a delivery), waiting (the model's limiter put the call off: the job waits without spending an attempt).",
	}, []string{"outcome"}))
	written := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "outbox", Name: "written_total",
		Help: "Outbox rows written by job handlers (committed with their result), by topic.",
	}, []string{"topic"}))
	m := &workflowMetrics{jobs: map[string]prometheus.Counter{}, written: written.WithLabelValues(TopicSummaryReady)}
	for _, o := range []string{jobDone, jobDuplicate, jobRetry, jobPermanent, jobUnavailable, jobWaiting} {
		m.jobs[o] = jobs.WithLabelValues(o)
	}
	return m
}

// count counts one delivery the worker ran.
func (m *workflowMetrics) count(outcome Outcome, err error) {
	switch {
	case err == nil && outcome == OutcomeDone:
		m.jobs[jobDone].Inc()
		m.written.Inc() // the commit writes the outbox row with the summary, or neither
	case err == nil:
		m.jobs[jobDuplicate].Inc()
	case errors.Is(err, onceflow.ErrPermanent):
		m.jobs[jobPermanent].Inc()
	case errors.Is(err, onceflow.ErrUnavailable):
		m.jobs[jobUnavailable].Inc()
	case errors.Is(err, onceflow.ErrWaiting):
		m.jobs[jobWaiting].Inc()
	default:
		m.jobs[jobRetry].Inc()
	}
}

// writeJSON writes v as the JSON body of status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeDetail writes the JSON error body every onceflow error uses: {"detail": "..."}.
func writeDetail(w http.ResponseWriter, status int, detail string) {
	writeJSON(w, status, map[string]string{"detail": detail})
}
