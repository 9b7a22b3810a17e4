// Package metrics holds the one pattern every onceflow package uses to expose Prometheus
// metrics, so that metrics grow with each feature instead of being retrofitted:
//
//   - a package declares its collectors in a small unexported struct built by a
//     constructor that takes a prometheus.Registerer (nil: collectors work but are not
//     exported, which is what tests and library users who do not care want);
//   - names are built with Namespace and carry their unit (_seconds, _bytes) and _total
//     for counters; labels have a bounded set of values, never job ids or tenants;
//   - label values known in advance are initialised in the constructor with Init, so every
//     series is visible (at zero) before its first event;
//   - collectors are registered with Register, which hands back the already registered
//     collector when another instance of the same component registered it first, so
//     `onceflow run` can host serve, work and relay on one registry.
package metrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Namespace prefixes every onceflow metric name.
const Namespace = "onceflow"

// Register registers c with reg and returns the collector to use: c itself, or the equal
// collector registered before it. A nil reg leaves c unregistered. It panics on a
// conflicting registration (same name, different labels or help), which is a bug.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic(err)
	}
	return c
}

// Init creates the series of vec for every combination of the given label values, so
// they are exported at zero before their first event. values holds one list per label.
func Init(vec interface {
	WithLabelValues(...string) prometheus.Counter
}, values ...[]string) {
	each(values, nil, func(lvs []string) { vec.WithLabelValues(lvs...) })
}

// InitHistogram is Init for a HistogramVec.
func InitHistogram(vec *prometheus.HistogramVec, values ...[]string) {
	each(values, nil, func(lvs []string) { vec.WithLabelValues(lvs...) })
}

func each(values [][]string, prefix []string, f func([]string)) {
	if len(values) == 0 {
		f(prefix)
		return
	}
	for _, v := range values[0] {
		each(values[1:], append(prefix[:len(prefix):len(prefix)], v), f)
	}
}
