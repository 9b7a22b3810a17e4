package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
)

// A keyed enqueue is idempotent within its queue: a key names one job of a tenant, kind
// and queue.
func TestKeyedEnqueue(t *testing.T) {
	t.Parallel()
	// The same key and arguments again add nothing and give the same job id; other
	// arguments with that key are refused; another tenant's key is another job.
	t.Run("the same key is one job", func(t *testing.T) {
		t.Parallel()
		rdb, prefix := testenv.Redis(t)
		c := newClient(t, rdb, prefix, nil, nil)
		ctx := context.Background()
		first, err := c.Enqueue(ctx, sortArgs{Strings: []string{"x"}}, &onceflow.EnqueueOpts{Key: "order-17", Tenant: "acme"})
		if err != nil || first.Replayed {
			t.Fatalf("first enqueue: %+v %v", first, err)
		}
		again, err := c.Enqueue(ctx, sortArgs{Strings: []string{"x"}}, &onceflow.EnqueueOpts{Key: "order-17", Tenant: "acme"})
		if err != nil || !again.Replayed || again.JobID != first.JobID {
			t.Fatalf("second enqueue: %+v %v, want a replay of %s", again, err, first.JobID)
		}
		if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"y"}}, &onceflow.EnqueueOpts{Key: "order-17", Tenant: "acme"}); !errors.Is(err, idempotency.ErrKeyReused) {
			t.Fatalf("other arguments with the key: %v, want ErrKeyReused", err)
		}
		other, err := c.Enqueue(ctx, sortArgs{Strings: []string{"x"}}, &onceflow.EnqueueOpts{Key: "order-17", Tenant: "globex"})
		if err != nil || other.Replayed || other.JobID == first.JobID {
			t.Fatalf("another tenant's key: %+v %v", other, err)
		}
		if want := onceflow.JobID(onceflow.EnqueueScope("acme", "sort", "order-17")); first.JobID != want {
			t.Fatalf("job id %s, want the derived %s", first.JobID, want)
		}
		if n := rdb.XLen(ctx, prefix+":{default}:stream").Val(); n != 2 {
			t.Fatalf("%d stream entries, want 2", n)
		}
	})
	// A key is scoped by its queue (its record lives with the queue): the same tenant,
	// kind and key on another queue is another key and another job, with another id,
	// never a second job under the first one's id; on that queue it is idempotent in turn.
	t.Run("the same key on another queue is another job", func(t *testing.T) {
		t.Parallel()
		rdb, prefix := testenv.Redis(t)
		c := newClient(t, rdb, prefix, nil, map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {}, "urgent": {}})
		ctx := context.Background()
		first, err := c.Enqueue(ctx, sortArgs{Strings: []string{"a"}}, &onceflow.EnqueueOpts{Tenant: "acme", Key: "sort-request-1"})
		if err != nil {
			t.Fatal(err)
		}
		urgent := &onceflow.EnqueueOpts{Tenant: "acme", Key: "sort-request-1", Queue: "urgent"}
		other, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b"}}, urgent)
		if err != nil || other.Replayed || other.JobID == first.JobID || other.JobID != onceflow.JobID(onceflow.EnqueueScopeOn("urgent", "acme", "sort", "sort-request-1")) {
			t.Fatalf("the key on another queue: %+v, %v; want a new job with its own derived id", other, err)
		}
		if again, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b"}}, urgent); err != nil || !again.Replayed || again.JobID != other.JobID {
			t.Fatalf("the key again on that queue: %+v, %v; want a replay", again, err)
		}
		if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"c"}}, urgent); !errors.Is(err, idempotency.ErrKeyReused) {
			t.Fatalf("other arguments on that queue: %v, want ErrKeyReused", err)
		}
		if n := rdb.XLen(ctx, c.Inspector().QueueKeys("urgent").Stream()).Val(); n != 1 {
			t.Fatalf("%d jobs on urgent, want 1", n)
		}
	})
}

