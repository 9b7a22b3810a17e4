package onceflow_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

// Config.Registerer reaches the worker of every queue a Client runs: the queue metrics
// of both queues move on the user's registry, by queue, and count what happened (one
// delivery and one ack each, one permanent dead letter).
func TestRegistererGetsEveryQueuesMetrics(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	reg := prometheus.NewRegistry()
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil }))
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(_ context.Context, j *onceflow.Job[emailArgs]) error {
		if j.Args.To == "" {
			return onceflow.Permanent(errors.New("no address"))
		}
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t), Registerer: reg,
		Queues: map[string]onceflow.QueueConfig{"default": {}, "mail": {StatsInterval: 50 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, a := range []onceflow.JobArgs{sortArgs{}, emailArgs{To: "a@example.com"}, emailArgs{}} {
		if _, err := c.Enqueue(ctx, a, nil); err != nil {
			t.Fatal(err)
		}
	}
	runClient(t, c)
	value := func(name string, labels map[string]string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
		metrics:
			for _, m := range mf.GetMetric() {
				for _, lp := range m.GetLabel() {
					if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
						continue metrics
					}
				}
				switch {
				case m.Counter != nil:
					return m.Counter.GetValue()
				case m.Gauge != nil:
					return m.Gauge.GetValue()
				}
			}
		}
		return -1
	}
	testenv.WaitFor(t, 10*time.Second, "three acknowledged or dead-lettered jobs", func() bool {
		return value("onceflow_queue_acks_total", map[string]string{"queue": "default"}) == 1 &&
			value("onceflow_queue_acks_total", map[string]string{"queue": "mail"}) == 1 &&
			value("onceflow_queue_dead_lettered_total", map[string]string{"queue": "mail", "reason": "permanent"}) == 1
	})
	for q, want := range map[string]float64{"default": 1, "mail": 2} {
		if got := value("onceflow_queue_deliveries_total", map[string]string{"queue": q}); got != want {
			t.Errorf("deliveries on %s: %v, want %v", q, got, want)
		}
	}
	testenv.WaitFor(t, 10*time.Second, "the sampled dead-letter gauge", func() bool {
		return value("onceflow_queue_dead_letters", map[string]string{"queue": "mail"}) == 1
	})
	if n, err := testutil.GatherAndCount(reg, "onceflow_queue_in_flight"); err != nil || n != 2 {
		t.Errorf("in-flight gauges: %d (%v), want one per queue", n, err)
	}
}
