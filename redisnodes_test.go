package onceflow_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

// PingRedis pings every primary of a cluster: all up is nil; one killed (no replica to
// take over) is an error naming it that matches ErrSomeRedisNodesDown, since the other
// primaries' partitions still work.
func TestPingRedisNamesTheSilentPrimary(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	rdb, err := onceflow.NewRedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := onceflow.PingRedis(ctx, rdb); err != nil {
		t.Fatalf("every primary up: %v", err)
	}
	dead := c.Nodes[2]
	dead.Kill()
	err = onceflow.PingRedis(ctx, rdb)
	if !errors.Is(err, onceflow.ErrSomeRedisNodesDown) || !strings.Contains(err.Error(), c.Addrs()[2]) {
		t.Fatalf("one primary killed: %v, want ErrSomeRedisNodesDown naming %s", err, c.Addrs()[2])
	}
	for _, n := range c.Addrs()[:2] {
		if strings.Contains(err.Error(), n) {
			t.Fatalf("%v names %s, which answers", err, n)
		}
	}
}