// A caller-chosen job id (EnqueueOpts.JobID) belongs to the tenant that enqueued it
// first.
func TestCallerJobID(t *testing.T) {
	t.Parallel()
	// Two tenants that choose the same job id: the second's enqueue is refused with
	// ErrJobIDTaken, with or without a key, and nothing of it is written; the first keeps
	// its job (its index and its state); the owner may enqueue its id again.
	t.Run("of another tenant is refused", func(t *testing.T) {
		t.Parallel()
		e := newDBEnv(t)
		c := e.client(onceflow.Config{})
		ctx := context.Background()
		args := refundArgs{OrderID: "o-1", AmountCents: 100}
		if _, err := c.Enqueue(ctx, args, &onceflow.EnqueueOpts{JobID: "order-1", Tenant: "acme"}); err != nil {
			t.Fatal(err)
		}
		for _, opts := range []*onceflow.EnqueueOpts{
			{JobID: "order-1", Tenant: "globex"},
			{JobID: "order-1", Tenant: "globex", Key: "k-1"},
			{JobID: "order-1"}, // no tenant is not acme either
		} {
			if res, err := c.Enqueue(ctx, args, opts); !errors.Is(err, onceflow.ErrJobIDTaken) {
				t.Fatalf("enqueue %+v of acme's job id: %+v %v, want ErrJobIDTaken", opts, res, err)
			}
		}
		if n := e.added(); n != 1 {
			t.Fatalf("%d stream entries added, want acme's only", n)
		}
		if st, err := c.JobState(ctx, "acme", "order-1"); err != nil || st.Status != "queued" {
			t.Fatalf("acme's job: %+v %v, want it queued", st, err)
		}
		if _, err := c.JobState(ctx, "globex", "order-1"); !errors.Is(err, onceflow.ErrJobNotFound) {
			t.Fatalf("globex reads acme's job: %v, want ErrJobNotFound", err)
		}
		// The key globex tried was not stored: with another job id it works.
		if res, err := c.Enqueue(ctx, args, &onceflow.EnqueueOpts{Tenant: "globex", Key: "k-1"}); err != nil || res.Replayed {
			t.Fatalf("globex's key after the refusal: %+v %v, want a new job", res, err)
		}
		if _, err := c.Enqueue(ctx, args, &onceflow.EnqueueOpts{JobID: "order-1", Tenant: "acme"}); err != nil {
			t.Fatalf("acme enqueues its own id again: %v", err)
		}
		if n := e.added(); n != 3 {
			t.Fatalf("%d stream entries added, want 3", n)
		}
	})
	// A caller-chosen job id is checked against its tenant on the queue it goes to (the job
	// index lives with the queue). On another queue the enqueue is accepted, but the two
	// jobs never pass for one: the first to commit is done, and the other, at its Commit, is
	// dead-lettered with ErrJobIDTaken, writing nothing. (EnqueueOpts.JobID documents this;
	// a Key, whose derived id includes the tenant, has no such collision.)
	t.Run("of another tenant on another queue never passes for theirs", func(t *testing.T) {
		t.Parallel()
		e := newDBEnv(t)
		var runs atomic.Int64
		ws := onceflow.NewWorkers()
		onceflow.AddWorker(ws, refundWorker(&runs))
		c := e.client(onceflow.Config{Workers: ws, Queues: map[string]onceflow.QueueConfig{
			onceflow.DefaultQueue: {}, "other": {MaxDeliveries: 1, ClaimIdle: 300 * time.Millisecond}}})
		ctx := context.Background()
		if _, err := c.Enqueue(ctx, refundArgs{OrderID: "o-alice", AmountCents: 100}, &onceflow.EnqueueOpts{Tenant: "alice", JobID: "order-1"}); err != nil {
			t.Fatal(err)
		}
		runClient(t, c)
		testenv.WaitFor(t, 10*time.Second, "alice's job done", func() bool {
			st, err := c.JobState(ctx, "alice", "order-1")
			return err == nil && st.Status == onceflow.StatusDone
		})
		if _, err := c.Enqueue(ctx, refundArgs{OrderID: "o-mallory", AmountCents: 5}, &onceflow.EnqueueOpts{Tenant: "mallory", JobID: "order-1", Queue: "other"}); err != nil {
			t.Fatal(err)
		}
		testenv.WaitFor(t, 10*time.Second, "mallory's job dead-lettered", func() bool {
			st, err := c.JobState(ctx, "mallory", "order-1")
			return err == nil && st.Status == onceflow.StatusFailed && strings.Contains(st.Error, "belongs to another tenant")
		})
		if n := e.count(`SELECT count(*) FROM refunds`); n != 1 || e.count(`SELECT count(*) FROM refunds WHERE order_id = 'o-alice'`) != 1 {
			t.Fatalf("%d refunds, want alice's one", n)
		}
		if st, err := c.JobState(ctx, "alice", "order-1"); err != nil || st.Status != onceflow.StatusDone {
			t.Fatalf("alice's job after mallory's: %+v %v, want still done", st, err)
		}
	})
}

