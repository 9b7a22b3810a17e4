package onceflow_test

import (
	"context"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
)

// A Sentinel-managed primary (ONCEFLOW_REDIS_URL with master_name: go-redis's failover
// client) killed with SIGKILL while keyed jobs are accepted with WaitReplicas 1: the
// sentinels promote the replica, the restarted old primary becomes its replica, and
// every job the client saw accepted (each retried with its key until it was) runs and
// commits once: no accepted job lost, no effect twice.
func TestSentinelFailoverLosesNoAcceptedJob(t *testing.T) {
	t.Parallel()
	dir, err := os.MkdirTemp("", "onceflow-sentinel-")
	if err != nil {
		t.Fatal(err)
	}
	s, err := cluster.NewRedisSentinel(dir, 1, 3, "always")
	if err != nil {
		t.Fatalf("sentinel: %v (run `make test`, which installs what it needs)", err)
	}
	t.Cleanup(func() { s.Kill(); _ = os.RemoveAll(dir) })
	if err := s.Up(); err != nil {
		t.Fatal(err)
	}
	rdb, err := onceflow.NewRedis(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	e := newDBEnv(t)
	var runs atomic.Int64
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: e.pool, Prefix: testenv.Prefix(t), Logger: testenv.Logger(t),
		Workers: refundWorkers(&runs), WaitReplicas: 1, WaitTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	ctx := context.Background()
	first, err := s.PrimaryAddr(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const jobs = 60
	accepted := map[string]bool{}
	retries := 0
	restarted := make(chan error, 1)
	for i := range jobs {
		if i == jobs/3 {
			s.Primary.Kill()
			// Once the sentinels have promoted the replica, the old primary comes back
			// and they make it the new primary's replica: WAIT 1 can be met again.
			// Meanwhile accepts answer "not replicated" and are retried.
			go func() {
				for {
					if now, err := s.PrimaryAddr(ctx); err == nil && now != first {
						restarted <- s.Primary.Up()
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}()
		}
		key := "refund-" + strconv.Itoa(i)
		deadline := time.Now().Add(60 * time.Second)
		for {
			res, err := c.Enqueue(ctx, refundArgs{OrderID: key, AmountCents: 100 + i}, &onceflow.EnqueueOpts{Tenant: "acme", Key: key})
			if err == nil {
				accepted[res.JobID] = true
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("job %d not accepted within 60s of retries: %v", i, err)
			}
			retries++
			time.Sleep(100 * time.Millisecond)
		}
	}
	select {
	case err := <-restarted:
		if err != nil {
			t.Fatalf("restarting the old primary: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("no failover within a minute")
	}
	now, err := s.PrimaryAddr(ctx)
	if err != nil || now == first {
		t.Fatalf("the primary is still %s (%v): no failover happened", now, err)
	}
	testenv.WaitFor(t, 60*time.Second, "every accepted job committed", func() bool {
		return e.count(`SELECT count(*) FROM refunds`) == len(accepted)
	})
	for id := range accepted {
		if completions, refunds, _ := e.effects(id); completions != 1 || refunds != 1 {
			t.Fatalf("job %s: %d completions, %d refunds; want 1 and 1", id, completions, refunds)
		}
	}
	if n := e.count(`SELECT count(*) FROM refunds`); n != jobs {
		t.Fatalf("%d refunds for %d keys", n, jobs)
	}
	t.Logf("failover %s -> %s; %d accepts retried; %d runs for %d jobs", first, now, retries, runs.Load(), jobs)
}
