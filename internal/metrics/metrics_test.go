package metrics

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func newVec() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "test_events_total", Help: "Test events.",
	}, []string{"kind", "outcome"})
}

func TestRegisterReturnsExistingCollector(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := Register(reg, newVec())
	b := Register(reg, newVec())
	if a != b {
		t.Fatal("second Register returned a new collector; two components would export separate series under one name")
	}
	b.WithLabelValues("x", "ok").Inc()
	if got := testutil.ToFloat64(a.WithLabelValues("x", "ok")); got != 1 {
		t.Fatalf("shared counter = %v, want 1", got)
	}
}

func TestRegisterNilRegistererLeavesCollectorUsable(t *testing.T) {
	v := Register(nil, newVec())
	v.WithLabelValues("a", "b").Add(2)
	if got := testutil.ToFloat64(v.WithLabelValues("a", "b")); got != 2 {
		t.Fatalf("counter = %v, want 2", got)
	}
}

func TestRegisterConflictPanics(t *testing.T) {
	reg := prometheus.NewRegistry()
	Register(reg, newVec())
	defer func() {
		if recover() == nil {
			t.Fatal("conflicting registration did not panic")
		}
	}()
	Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "test_events_total", Help: "Other help.",
	}, []string{"kind"}))
}

func TestInitExportsEveryCombinationAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	v := Register(reg, newVec())
	Init(v, []string{"a", "b"}, []string{"ok", "error", "timeout"})
	if n := testutil.CollectAndCount(v); n != 6 {
		t.Fatalf("series = %d, want 6", n)
	}
	want := `
# HELP onceflow_test_events_total Test events.
# TYPE onceflow_test_events_total counter
onceflow_test_events_total{kind="a",outcome="error"} 0
onceflow_test_events_total{kind="a",outcome="ok"} 0
onceflow_test_events_total{kind="a",outcome="timeout"} 0
onceflow_test_events_total{kind="b",outcome="error"} 0
onceflow_test_events_total{kind="b",outcome="ok"} 0
onceflow_test_events_total{kind="b",outcome="timeout"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
}