// reminderArgs has a time.Duration, as River users' args often do (a delay, a timeout).
type reminderArgs struct {
	To    string        `json:"to"`
	After time.Duration `json:"after"`
}

func (reminderArgs) Kind() string { return "test.reminder" }

// digestArgs has a fixed-size byte array.
type digestArgs struct {
	Sum [4]byte `json:"sum"`
}

func (digestArgs) Kind() string { return "test.digest" }

// roundTripArgs enqueues args and runs the job: Enqueue either refuses them at once or
// its worker gets them as they were; a job Enqueue accepted is never dead-lettered as
// undecodable.
func roundTripArgs[T interface {
	onceflow.JobArgs
	comparable
}](t *testing.T, args T) {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	got := make(chan T, 1)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[T](func(_ context.Context, j *onceflow.Job[T]) error {
		select {
		case got <- j.Args:
		default:
		}
		return nil
	}))
	c := newClient(t, rdb, prefix, ws, nil)
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, args, nil); err != nil {
		t.Logf("Enqueue refused the arguments: %v", err) // acceptable: refused up front
		return
	}
	runClient(t, c)
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	var ran *T
	testenv.WaitFor(t, 10*time.Second, "the job run or dead-lettered", func() bool {
		select {
		case a := <-got:
			ran = &a
			return true
		default:
		}
		n, _ := rdb.XLen(ctx, keys.Dead()).Result()
		return n > 0
	})
	if ran == nil {
		dead, _, _ := queue.ListDead(ctx, rdb, keys, "", 1)
		reason := ""
		if len(dead) > 0 {
			reason = dead[0].Reason
		}
		t.Fatalf("a job Enqueue accepted never reached its worker: dead-lettered with %q", reason)
	}
	if *ran != args {
		t.Errorf("the worker got %+v, want %+v", *ran, args)
	}
}

// Any arguments Enqueue accepts reach their Worker: Enqueue encodes with the JSON
// semantics the worker decodes with (encoding/json/v2's), so what the worker would
// refuse Enqueue refuses at once, never accepting a job that can only be dead-lettered.
func TestEnqueuedArgumentsReachTheirWorkerOrAreRefused(t *testing.T) {
	t.Parallel()
	// A time.Duration, as River users' args often have (a delay, a timeout), has no
	// default representation in json v2.
	t.Run("a time.Duration", func(t *testing.T) {
		t.Parallel()
		roundTripArgs(t, reminderArgs{To: "ann@example.com", After: 90 * time.Second})
	})
	// A fixed-size byte array (a hash, a key), which encoding/json encodes as an array of
	// numbers and json v2 as a base64 string.
	t.Run("a byte array", func(t *testing.T) {
		t.Parallel()
		roundTripArgs(t, digestArgs{Sum: [4]byte{1, 2, 3, 4}})
	})
}

