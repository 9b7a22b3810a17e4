package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// keyMovedBy returns a key (of tenant acme, kind refund.issue, DefaultQueue) whose job
// lands in different partitions with from and to partitions.
func keyMovedBy(t *testing.T, from, to int) (key, id string) {
	t.Helper()
	for i := range 1000 {
		key = fmt.Sprintf("order-%d", i)
		id = onceflow.JobID(onceflow.EnqueueScopeOn(onceflow.DefaultQueue, "acme", refundArgs{}.Kind(), key))
		if queue.PartitionOf(id, from) != queue.PartitionOf(id, to) {
			return key, id
		}
	}
	t.Fatal("no key moves")
	return "", ""
}

// Guard (attack round of issue 18): the docs' promise for a key accepted twice across a change of N (3 -> 5 and
// 3 -> 2): both accepts carry the same job id, both entries are consumed, and Commit
// writes one completion and one refund row.
func TestAttack18ChangedPartitionsCommitWritesOnce(t *testing.T) {
	t.Parallel()
	for _, to := range []int{5, 2} {
		t.Run(fmt.Sprint(to), func(t *testing.T) {
			t.Parallel()
			e := newDBEnv(t)
			ctx := context.Background()
			key, id := keyMovedBy(t, 3, to)
			args := refundArgs{OrderID: "o-" + key, AmountCents: 100}
			before := e.client(onceflow.Config{QueueDefaults: onceflow.QueueConfig{Partitions: 3}})
			if _, err := before.Enqueue(ctx, args, &onceflow.EnqueueOpts{Tenant: "acme", Key: key}); err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int64
			after := e.client(onceflow.Config{Workers: refundWorkers(&runs), QueueDefaults: onceflow.QueueConfig{Partitions: to}})
			again, err := after.Enqueue(ctx, args, &onceflow.EnqueueOpts{Tenant: "acme", Key: key})
			if err != nil || again.JobID != id {
				t.Fatalf("second accept: %+v, %v; want job %s", again, err, id)
			}
			runClient(t, after)
			parts, err := after.Inspector().QueuePartitions(ctx, onceflow.DefaultQueue)
			if err != nil || len(parts) != max(3, to) {
				t.Fatalf("QueuePartitions: %d, %v", len(parts), err)
			}
			testenv.WaitFor(t, 30*time.Second, "both entries consumed and acknowledged", func() bool {
				for _, k := range parts {
					gs, err := e.rdb.XInfoGroups(ctx, k.Stream()).Result()
					if err != nil {
						continue // no stream in this partition
					}
					for _, g := range gs {
						if g.Lag != 0 || g.Pending != 0 {
							return false
						}
					}
				}
				st, err := after.JobState(ctx, "acme", id)
				return err == nil && st.Status == onceflow.StatusDone
			})
			if c, r, _ := e.effects(id); c != 1 || r != 1 {
				t.Fatalf("job %s accepted twice: %d completions, %d refunds; want 1 and 1 (%d handler runs)", id, c, r, runs.Load())
			}
			t.Logf("3 -> %d: %d handler runs", to, runs.Load())
		})
	}
}

// Guard (attack round of issue 18): tenancy across the cross-partition fallback: the same explicit job id held by
// two tenants in two partitions (N changed between them): each tenant's JobState finds
// its own job, and a third tenant finds none.
func TestAttack18JobStateFallbackKeepsTenants(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	ctx := context.Background()
	var id string
	for i := range 1000 {
		id = fmt.Sprintf("twin-%d", i)
		if queue.PartitionOf(id, 3) != 0 {
			break
		}
	}
	one := e.client(onceflow.Config{})
	if _, err := one.Enqueue(ctx, sortArgs{Strings: []string{"a"}}, &onceflow.EnqueueOpts{Tenant: "acme", JobID: id}); err != nil {
		t.Fatal(err)
	}
	three := e.client(onceflow.Config{QueueDefaults: onceflow.QueueConfig{Partitions: 3}})
	if _, err := three.Enqueue(ctx, sortArgs{Strings: []string{"b"}}, &onceflow.EnqueueOpts{Tenant: "globex", JobID: id}); err != nil && !errors.Is(err, onceflow.ErrJobIDTaken) {
		t.Fatal(err)
	}
	for _, c := range []*onceflow.Client{one, three} {
		for _, tenant := range []string{"acme", "globex"} {
			st, err := c.JobState(ctx, tenant, id)
			if err != nil {
				if tenant == "globex" && errors.Is(err, onceflow.ErrJobNotFound) {
					continue // refused at enqueue
				}
				t.Fatalf("JobState(%s): %v", tenant, err)
			}
			if st.Tenant != tenant {
				t.Fatalf("JobState(%s) gave %s's job", tenant, st.Tenant)
			}
		}
		if _, err := c.JobState(ctx, "initech", id); !errors.Is(err, onceflow.ErrJobNotFound) {
			t.Fatalf("a third tenant: %v, want ErrJobNotFound", err)
		}
	}
}

