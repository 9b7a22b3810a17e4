package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// Typed kinds routed by kind, on one queue and on a queue of their own; an unknown kind
// and arguments that do not decode are dead-lettered with a reason, and the workers
// keep running.
func TestKindsAreRoutedAndBadJobsDeadLettered(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	rec := &recorder{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(_ context.Context, j *onceflow.Job[sortArgs]) error {
		rec.add("sort " + j.Queue + " " + strings.Join(j.Args.Strings, ","))
		return nil
	}))
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(_ context.Context, j *onceflow.Job[emailArgs]) error {
		rec.add("email " + j.Queue + " " + j.Args.To + " " + j.Tenant)
		return nil
	}))
	// An unknown kind is retried (in a rolling deploy another worker may know it), then
	// dead-lettered after MaxDeliveries, here 2.
	c := newClient(t, rdb, prefix, ws, map[string]onceflow.QueueConfig{"default": {MaxDeliveries: 2, ClaimIdle: 300 * time.Millisecond}, "mail": {}})
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b", "a"}}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, emailArgs{To: "a@example.com"}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, undeclaredArgs{}, nil); err != nil {
		t.Fatal(err)
	}
	// A producer that writes a kind with arguments of the wrong shape.
	keys := queue.Keys{Prefix: prefix, Queue: "default"}
	if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: "bad-args-1", Kind: "sort", Payload: json.RawMessage(`{"Strings":["x"]}`), EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "both good jobs and two dead letters", func() bool {
		n, _ := rdb.XLen(ctx, keys.Dead()).Result()
		return len(rec.all()) == 2 && n == 2
	})
	got := rec.all()
	if !contains(got, "sort default b,a") || !contains(got, "email mail a@example.com acme") {
		t.Fatalf("workers saw %q", got)
	}
	dead, _, err := queue.ListDead(ctx, rdb, keys, "", 10)
	if err != nil {
		t.Fatal(err)
	}
	reasons := []string{dead[0].Reason, dead[1].Reason}
	if !containsPrefix(reasons, `failed 2 attempts; last error: onceflow: unknown job kind "nobody.runs.this" on queue "default"`) ||
		!containsPrefix(reasons, `permanent: onceflow: undecodable job arguments for kind "sort": Strings: unknown field`) {
		t.Fatalf("dead-letter reasons %q", reasons)
	}
}

// A Worker returning an error from another package's vocabulary is understood: Permanent
// from the retry package dead-letters at once.
func TestWorkerErrorVocabulary(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var n int
	var mu sync.Mutex
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error {
		mu.Lock()
		n++
		mu.Unlock()
		return onceflow.Permanent(errors.New("cannot sort these"))
	}))
	c := newClient(t, rdb, prefix, ws, map[string]onceflow.QueueConfig{"default": {ClaimIdle: 100 * time.Millisecond, MaxDeliveries: 5}})
	if _, err := c.Enqueue(context.Background(), sortArgs{}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return rdb.XLen(context.Background(), prefix+":{default}:dead").Val() == 1 })
	time.Sleep(300 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
}

