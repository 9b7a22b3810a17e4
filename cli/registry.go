package cli

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/onceflow/onceflow/internal/metrics"
)

// newRegistry returns the process's metrics registry with the Go runtime, process and
// onceflow_build_info collectors; every role registers its own metrics on it.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	v, rev, gov := buildInfo()
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Name: "build_info",
		Help:        "Always 1; the labels say which build is running.",
		ConstLabels: prometheus.Labels{"version": v, "revision": rev, "goversion": gov},
	})
	info.Set(1)
	reg.MustRegister(info)
	return reg
}