// Found by the attack round of issue 18, failed before its fix: an operator lowers the record by hand as docs/queue.md tells (HSET
// P:partitions Q N) and mistypes it ("2 "): JobState of an unknown id (or of a job not
// in its home partition) answers an error, a 503 to the API's caller, instead of
// ErrJobNotFound (404), until the record is fixed (the cache keeps no error).
func TestAttack18JobStateWithMalformedPartitionsRecord(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	ctx := context.Background()
	c := e.client(onceflow.Config{QueueDefaults: onceflow.QueueConfig{Partitions: 2}})
	if err := e.rdb.HSet(ctx, queue.PartitionsKey(e.prefix), onceflow.DefaultQueue, "2 ").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.JobState(ctx, "acme", "no-such-job"); !errors.Is(err, onceflow.ErrJobNotFound) {
		t.Fatalf("JobState of an unknown id with a malformed partitions record: %v; want ErrJobNotFound", err)
	}
}

// Found by the attack round of issue 18, failed before its fix: a worker process that starts while Redis is down (a routine outage; its queue
// worker otherwise waits for Redis) cannot read P:partitions, warns, and consumes only its
// configured partitions for the whole life of the process: once Redis is back, jobs in
// the higher partitions recorded by the enqueuers (here an API process of 4 partitions)
// never run until the worker is restarted. docs/queue.md: "workers consume every
// recorded partition, whatever their own setting" and "none is lost".
func TestAttack18WorkerStartedDuringOutageConsumesRecordedPartitions(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := onceflow.NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := testenv.Prefix(t)
	var mu sync.Mutex
	ran := map[string]bool{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		mu.Lock()
		ran[j.ID] = true
		mu.Unlock()
		return nil
	}))
	worker, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	runClient(t, worker)
	time.Sleep(500 * time.Millisecond) // Run has started its workers during the outage
	srv.Start()
	api, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t),
		QueueDefaults: onceflow.QueueConfig{Partitions: 4}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var ids []string
	testenv.WaitFor(t, 30*time.Second, "Redis back", func() bool { return rdb.Ping(ctx).Err() == nil })
	for i := range 16 {
		res, err := api.Enqueue(ctx, sortArgs{Strings: []string{fmt.Sprint(i)}}, &onceflow.EnqueueOpts{Tenant: "acme"})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.JobID)
	}
	deadline := time.Now().Add(15 * time.Second)
	missing := map[int]int{}
	for time.Now().Before(deadline) {
		mu.Lock()
		clear(missing)
		for _, id := range ids {
			if !ran[id] {
				missing[queue.PartitionOf(id, 4)]++
			}
		}
		mu.Unlock()
		if len(missing) == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("15s after Redis came back, jobs never run by the worker started during the outage, by partition: %v", missing)
}

// Guard (attack round of issue 18): a queue name shaped like a partition ("default:1") is refused at every entry
// point the Client has, so it cannot alias partition 1 of "default".
func TestAttack18QueueNameLikeAPartitionIsRefused(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	if _, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: onceflow.NewWorkers(),
		Queues: map[string]onceflow.QueueConfig{"default:1": {}}}); err == nil {
		t.Fatal("a QueueConfig named default:1 was accepted")
	}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, QueueDefaults: onceflow.QueueConfig{Partitions: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"x"}}, &onceflow.EnqueueOpts{Queue: "default:1"}); err == nil {
		t.Fatal("Enqueue to queue default:1 was accepted")
	}
	if n, _ := rdb.Exists(ctx, prefix+":{default:1}:stream", prefix+":{default:1:1}:stream").Result(); n != 0 {
		t.Fatal("a stream was written for queue default:1")
	}
}

