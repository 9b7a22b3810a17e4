package onceflow

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/metrics"
)

// ErrSomeRedisNodesDown is matched by PingRedis's error when some primaries of a Redis
// Cluster answered and some did not: the partitions whose slots the silent ones hold
// cannot be used until they come back or their replicas take over, the others can.
var ErrSomeRedisNodesDown = errors.New("some primaries of the Redis Cluster do not answer")

// PingRedis checks that rdb answers: PING to the one Redis of a *redis.Client (the
// primary, for a Sentinel-managed one), or to every primary of a *redis.ClusterClient.
// Its error names each node that did not answer, and matches ErrSomeRedisNodesDown when
// others did. For readiness checks: `onceflow serve` reports such a cluster as degraded
// in /readyz (200, the nodes named), and down only when no primary answers; the
// workers' Redis breaker likewise opens only when none does.
func PingRedis(ctx context.Context, rdb redis.UniversalClient) error {
	_, err := pingNodes(ctx, rdb)
	return err
}

// pingNodes pings rdb's primaries and returns each one's address and whether it
// answered (nil for a client that is not a cluster's), and an error naming those that
// did not.
func pingNodes(ctx context.Context, rdb redis.UniversalClient) (map[string]bool, error) {
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return nil, rdb.Ping(ctx).Err()
	}
	var mu sync.Mutex
	up := map[string]bool{}
	var failed []string
	err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		addr := node.Options().Addr
		err := node.Ping(ctx).Err()
		mu.Lock()
		defer mu.Unlock()
		up[addr] = err == nil
		if err != nil {
			failed = append(failed, fmt.Sprintf("node %s: %v", addr, err))
		}
		return nil
	})
	if err != nil {
		// The slot map could not be loaded: no node answered.
		return up, fmt.Errorf("redis cluster: %w", err)
	}
	if len(failed) == 0 {
		return up, nil
	}
	slices.Sort(failed)
	err = errors.New("redis cluster: " + strings.Join(failed, "; "))
	if len(failed) < len(up) {
		err = fmt.Errorf("%w: %w", ErrSomeRedisNodesDown, err)
	}
	return up, err
}

// nodeGauge is onceflow_redis_node_up: 1 for each primary of a Redis Cluster that
// answered the last health check, 0 for one that did not.
type nodeGauge struct {
	g    *prometheus.GaugeVec
	mu   sync.Mutex
	seen map[string]bool
}

func newNodeGauge(reg prometheus.Registerer) *nodeGauge {
	if reg == nil {
		return nil
	}
	return &nodeGauge{seen: map[string]bool{}, g: metrics.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "redis", Name: "node_up",
		Help: "Whether each primary of the Redis Cluster answered the last health check (1) or not (0); a node no longer among the primaries is dropped.",
	}, []string{"node"}))}
}

// set records the last check's answers; nodes that are no longer primaries are dropped.
func (n *nodeGauge) set(up map[string]bool) {
	if n == nil || up == nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for addr := range n.seen {
		if _, ok := up[addr]; !ok {
			n.g.DeleteLabelValues(addr)
			delete(n.seen, addr)
		}
	}
	for addr, ok := range up {
		v := 0.0
		if ok {
			v = 1
		}
		n.g.WithLabelValues(addr).Set(v)
		n.seen[addr] = true
	}
}
