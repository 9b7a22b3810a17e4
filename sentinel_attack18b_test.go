package onceflow_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
)

// Found by the second attack round of issue 18, failed before its fix: a Sentinel URL with replica_only=true (an option redis.ParseFailoverURL
// accepts and onceflow passes through) gives a client that talks to a replica: PING
// answers, so PingRedis (and /readyz, and the workers' breaker) report Redis healthy,
// CheckRedis accepts it, yet every write (the accept's script, XADD) fails with
// READONLY, which onceflow treats as "Redis unreachable" (503s forever). It should be
// refused like max_retries=3 (a configuration error), not run as a healthy outage.
func TestAttack18bSentinelReplicaOnlyIsRefused(t *testing.T) {
	t.Parallel()
	dir, err := os.MkdirTemp("", "onceflow-sentinel-a18b-")
	if err != nil {
		t.Fatal(err)
	}
	s, err := cluster.NewRedisSentinel(dir, 1, 3, "always")
	if err != nil {
		t.Fatalf("sentinel: %v", err)
	}
	t.Cleanup(func() { s.Kill(); _ = os.RemoveAll(dir) })
	if err := s.Up(); err != nil {
		t.Fatal(err)
	}
	rdb, err := onceflow.NewRedis(s.URL() + "&replica_only=true")
	if err != nil {
		return // refused at parse time: fine
	}
	t.Cleanup(func() { _ = rdb.Close() })
	if err := onceflow.CheckRedis(rdb); err != nil {
		return // refused: fine
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pingErr := onceflow.PingRedis(ctx, rdb)
	setErr := rdb.Set(ctx, "attack18b:replica-only", "x", time.Minute).Err()
	t.Fatalf("replica_only=true accepted by NewRedis and CheckRedis: PingRedis = %v, SET = %v", pingErr, setErr)
}
