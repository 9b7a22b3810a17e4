package chaos

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// clusterPartitions is the summaries queue's partitions in the cluster profile.
const clusterPartitions = 3

// RunCluster is Run on a local Redis Cluster (3 primaries with a replica each, AOF
// always, node timeout 2 s) with the queue in 3 partitions and
// ONCEFLOW_REDIS_WAIT_REPLICAS=waitReplicas: besides the kills of the API, workers and
// relay, at 40 % of the run the primary of partition 0's slot is killed with SIGKILL
// (its replica takes over; the node is restarted and rejoins as a replica), and at 70 %
// partition 1's slot moves to another primary with its keys while jobs flow (the
// per-slot steps of `redis-cli --cluster reshard`). With waitReplicas 0 an accepted job
// the failover lost is counted in Report.Lost, not a violation.
func RunCluster(ctx context.Context, cfg Config, waitReplicas int) (*Report, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	spec := chaosSpec(cfg.Seed)
	spec.cluster, spec.waitReplicas = true, waitReplicas
	return runSpec(ctx, cfg, spec)
}

// partitionKeys are the keys of partition p of the chaos runs' queue.
func partitionKeys(p int) queue.Keys {
	return queue.Keys{Prefix: "chaos", Queue: summaries.QueueName, Partition: p}
}

// killPrimary kills the primary of partition 0's slot, waits until the cluster is ok
// again (its replica promoted), restarts it and waits until it has rejoined.
func (r *run) killPrimary(ctx context.Context, pause time.Duration) error {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: r.rc.Addrs()})
	defer cc.Close()
	owner, err := cc.MasterForKey(ctx, partitionKeys(0).Stream())
	if err != nil {
		return fmt.Errorf("kill primary: %w", err)
	}
	addr := owner.Options().Addr
	for _, n := range r.rc.Nodes {
		if "127.0.0.1:"+strconv.Itoa(n.Port) != addr {
			continue
		}
		r.event("kill -9 the primary %s of partition 0 (its replica takes over)", addr)
		n.Kill()
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		promoted, err := r.waitPromoted(wctx, partitionKeys(0).Stream(), addr)
		if err != nil {
			return err
		}
		if err := r.rc.WaitOK(wctx); err != nil {
			return fmt.Errorf("failover: %w", err)
		}
		r.event("replica %s promoted: the cluster is ok again without %s", promoted, addr)
		time.Sleep(pause)
		if err := n.Up(); err != nil {
			return fmt.Errorf("restart %s: %w", addr, err)
		}
		if err := r.rc.WaitOK(wctx); err != nil {
			return fmt.Errorf("rejoin: %w", err)
		}
		r.event("%s restarted and rejoined as a replica", addr)
		return nil
	}
	return fmt.Errorf("kill primary: no node at %s", addr)
}

// waitPromoted waits until the primary of key's slot is another node than old, and
// returns it.
func (r *run) waitPromoted(ctx context.Context, key, old string) (string, error) {
	for {
		cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: r.rc.Addrs(), MaxRedirects: -1})
		owner, err := cc.MasterForKey(ctx, key)
		if err == nil && owner.Options().Addr != old && owner.Ping(ctx).Err() == nil {
			addr := owner.Options().Addr
			_ = cc.Close()
			return addr, nil
		}
		_ = cc.Close()
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("failover: no replica of %s promoted: %w", old, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// moveSlot moves partition 1's slot, with its keys, to another primary.
func (r *run) moveSlot(ctx context.Context) error {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: r.rc.Addrs()})
	defer cc.Close()
	key := partitionKeys(1).Stream()
	slot, err := cc.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return fmt.Errorf("move slot: %w", err)
	}
	owner, err := cc.MasterForKey(ctx, key)
	if err != nil {
		return fmt.Errorf("move slot: %w", err)
	}
	var mu sync.Mutex // ForEachMaster calls back concurrently
	var others []string
	err = cc.ForEachMaster(ctx, func(_ context.Context, m *redis.Client) error {
		if a := m.Options().Addr; a != owner.Options().Addr {
			mu.Lock()
			others = append(others, a)
			mu.Unlock()
		}
		return nil
	})
	if err != nil || len(others) == 0 {
		return fmt.Errorf("move slot: no other primary (%v)", err)
	}
	slices.Sort(others)
	to := others[0]
	r.event("move slot %d of partition 1 from %s to %s, while jobs flow", slot, owner.Options().Addr, to)
	n, err := r.rc.MoveSlot(ctx, int(slot), to)
	if err != nil {
		return err
	}
	r.event("slot %d moved with its %d keys", slot, n)
	return nil
}