// Client.Enqueue and Route count onceflow_queue_enqueued_total by queue, new jobs only:
// a replayed key adds nothing and counts nothing.
func TestEnqueueCountsEnqueuedJobs(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	reg := prometheus.NewRegistry()
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 2 { // the second is a replay
		if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{"b", "a"}}, &onceflow.EnqueueOpts{Key: "sort-1"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Enqueue(ctx, emailArgs{To: "a@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	h, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{Tenant: bearerTenants(map[string]string{"k": "acme"})})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	for range 2 { // the second is a replay
		if a := postJSON(t, srv.URL+"/v1/tickets", "k", "ticket-key-0000001", "application/json", `{"subject":"s","body":"b"}`); a.code != http.StatusAccepted {
			t.Fatalf("POST: %d %s", a.code, a.body)
		}
	}
	for q, want := range map[string]float64{onceflow.DefaultQueue: 2, "mail": 1} {
		if got := metricValue(t, reg, "onceflow_queue_enqueued_total", map[string]string{"queue": q}); got != want {
			t.Errorf("onceflow_queue_enqueued_total{queue=%q} = %v, want %v", q, got, want)
		}
		n, err := rdb.XLen(ctx, queue.Keys{Prefix: prefix, Queue: q}.Stream()).Result()
		if err != nil || float64(n) != want {
			t.Errorf("stream %s holds %d entries (%v), want %v", q, n, err, want)
		}
	}
}

// Redis down at the first enqueue of a partitioned Client (whose enqueue first records
// its partitions) is an outage like any other: the route answers what it answers for an
// unpartitioned queue (503 with Retry-After, per RouteConfig), and Enqueue's error
// matches ErrUnavailable alike.
func TestRedisDownAtAPartitionedEnqueueIsUnavailable(t *testing.T) {
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

// A job a Worker enqueues may carry its model step's answer: Enqueue from the Worker
// sends it only once the answer is recorded, and fails (the job is delivered again)
// when the ledger cannot write it, as Do does before its function.
func TestEnqueueFromAWorkerFailsWhenItsStepsAnswerCannotBeRecorded(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	refuse := refuseAnswers(t, pool)
	after := make(chan answerOutcome, 1)
	e := newParentEnv(t, pool, func(ctx context.Context, e *modelEnv, j *onceflow.Job[supportArgs], st *onceflow.Step) error {
		if j.Delivery > 1 {
			return j.Commit(ctx, nil)
		}
		refuse(true)
		_, err := e.client.Enqueue(ctx, supportArgs{Text: "child:" + st.Response.Content}, &onceflow.EnqueueOpts{Key: "child-of-" + j.ID})
		refuse(false)
		after <- answerOutcome{err: err, state: answerState(t, pool, st.Key)}
		return err
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	if o := awaitOutcome(t, after, 30*time.Second, "Enqueue"); o.err == nil && o.state != "succeeded" {
		t.Fatalf("Enqueue sent a child job carrying the step's answer while the answer reads %q: a worker killed now loses it, and the next delivery acts on another", o.state)
	}
}

// A model step's answer that a job enqueued from the Worker carries is durable before
// Enqueue sends the job, as before Do's function: a crash of PostgreSQL after the
// enqueue cannot take the answer back, or the next delivery would ask the model again
// and act on another answer than the one the enqueued job carries.
func TestAnswerAnEnqueuedJobCarriesSurvivesAPostgresCrash(t *testing.T) {
	testenv.Long(t) // a PostgreSQL of its own killed and restarted
	t.Parallel()
	pg, url, pool := crashablePostgres(t)
	after := make(chan answerOutcome, 1)
	var once sync.Once
	e := newParentEnv(t, pool, func(ctx context.Context, e *modelEnv, j *onceflow.Job[supportArgs], st *onceflow.Step) error {
		if _, err := e.client.Enqueue(ctx, supportArgs{Text: "child:" + st.Response.Content}, &onceflow.EnqueueOpts{Key: "child-of-" + j.ID}); err != nil {
			return err
		}
		// The child job is in Redis with st's content.
		once.Do(func() { after <- crashAndReadState(pg, url, st.Key) })
		return nil
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	if o := awaitOutcome(t, after, 60*time.Second, "Enqueue"); o.err != nil || o.state != ledger.StateSucceeded {
		t.Fatalf("the answer an enqueued job carries, after a crash of PostgreSQL: state %q (%v); want succeeded", o.state, o.err)
	}
}
