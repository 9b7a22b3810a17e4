package onceflow_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

// nodeUp reads onceflow_redis_node_up from reg: node address -> value.
func nodeUp(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "onceflow_redis_node_up" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "node" {
					out[l.GetValue()] = m.GetGauge().GetValue()
				}
			}
		}
	}
	return out
}

// Guard (second attack round of issue 18): onceflow_redis_node_up on a cluster of 3 primaries with a replica each: 1 for
// each primary; a primary killed is 0 until its replica takes over, and then the old
// primary's series is dropped and the promoted replica's is 1.
func TestAttack18bNodeUpGaugeFollowsFailover(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 1)
	rdb, err := onceflow.NewRedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	e := newDBEnv(t)
	reg := prometheus.NewRegistry()
	var runs atomic.Int64
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: e.pool, Prefix: testenv.Prefix(t), Logger: testenv.Logger(t),
		Workers: refundWorkers(&runs), Registerer: reg, HealthInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, cl)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var primaries []string
	for ctx.Err() == nil {
		up := nodeUp(t, reg)
		n := 0
		for _, v := range up {
			if v == 1 {
				n++
			}
		}
		if n == 3 && len(up) == 3 {
			for a := range up {
				primaries = append(primaries, a)
			}
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(primaries) != 3 {
		t.Fatalf("node_up never showed 3 primaries up: %v", nodeUp(t, reg))
	}
	victim := primaries[0]
	killed := false
	for i, n := range c.Nodes {
		if c.Addrs()[i] == victim {
			n.Kill()
			killed = true
		}
	}
	if !killed {
		t.Fatalf("no node at %s among %v", victim, c.Addrs())
	}
	sawZero := false
	for ctx.Err() == nil {
		up := nodeUp(t, reg)
		if v, ok := up[victim]; ok && v == 0 {
			sawZero = true
		}
		ones := 0
		for _, v := range up {
			if v == 1 {
				ones++
			}
		}
		if _, ok := up[victim]; !ok && ones == 3 && len(up) == 3 {
			if !sawZero {
				t.Logf("the killed primary's 0 was never seen (failover faster than 100ms polls)")
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("after failover node_up = %v; want the killed %s dropped and 3 primaries at 1 (saw 0: %v)", nodeUp(t, reg), victim, sawZero)
}
