package cluster_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv/cluster"
)

// A local cluster of 3 primaries and 3 replicas: created by redis-cli, reachable from a
// cluster client seeded with any one node, and it survives kill -9 of a primary (its
// replica is promoted, a key replicated before is still there). Restarting the killed
// node brings it back as a replica.
func TestRedisClusterKitFailsOver(t *testing.T) {
	if testing.Short() {
		t.Skip("a failover of six processes: make test-long runs it")
	}
	t.Parallel()
	dir, err := os.MkdirTemp("", "onceflow-cluster-kit-")
	if err != nil {
		t.Fatal(err)
	}
	c, err := cluster.NewRedisCluster(dir, 3, 1, "always", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Kill(); _ = os.RemoveAll(dir) })
	if err := c.Up(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	// Seeded with the last node only: the client learns the rest.
	rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()[len(c.Nodes)-1:]})
	defer rc.Close()
	if err := rc.Set(ctx, "{kit}:k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	primary, err := rc.MasterForKey(ctx, "{kit}:k")
	if err != nil {
		t.Fatal(err)
	}
	if n, err := primary.Do(ctx, "WAIT", 1, 2000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT 1: %d %v", n, err)
	}
	addr := primary.Options().Addr
	var victim *cluster.Server
	for i, a := range c.Addrs() {
		if a == addr {
			victim = c.Nodes[i]
		}
	}
	if victim == nil {
		t.Fatalf("primary %s is none of the nodes %v", addr, c.Addrs())
	}
	victim.Kill()
	deadline := time.Now().Add(60 * time.Second)
	for {
		v, err := rc.Get(ctx, "{kit}:k").Result()
		if err == nil && v == "v" {
			if p, _ := rc.MasterForKey(ctx, "{kit}:k"); p != nil && p.Options().Addr != addr {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no failover within 60s: %v", err)
		}
		rc.ReloadState(ctx)
		time.Sleep(200 * time.Millisecond)
	}
	if err := victim.Up(); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitOK(ctx); err != nil {
		t.Fatal(err)
	}
	role, err := redis.NewClient(&redis.Options{Addr: addr}).Do(ctx, "ROLE").Slice()
	if err != nil || len(role) == 0 || !strings.EqualFold(role[0].(string), "slave") {
		t.Fatalf("the restarted node's role: %v %v", role, err)
	}
}

// MoveSlot moves a slot and its keys to another primary: the keys read back through a
// cluster client from their new owner.
func TestMoveSlotMovesTheKeys(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	c, err := cluster.NewRedisCluster(dir, 3, 0, "no", 0)
	if err != nil {
		t.Fatalf("redis cluster: %v", err)
	}
	t.Cleanup(c.Kill)
	if err := c.Up(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer cc.Close()
	for i := range 150 {
		if err := cc.Set(ctx, fmt.Sprintf("{moved}:%d", i), i, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	slot, err := cc.ClusterKeySlot(ctx, "{moved}:0").Result()
	if err != nil {
		t.Fatal(err)
	}
	owner, err := cc.MasterForKey(ctx, "{moved}:0")
	if err != nil {
		t.Fatal(err)
	}
	to := ""
	for _, a := range c.Addrs() {
		if a != owner.Options().Addr {
			to = a
			break
		}
	}
	n, err := c.MoveSlot(ctx, int(slot), to)
	if err != nil || n != 150 {
		t.Fatalf("MoveSlot: %d keys, %v; want 150", n, err)
	}
	fresh := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer fresh.Close()
	now, err := fresh.MasterForKey(ctx, "{moved}:0")
	if err != nil || now.Options().Addr != to {
		t.Fatalf("slot %d is on %v (%v), want %s", slot, now.Options().Addr, err, to)
	}
	for i := range 150 {
		if v, err := fresh.Get(ctx, fmt.Sprintf("{moved}:%d", i)).Int(); err != nil || v != i {
			t.Fatalf("key %d after the move: %d, %v", i, v, err)
		}
	}
}
