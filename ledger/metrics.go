package ledger

import (
	"sync"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
)

// How Begin ended, the outcome label of onceflow_llm_ledger_begins_total.
const (
	outcomeNew       = "new"        // inserted: the first attempt
	outcomeReplayed  = "replayed"   // a recorded response was returned: no call
	outcomeClaimed   = "claimed"    // taken from a failed or ambiguous attempt
	outcomeTakenOver = "taken_over" // taken from a dead owner (counted as ambiguous)
	outcomeInFlight  = "in_flight"  // a live owner did not finish within the wait
	outcomeKeyReused = "key_reused" // the key holds another request
)

// How an attempt ended, the result label of onceflow_llm_ledger_attempts_total.
const (
	resultSucceeded  = "succeeded"
	resultSuperseded = "superseded" // another attempt's response was recorded first
	resultFailed     = "failed"
	resultAmbiguous  = "ambiguous"
)

// maxModels bounds the model label: names beyond it are reported as "other".
const maxModels = 32

// ledgerMetrics are the ledger's collectors (see internal/metrics):
//
//	onceflow_llm_ledger_begins_total{provider, model, outcome}
//	onceflow_llm_ledger_attempts_total{provider, model, result}
//	onceflow_llm_ledger_ambiguous_total{provider, model}   attempts that may have been billed without a recorded answer
//	onceflow_llm_ledger_partial_flushes_total              batched writes of streamed output
//	onceflow_llm_ledger_purged_total                       expired rows deleted
//	onceflow_llm_tool_call_ids_total{provider, stability}  tool calls keyed, by what their ids proved
//	onceflow_llm_ledger_group_writes                       writes per group transaction (group commit)
//	onceflow_llm_ledger_group_failures_total               group transactions that failed and were written call by call
type ledgerMetrics struct {
	begins, attempts, ambiguous, toolIDs  *prometheus.CounterVec
	partialFlushes, purged, groupFailures prometheus.Counter
	groupWrites                           prometheus.Histogram

	mu     sync.Mutex
	models map[string]bool
}

func newMetrics(reg prometheus.Registerer, models []string) *ledgerMetrics {
	m := &ledgerMetrics{
		begins: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "begins_total",
			Help: "Ledger claims of a model call by outcome: new, replayed (no call made), claimed, taken_over (dead owner), in_flight, key_reused.",
		}, []string{"provider", "model", "outcome"})),
		attempts: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "attempts_total",
			Help: "Ended model-call attempts by result: succeeded, superseded, failed (clear), ambiguous.",
		}, []string{"provider", "model", "result"})),
		ambiguous: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "ambiguous_total",
			Help: "Model-call attempts that ended without knowing whether the provider did the work (timeouts, resets, dead owners): each may be billed twice where the provider ignores Idempotency-Key.",
		}, []string{"provider", "model"})),
		toolIDs: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm", Name: "tool_call_ids_total",
			Help: "Tool calls keyed through the ledger, by what a repeat proved of the provider's ids: first (first sight), stable, unstable, none (no id).",
		}, []string{"provider", "stability"})),
		partialFlushes: metrics.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "partial_flushes_total",
			Help: "Batched writes of streamed output to the ledger.",
		})),
		purged: metrics.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "purged_total",
			Help: "Expired ledger rows (calls and tool calls) deleted.",
		})),
		groupWrites: metrics.Register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "group_writes",
			Help:    "Writes (in-flight rows, answers) per group transaction of the ledger: concurrent calls' writes sharing one commit.",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128},
		})),
		groupFailures: metrics.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "llm_ledger", Name: "group_failures_total",
			Help: "Group transactions of the ledger that failed as a whole and were written again call by call.",
		})),
		models: map[string]bool{},
	}
	for _, model := range models {
		m.models[model] = true
	}
	return m
}

// InitMetrics creates the metric series of provider (and the configured models) at
// zero, so they are exported before their first event. Wrap calls it.
func (l *Ledger) InitMetrics(provider string) { l.metrics.initProvider(provider) }

// initProvider creates the series of provider and the configured models at zero.
func (m *ledgerMetrics) initProvider(provider string) {
	m.mu.Lock()
	models := make([]string, 0, len(m.models))
	for model := range m.models {
		models = append(models, model)
	}
	m.mu.Unlock()
	metrics.Init(m.begins, []string{provider}, models,
		[]string{outcomeNew, outcomeReplayed, outcomeClaimed, outcomeTakenOver, outcomeInFlight, outcomeKeyReused})
	metrics.Init(m.attempts, []string{provider}, models, []string{resultSucceeded, resultSuperseded, resultFailed, resultAmbiguous})
	metrics.Init(m.ambiguous, []string{provider}, models)
	metrics.Init(m.toolIDs, []string{provider}, []string{"first", "stable", "unstable", "none"})
}

// model bounds the label: known names pass, new ones are admitted up to maxModels.
func (m *ledgerMetrics) model(name string) string {
	if !utf8.ValidString(name) || len(name) > 128 {
		return "other"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.models[name] {
		return name
	}
	if len(m.models) >= maxModels {
		return "other"
	}
	m.models[name] = true
	return name
}

func (m *ledgerMetrics) begin(c Call, outcome string) {
	m.begins.WithLabelValues(c.Provider, m.model(c.Model), outcome).Inc()
}

func (m *ledgerMetrics) attempt(c Call, result string) {
	m.attempts.WithLabelValues(c.Provider, m.model(c.Model), result).Inc()
}

func (m *ledgerMetrics) ambiguousFailure(c Call) {
	m.ambiguous.WithLabelValues(c.Provider, m.model(c.Model)).Inc()
}

// groupCommit counts a group transaction of n writes, and whether it failed as a whole.
func (m *ledgerMetrics) groupCommit(n int, ok bool) {
	m.groupWrites.Observe(float64(n))
	if !ok {
		m.groupFailures.Inc()
	}
}