// A rolling deploy: a job of a new kind reaches a worker of the previous version first,
// which does not know the kind. It is not dead-lettered: once the old worker stopped, a
// new one that knows the kind runs it, once.
func TestANewKindSurvivesARollingDeploy(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	queues := map[string]onceflow.QueueConfig{"default": {ClaimIdle: 300 * time.Millisecond}}
	old := newClient(t, rdb, prefix, onceflow.NewWorkers(), queues)
	ctx, stopOld := context.WithCancel(context.Background())
	oldDone := make(chan error, 1)
	go func() { oldDone <- old.Run(ctx) }()
	res, err := old.Enqueue(context.Background(), sortArgs{Strings: []string{"b", "a"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := queue.Keys{Prefix: prefix, Queue: "default"}
	testenv.WaitFor(t, 10*time.Second, "the old worker's failed run", func() bool {
		return rdb.HExists(context.Background(), keys.Job(res.JobID), "last_error").Val()
	})
	stopOld()
	if err := <-oldDone; err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { runs.Add(1); return nil }))
	runClient(t, newClient(t, rdb, prefix, ws, queues))
	testenv.WaitFor(t, 10*time.Second, "the new worker's run", func() bool { return runs.Load() == 1 })
	time.Sleep(time.Second) // more than two claim cycles: no second run, no dead letter
	if n := rdb.XLen(context.Background(), keys.Dead()).Val(); n != 0 || runs.Load() != 1 {
		t.Fatalf("%d dead letters, %d runs; want 0 and 1", n, runs.Load())
	}
}

// A Middleware sees the delivery's stream entry id (JobInfo.EntryID), the id XRANGE
// shows, distinct for two entries of one job id.
func TestJobInfoCarriesTheStreamEntryID(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var mu sync.Mutex
	seen := map[string]string{} // entry id -> job id
	record := func(next onceflow.JobFunc) onceflow.JobFunc {
		return func(ctx context.Context, info *onceflow.JobInfo) error {
			mu.Lock()
			seen[info.EntryID] = info.ID
			mu.Unlock()
			return next(ctx, info)
		}
	}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil }))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t), Middleware: []onceflow.Middleware{record}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 2 { // two entries of one job id
		if _, err := c.Enqueue(ctx, sortArgs{}, &onceflow.EnqueueOpts{JobID: "job-1"}); err != nil {
			t.Fatal(err)
		}
	}
	// Read the entries before the workers run: they trim acknowledged ones.
	entries, err := rdb.XRange(ctx, queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}.Stream(), "-", "+").Result()
	if err != nil || len(entries) != 2 {
		t.Fatalf("stream entries %v (%v), want 2", entries, err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "two deliveries", func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) >= 2 })
	mu.Lock()
	defer mu.Unlock()
	for _, en := range entries {
		if seen[en.ID] != "job-1" {
			t.Errorf("entry %s: middleware saw %v, want job-1 under that entry id", en.ID, seen)
		}
	}
}

