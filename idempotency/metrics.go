package idempotency

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
)

// outcome is how the middleware answered one request; every request counts exactly once.
type outcome int

const (
	outcomeNew          outcome = iota // handler ran, response stored
	outcomeNewTruncated                // handler ran, response over the limit: stored without body
	outcomeReplayed                    // stored response replayed
	outcomeConflict                    // 409: same key in progress
	outcomeReused                      // 422: same key, different fingerprint
	outcomeReleased                    // handler answered 5xx, returned an error or panicked: key released
	outcomeLockLost                    // handler ran but its lock had expired: nothing stored
	outcomeStoreFailed                 // handler ran but Complete/Release failed (store error)
	outcomeUnavailable                 // 503: store unavailable, handler not run
	outcomeInvalid                     // 400: key missing or malformed, body not canonicalisable
	outcomeTooLarge                    // 413: request body over the limit
	outcomeUnauthorized                // 401: Tenant returned an error
	outcomeTimeout                     // 408: request body not received in time
	numOutcomes
)

var outcomeNames = [numOutcomes]string{
	outcomeNew:          "new",
	outcomeNewTruncated: "new_truncated",
	outcomeReplayed:     "replayed",
	outcomeConflict:     "conflict_409",
	outcomeReused:       "reused_422",
	outcomeReleased:     "released_5xx",
	outcomeLockLost:     "lock_lost",
	outcomeStoreFailed:  "store_failed",
	outcomeUnavailable:  "unavailable_503",
	outcomeInvalid:      "invalid_400",
	outcomeTooLarge:     "too_large_413",
	outcomeUnauthorized: "unauthorized_401",
	outcomeTimeout:      "timeout_408",
}

// idemMetrics holds the middleware's collectors.
type idemMetrics struct {
	requests [numOutcomes]prometheus.Counter
}

func newIdemMetrics(reg prometheus.Registerer) *idemMetrics {
	vec := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "idempotency", Name: "requests_total",
		Help: "Requests through the Idempotency-Key layer, by outcome; each request counts once.",
	}, []string{"outcome"}))
	m := &idemMetrics{}
	for o, name := range outcomeNames {
		m.requests[o] = vec.WithLabelValues(name) // also initialises the series at zero
	}
	return m
}

func (m *idemMetrics) count(o outcome) { m.requests[o].Inc() }