// Guard (attack round of issue 18): Redis is down at the first enqueue of a
// partitioned Client. The route's accept of an unpartitioned queue answers what an
// outage of the key store answers (503 with Retry-After, per RouteConfig); the
// partitioned one fails earlier, in enqueueKeys' RegisterPartitions, whose error is not
// marked Unavailable: it must answer the same, and Enqueue's error must match
// ErrUnavailable alike.
func TestAttack18RedisDownAtFirstPartitionedAccept(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := onceflow.NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := testenv.Prefix(t)
	mux := http.NewServeMux()
	clients := map[int]*onceflow.Client{}
	for _, n := range []int{1, 2} {
		c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t),
			QueueDefaults: onceflow.QueueConfig{Partitions: n}})
		if err != nil {
			t.Fatal(err)
		}
		clients[n] = c
		h, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{Tenant: bearerTenants(map[string]string{"acme-key-0123456789": "acme"})})
		if err != nil {
			t.Fatal(err)
		}
		mux.Handle(fmt.Sprintf("POST /v1/tickets/%d", n), h)
	}
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	srv.Stop()
	body := `{"subject":"Refund","body":"x"}`
	one := postJSON(t, hs.URL+"/v1/tickets/1", "acme-key-0123456789", "ticket-key-000000001", "application/json", body)
	two := postJSON(t, hs.URL+"/v1/tickets/2", "acme-key-0123456789", "ticket-key-000000001", "application/json", body)
	if one.code != two.code || (one.header.Get("Retry-After") == "") != (two.header.Get("Retry-After") == "") {
		t.Errorf("Redis down: 1 partition answers %d (Retry-After %q), 2 partitions answer %d (Retry-After %q): %s",
			one.code, one.header.Get("Retry-After"), two.code, two.header.Get("Retry-After"), two.body)
	}
	ctx := context.Background()
	_, e1 := clients[1].Enqueue(ctx, ticketArgs{Subject: "s"}, &onceflow.EnqueueOpts{Tenant: "acme", Key: "k-2"})
	_, e2 := clients[2].Enqueue(ctx, ticketArgs{Subject: "s"}, &onceflow.EnqueueOpts{Tenant: "acme", Key: "k-2"})
	if errors.Is(e1, onceflow.ErrUnavailable) != errors.Is(e2, onceflow.ErrUnavailable) {
		t.Errorf("Redis down: Enqueue of 1 partition %v (ErrUnavailable %v), of 2 partitions %v (ErrUnavailable %v)",
			e1, errors.Is(e1, onceflow.ErrUnavailable), e2, errors.Is(e2, onceflow.ErrUnavailable))
	}
}

// Found by the attack round of issue 18, failed before its fix: NewClient accepts Partitions above Concurrency (here 8 partitions, Concurrency
// 2, a plausible setting for a rate-limited model queue spread over a cluster), and then
// the idle partitions' readers hold the budget's slots in their 1s blocking reads: 24
// instant jobs spread over the partitions take many seconds instead of milliseconds.
// (queue.TestAttack18BudgetStarvesBacklogWhenPartitionsOutnumberSlots shows the
// mechanism.) Either refuse Partitions > Concurrency or do not hold a slot while blocking.
func TestAttack18ClientPartitionsAboveConcurrencyStarve(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var ran atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error {
		ran.Add(1)
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t),
		QueueDefaults: onceflow.QueueConfig{Partitions: 8, Concurrency: 2}})
	if err != nil {
		t.Skipf("NewClient refuses Partitions > Concurrency: %v", err)
	}
	runClient(t, c)
	time.Sleep(500 * time.Millisecond)
	ctx := context.Background()
	const jobs = 24
	start := time.Now()
	for i := range jobs {
		if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{fmt.Sprint(i)}}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(2 * time.Second)
	for ran.Load() < jobs && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := ran.Load(); n < jobs {
		t.Fatalf("%v after enqueueing %d instant jobs, %d ran (8 partitions, Concurrency 2)", time.Since(start).Round(time.Millisecond), jobs, n)
	}
}

// Guard (attack round of issue 18): lowering N with scheduled jobs (EnqueueOpts.RunAt) in the higher partitions: a
// Client configured with 1 partition runs them when due, and JobState finds them
// queued-with-RunAt before and done after.
func TestAttack18LoweredPartitionsRunScheduledJobs(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	ctx := context.Background()
	var mu sync.Mutex
	runs := map[string]int{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		mu.Lock()
		runs[j.ID]++
		mu.Unlock()
		return nil
	}))
	before := e.client(onceflow.Config{QueueDefaults: onceflow.QueueConfig{Partitions: 4}})
	after := e.client(onceflow.Config{Workers: ws})
	runAt := time.Now().Add(2 * time.Second)
	var ids []string
	for i := range 12 {
		res, err := before.Enqueue(ctx, sortArgs{Strings: []string{fmt.Sprint(i)}}, &onceflow.EnqueueOpts{Tenant: "acme", RunAt: runAt})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.JobID)
	}
	for _, id := range ids {
		if st, err := after.JobState(ctx, "acme", id); err != nil || st.Status != onceflow.StatusQueued || st.RunAt.IsZero() {
			t.Fatalf("job %s (partition %d of 4) before it is due, read by a 1-partition client: %+v, %v", id, queue.PartitionOf(id, 4), st, err)
		}
	}
	runClient(t, after)
	testenv.WaitFor(t, 20*time.Second, "every scheduled job done", func() bool {
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
			t.Fatalf("job %s ran %d times", id, runs[id])
		}
	}
}
