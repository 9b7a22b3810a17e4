package onceflow_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// A queue of 3 partitions on a Redis Cluster (3 primaries): keyed jobs land on more than
// one node, each with its idempotency record in its own partition's slot (so the accept
// stays one script on one node), a retried key is a replay with the same job id, every
// job runs once and JobState finds it, done.
func TestPartitionedQueueOnARedisCluster(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	rdb, err := onceflow.NewRedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	pool, _ := testenv.Postgres(t)
	prefix := testenv.Prefix(t)
	var mu sync.Mutex
	runs := map[string]int{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		mu.Lock()
		runs[j.ID]++
		mu.Unlock()
		return nil
	}))
	const parts, jobs = 3, 30
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {Partitions: parts}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ids := map[string]string{} // key -> job id
	nodes := map[string]int{}
	for i := range jobs {
		key := fmt.Sprintf("order-%d", i)
		tenant := []string{"acme", "globex"}[i%2]
		res, err := cl.Enqueue(ctx, sortArgs{Strings: []string{key}}, &onceflow.EnqueueOpts{Tenant: tenant, Key: key})
		if err != nil {
			t.Fatal(err)
		}
		ids[key] = res.JobID
		keys := cl.Inspector().QueueKeys(onceflow.DefaultQueue).InPartition(queue.PartitionOf(res.JobID, parts))
		scope := onceflow.EnqueueScopeOn(onceflow.DefaultQueue, tenant, "sort", key)
		record := fmt.Sprintf("%s:{%s}:idem:%s", prefix, keys.Name(), scope.Hash())
		if n, err := rdb.Exists(ctx, record, keys.Job(res.JobID)).Result(); err != nil || n != 2 {
			t.Fatalf("job %s: its record %s and index in partition %d: %d of 2 exist (%v)", res.JobID, record, keys.Partition, n, err)
		}
		owner, err := rdb.MasterForKey(ctx, keys.Stream())
		if err != nil {
			t.Fatal(err)
		}
		nodes[owner.Options().Addr]++
	}
	if len(nodes) < 2 {
		t.Fatalf("%d jobs on %d node(s): %v, want them spread", jobs, len(nodes), nodes)
	}
	again, err := cl.Enqueue(ctx, sortArgs{Strings: []string{"order-7"}}, &onceflow.EnqueueOpts{Tenant: "globex", Key: "order-7"})
	if err != nil || !again.Replayed || again.JobID != ids["order-7"] {
		t.Fatalf("a retried key: %+v, %v; want a replay of job %s", again, err, ids["order-7"])
	}
	runClient(t, cl)
	testenv.WaitFor(t, 30*time.Second, "every job done", func() bool {
		for i := range jobs {
			key := fmt.Sprintf("order-%d", i)
			st, err := cl.JobState(ctx, []string{"acme", "globex"}[i%2], ids[key])
			if err != nil || st.Status != onceflow.StatusDone {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	if len(runs) != jobs {
		t.Fatalf("%d jobs ran, want %d", len(runs), jobs)
	}
	for id, n := range runs {
		if n != 1 {
			t.Fatalf("job %s ran %d times", id, n)
		}
	}
	t.Logf("%d jobs over nodes %v", jobs, nodes)
}

// Lowering a queue's partitions loses no job: a Client of 4 partitions enqueues (and so
// records 4), and a Client configured with 1 runs every job of the 4 partitions, and its
// JobState finds them.
func TestLoweredPartitionsAreStillConsumed(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	var mu sync.Mutex
	runs := map[string]int{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		mu.Lock()
		runs[j.ID]++
		mu.Unlock()
		return nil
	}))
	before := e.client(onceflow.Config{Workers: ws, QueueDefaults: onceflow.QueueConfig{Partitions: 4}})
	ctx := context.Background()
	const jobs = 40
	var ids []string
	used := map[int]bool{}
	for i := range jobs {
		res, err := before.Enqueue(ctx, sortArgs{Strings: []string{fmt.Sprint(i)}}, &onceflow.EnqueueOpts{Tenant: "acme"})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.JobID)
		used[queue.PartitionOf(res.JobID, 4)] = true
	}
	if len(used) < 3 {
		t.Fatalf("40 jobs in partitions %v: the test needs them spread", used)
	}
	after := e.client(onceflow.Config{Workers: ws})
	runClient(t, after)
	testenv.WaitFor(t, 30*time.Second, "every job done", func() bool {
		for _, id := range ids {
			if st, err := after.JobState(ctx, "acme", id); err != nil || st.Status != onceflow.StatusDone {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if runs[id] != 1 {
			t.Fatalf("job %s ran %d times, want 1", id, runs[id])
		}
	}
}

// heldGate admits nothing until opened: a breaker that is open.
type heldGate struct{ open chan struct{} }

func (g *heldGate) Admit(ctx context.Context) (int, error) {
	select {
	case <-g.open:
		return 0, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// The queue's Gate (the breakers: Redis, PostgreSQL, the model) holds every partition's
// worker back, and once it opens every partition's jobs run.
func TestGateHoldsEveryPartition(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	var mu sync.Mutex
	runs := map[string]int{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		mu.Lock()
		runs[j.ID]++
		mu.Unlock()
		return nil
	}))
	gate := &heldGate{open: make(chan struct{})}
	const parts, jobs = 3, 30
	c := e.client(onceflow.Config{Workers: ws, Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {Partitions: parts, Gate: gate}}})
	ctx := context.Background()
	used := map[int]bool{}
	for i := range jobs {
		res, err := c.Enqueue(ctx, sortArgs{Strings: []string{fmt.Sprint(i)}}, &onceflow.EnqueueOpts{Tenant: "acme"})
		if err != nil {
			t.Fatal(err)
		}
		used[queue.PartitionOf(res.JobID, parts)] = true
	}
	if len(used) != parts {
		t.Fatalf("%d jobs in partitions %v: the test needs every partition", jobs, used)
	}
	runClient(t, c)
	time.Sleep(time.Second) // more than enough for a worker to take a job
	mu.Lock()
	held := len(runs)
	mu.Unlock()
	if held != 0 {
		t.Fatalf("%d jobs ran while the gate was closed", held)
	}
	close(gate.open)
	testenv.WaitFor(t, 20*time.Second, "every job once the gate opened", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(runs) == jobs
	})
}
