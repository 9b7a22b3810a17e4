package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

// Guard (second attack round of issue 18): PingRedis on a plain client whose Redis is down errs, and the error does not
// match ErrSomeRedisNodesDown (which /readyz would report as only degraded).
func TestAttack18bPingRedisPlainDown(t *testing.T) {
	t.Parallel()
	rdb, err := onceflow.NewRedis(fmt.Sprintf("redis://127.0.0.1:%d/0", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	err = onceflow.PingRedis(context.Background(), rdb)
	if err == nil || errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
		t.Fatalf("PingRedis = %v, want an error that is not ErrSomeRedisNodesDown", err)
	}
}

// Guard (second attack round of issue 18): a cluster client whose slot map cannot load (no seed answers) errs, not
// ErrSomeRedisNodesDown.
func TestAttack18bPingRedisClusterNoSlotMap(t *testing.T) {
	t.Parallel()
	rdb, err := onceflow.NewRedisCluster(fmt.Sprintf("redis://127.0.0.1:%d", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = onceflow.PingRedis(ctx, rdb)
	if err == nil || errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
		t.Fatalf("PingRedis = %v, want an error that is not ErrSomeRedisNodesDown", err)
	}
}

// Guard (second attack round of issue 18): every primary of a cluster killed after the client loaded its slot map: the
// error names each and does not match ErrSomeRedisNodesDown (/readyz 503, breaker open).
func TestAttack18bPingRedisClusterAllDown(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	rdb, err := onceflow.NewRedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := onceflow.PingRedis(ctx, rdb); err != nil {
		t.Fatalf("all up: %v", err)
	}
	for _, n := range c.Nodes {
		n.Kill()
	}
	err = onceflow.PingRedis(ctx, rdb)
	if err == nil || errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
		t.Fatalf("all killed: PingRedis = %v, want an error that is not ErrSomeRedisNodesDown", err)
	}
	for _, a := range c.Addrs() {
		if !strings.Contains(err.Error(), a) {
			t.Errorf("error %v does not name %s", err, a)
		}
	}
}

// Guard (second attack round of issue 18): CheckRedis takes the failover client of a Sentinel URL, and refuses one whose
// URL sets max_retries=3, as for a plain URL.
func TestAttack18bCheckRedisSentinel(t *testing.T) {
	ok, err := onceflow.NewRedis("redis://127.0.0.1:26379?master_name=m")
	if err != nil {
		t.Fatal(err)
	}
	defer ok.Close()
	if err := onceflow.CheckRedis(ok); err != nil {
		t.Fatalf("default sentinel client refused: %v", err)
	}
	bad, err := onceflow.NewRedis("redis://127.0.0.1:26379?master_name=m&max_retries=3")
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	if err := onceflow.CheckRedis(bad); !errors.Is(err, onceflow.ErrRedisOptions) {
		t.Fatalf("max_retries=3: CheckRedis = %v, want ErrRedisOptions", err)
	}
}