// A rolling restart of the workers (Client.Run cancelled while a job runs longer than
// ShutdownTimeout) cancels the job, which stays pending for another worker and spends
// none of its attempts, as a job handed back for an unavailable dependency: with
// MaxDeliveries 2, a job cut by two restarts still runs to its end on its third run.
func TestRestartsDoNotSpendDeliveries(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	started := make(chan struct{}, 10)
	var runs, finished atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(ctx context.Context, j *onceflow.Job[sortArgs]) error {
		if runs.Add(1) <= 2 { // the first two runs are cut by a restart
			started <- struct{}{}
			<-ctx.Done()
			return ctx.Err()
		}
		finished.Add(1)
		return nil
	}))
	queues := map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ShutdownTimeout: 200 * time.Millisecond, MaxDeliveries: 2, ClaimIdle: time.Second}}
	ctx := context.Background()
	res, err := newClient(t, rdb, prefix, ws, queues).Enqueue(ctx, sortArgs{Strings: []string{"long"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for restart := 1; restart <= 2; restart++ {
		c := newClient(t, rdb, prefix, ws, queues)
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- c.Run(rctx) }()
		select {
		case <-started:
		case <-time.After(20 * time.Second):
			t.Fatalf("restart %d: the job did not start", restart)
		}
		cancel() // the rolling restart
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	runClient(t, newClient(t, rdb, prefix, ws, queues))
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	testenv.WaitFor(t, 20*time.Second, "the job finished or dead-lettered", func() bool {
		return finished.Load() == 1 || rdb.XLen(ctx, keys.Dead()).Val() > 0
	})
	if finished.Load() != 1 {
		dead, _, _ := queue.ListDead(ctx, rdb, keys, "", 10)
		var reasons []string
		for _, d := range dead {
			reasons = append(reasons, d.Reason)
		}
		t.Fatalf("job %s was dead-lettered after two restarts (runs %d): %q; want it run to the end", res.JobID, runs.Load(), reasons)
	}
}

type spentArgs struct {
	Order string `json:"order"`
}

func (spentArgs) Kind() string { return "spent.order" }

// A job whose delivery number MaxDeliveries committed its rows and its effect, then
// whose worker died before the XACK (the count set with XCLAIM RETRYCOUNT), is not
// dead-lettered by the next claim: the client's handler finds its completion record, the
// job is acknowledged, its status is done, and audit holds.
func TestCommittedJobWithASpentBudgetIsNotDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE spent_orders (job_id text PRIMARY KEY, order_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[spentArgs](func(ctx context.Context, j *onceflow.Job[spentArgs]) error {
		runs.Add(1)
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO spent_orders (job_id, order_id) VALUES ($1, $2)`, j.ID, j.Args.Order)
			c.Emit("email.order", "order:"+j.ID, j.Args)
			return nil
		})
	}))
	const maxDeliveries = 3
	cfg := onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: maxDeliveries, ClaimIdle: 200 * time.Millisecond}}}
	c, err := onceflow.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.Enqueue(ctx, spentArgs{Order: "o-1"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	if err := queue.CreateGroup(ctx, rdb, keys, queue.DefaultGroup); err != nil {
		t.Fatal(err)
	}
	// Delivery number MaxDeliveries to a worker that commits and dies before the XACK.
	read, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: queue.DefaultGroup, Consumer: "dead", Streams: []string{keys.Stream(), ">"}, Count: 1}).Result()
	if err != nil {
		t.Fatal(err)
	}
	entry := read[0].Messages[0]
	msg, err := queue.ParseMessage(entry.Values)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Inspector().Handler(onceflow.DefaultQueue).Handle(ctx, &queue.Job{Message: msg, ID: entry.ID, Deliveries: maxDeliveries}); err != nil {
		t.Fatalf("the committing run: %v", err)
	}
	if err := rdb.Do(ctx, "XCLAIM", keys.Stream(), queue.DefaultGroup, "dead", 0, entry.ID, "IDLE", 3_600_000, "RETRYCOUNT", maxDeliveries, "JUSTID").Err(); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 15*time.Second, "the entry to be settled", func() bool {
		p, err := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Result()
		return err == nil && p.Count == 0
	})
	if d, _, err := queue.ListDead(ctx, rdb, keys, "", 10); err != nil || len(d) != 0 {
		t.Fatalf("dead letters %+v %v: a committed job was dead-lettered", d, err)
	}
	st, err := c.JobState(ctx, "acme", res.JobID)
	if err != nil || st.Status != onceflow.StatusDone {
		t.Errorf("JobState = %+v %v, want done", st, err)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the worker ran %d times, want 1 (the committing run)", n)
	}
	var rows, emails int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM spent_orders`).Scan(&rows)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE topic = 'email.order'`).Scan(&emails)
	if rows != 1 || emails != 1 {
		t.Errorf("%d rows and %d emails, want 1 each", rows, emails)
	}
	rep, err := c.Audit(ctx)
	if err != nil || !rep.OK() {
		t.Errorf("audit %+v %v, want OK", rep, err)
	}
}

// A spent job whose completion cannot be checked (PostgreSQL went down while its last
// allowed run failed) is handed back without a new budget: it runs exactly MaxDeliveries
// times however long the outage lasts; the completion question is repeated, the run is
// not, and once PostgreSQL answers (no completion) the job is dead-lettered.
func TestSpentJobIsNotRerunWhilePostgresIsDown(t *testing.T) {
	t.Parallel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	rdb, prefix := testenv.Redis(t)
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error {
		if runs.Add(1) == 1 {
			pg.Stop() // the store goes down while the run fails
		}
		return errors.New("boom")
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Workers: ws, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {MaxDeliveries: 1, ClaimIdle: time.Hour, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, sortArgs{}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 20*time.Second, "the first run", func() bool { return runs.Load() >= 1 })
	time.Sleep(5 * time.Second) // PostgreSQL stays down
	during := runs.Load()
	pg.Start()
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	testenv.WaitFor(t, 60*time.Second, "the dead letter", func() bool { return rdb.XLen(ctx, keys.Dead()).Val() == 1 })
	if n := runs.Load(); n != 1 {
		t.Errorf("the job ran %d times (%d during a 5s PostgreSQL outage), want 1: MaxDeliveries is 1", n, during)
	}
}

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
	ws, runs := countingSortWorkers()
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
	if n := runs.jobs(); n != jobs {
		t.Fatalf("%d jobs ran, want %d", n, jobs)
	}
	runs.onceEach(t, slices.Collect(maps.Values(ids)))
	t.Logf("%d jobs over nodes %v", jobs, nodes)
}

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

// Changing a queue's number of partitions loses no job and runs none twice: workers
// consume every recorded partition, whatever their own setting.
func TestChangingPartitionsLosesNoJob(t *testing.T) {
	t.Parallel()
	// A key accepted before and after a change of N (3 -> 5 and 3 -> 2): both accepts
	// carry the same job id, both entries are consumed, and Commit writes one completion
	// and one refund row.
	for _, to := range []int{5, 2} {
		t.Run(fmt.Sprintf("a key accepted before and after 3 to %d commits once", to), func(t *testing.T) {
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
	// A Client of 4 partitions enqueues (and so records 4), and a Client configured with 1
	// runs every job of the 4 partitions, and its JobState finds them.
	t.Run("a lowered count still runs every job", func(t *testing.T) {
		t.Parallel()
		e := newDBEnv(t)
		ws, runs := countingSortWorkers()
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
		waitAllDone(t, after, 30*time.Second, "acme", ids)
		runs.onceEach(t, ids)
	})
	// Scheduled jobs (EnqueueOpts.RunAt) in the higher partitions: a Client configured with
	// 1 partition runs them when due, and JobState finds them queued with their RunAt
	// before and done after.
	t.Run("a lowered count runs scheduled jobs when due", func(t *testing.T) {
		t.Parallel()
		e := newDBEnv(t)
		ctx := context.Background()
		ws, runs := countingSortWorkers()
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
		waitAllDone(t, after, 20*time.Second, "acme", ids)
		runs.onceEach(t, ids)
	})
}

// A worker process that starts while Redis is down (a routine outage; its queue worker
// waits for Redis) consumes, once Redis is back, every partition the enqueuers recorded
// (here an API process of 4 partitions), not only its own configured one.
func TestWorkerStartedDuringARedisOutageConsumesRecordedPartitions(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := onceflow.NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := testenv.Prefix(t)
	ws, runs := countingSortWorkers()
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
		clear(missing)
		for _, id := range ids {
			if runs.ran(id) == 0 {
				missing[queue.PartitionOf(id, 4)]++
			}
		}
		if len(missing) == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("15s after Redis came back, jobs never run by the worker started during the outage, by partition: %v", missing)
}

// Partitions above Concurrency (here 8 partitions, Concurrency 2, a plausible setting for
// a rate-limited model queue spread over a cluster) are accepted, and the idle
// partitions' blocking reads hold none of the budget's slots: 24 instant jobs spread over
// the partitions all run within 2s, not many seconds.
func TestPartitionsAboveConcurrencyDoNotStarveTheQueue(t *testing.T) {
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
		t.Fatalf("NewClient refuses Partitions > Concurrency: %v", err)
	}
	runClient(t, c)
	time.Sleep(500 * time.Millisecond) // every partition's reader is in its blocking read
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
	ws, runs := countingSortWorkers()
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
	if held := runs.jobs(); held != 0 {
		t.Fatalf("%d jobs ran while the gate was closed", held)
	}
	close(gate.open)
	testenv.WaitFor(t, 20*time.Second, "every job once the gate opened", func() bool { return runs.jobs() == jobs })
}

// AddWorkerSafely refuses a second worker for a kind.
func TestAddWorkerSafelyRefusesASecondWorkerForAKind(t *testing.T) {
	t.Parallel()
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil }))
	if err := onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil })); err == nil {
		t.Fatal("a second worker for one kind was accepted")
	}
}
