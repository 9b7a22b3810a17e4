package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// Findings of the second review of the public API (issue 13). Each test failed on the code
// before its fix because of the defect its comment names.

// A caller-chosen job id is checked against its tenant on the queue it goes to (the job
// index lives with the queue). On another queue the enqueue is accepted, but the two
// jobs never pass for one: the first to commit is done, and the other, at its Commit, is
// dead-lettered with ErrJobIDTaken, writing nothing. (EnqueueOpts.JobID documents this;
// a Key, whose derived id includes the tenant, has no such collision.)
func TestCallerJobIDOnAnotherQueueNeverPassesForTheOtherTenantsJob(t *testing.T) {
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
}

// EnqueueTx with a caller-chosen job id that another tenant's EnqueueTx already wrote
// reports success (Replayed, the other tenant's job id) instead of ErrJobIDTaken: the
// outbox dedupe key "enqueue:<job id>" is not scoped by tenant, so the second tenant's
// job is silently dropped while its caller is told it was enqueued. Enqueue refuses the
// same thing (ErrJobIDTaken), and docs/coming-from-river-asynq.md says "another tenant's
// enqueue of an id is refused (ErrJobIDTaken)".
func TestEnqueueTxJobIDOfAnotherTenant(t *testing.T) {
	t.Parallel()
	e := newEnqueueEnv(t)
	c := e.client(onceflow.Config{})
	e.enqueueInTx(c, refundArgs{OrderID: "o-alice", AmountCents: 100}, &onceflow.EnqueueOpts{Tenant: "alice", JobID: "refund-1"}, true)

	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	res, err := c.EnqueueTx(ctx, tx, refundArgs{OrderID: "o-mallory", AmountCents: 999}, &onceflow.EnqueueOpts{Tenant: "mallory", JobID: "refund-1"})
	if !errors.Is(err, onceflow.ErrJobIDTaken) {
		t.Errorf("mallory's EnqueueTx of alice's job id: %+v, %v; want ErrJobIDTaken", res, err)
	}
	if err == nil {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE topic = $1`, onceflow.TopicEnqueue); n != 1 {
		t.Fatalf("%d enqueue rows, want alice's only", n)
	}
}

// The relay's enqueue of an EnqueueTx row whose job id another tenant's job holds in
// Redis is refused by the queue (ErrJobIDTaken), which is final: the id is taken until
// that job's index expires. The built-in sender returns it unmarked, so the relay
// retries it as a transient failure with backoff, MaxAttempts times, before the row is
// exhausted; it should settle it at once as permanent (as it does a reused key).
func TestRelayTreatsJobIDTakenAsPermanent(t *testing.T) {
	t.Parallel()
	e := newEnqueueEnv(t)
	c := e.client(onceflow.Config{})
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, refundArgs{OrderID: "o-alice", AmountCents: 100}, &onceflow.EnqueueOpts{Tenant: "alice", JobID: "refund-2"}); err != nil {
		t.Fatal(err)
	}
	e.enqueueInTx(c, refundArgs{OrderID: "o-mallory", AmountCents: 999}, &onceflow.EnqueueOpts{Tenant: "mallory", JobID: "refund-2"}, true)
	res, err := relayPass(t, e, c, pgoutbox.New(e.pool), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var attempts int
	var exhausted bool
	if err := e.pool.QueryRow(ctx, `SELECT attempts, exhausted_at IS NOT NULL FROM outbox WHERE topic = $1`, onceflow.TopicEnqueue).Scan(&attempts, &exhausted); err != nil {
		t.Fatal(err)
	}
	if !exhausted {
		t.Fatalf("after one pass (%+v) the row refused with ErrJobIDTaken has %d attempts and is not exhausted: it will be retried %d times", res, attempts, outbox.DefaultMaxAttempts)
	}
	if n := e.added(); n != 1 {
		t.Fatalf("%d entries added, want alice's only", n)
	}
}

// A rolling restart of the workers (Client.Run cancelled while a job runs longer than
// ShutdownTimeout) cancels the job, which "stays pending" for another worker: but the
// cancelled run is counted as a failed delivery (and its "context canceled" recorded as
// the job's last error). An operator's restart is not the job's failure, and the worker
// already has the tool for it (a job handed back keeps its delivery count, as for
// Unavailable): here, with MaxDeliveries 2, two routine restarts dead-letter a job that
// would have succeeded on its third run ("exceeded 2 deliveries; last error: context
// canceled"). The relay, by contrast, releases its in-flight rows at shutdown unspent.
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

// An enqueue-only Client (no Workers: "a Client without it only enqueues", the API half
// of a split deployment) enqueues a kind whose arguments name their queue
// (JobArgsWithOpts), and Enqueue says where it went (Queue "mail"); but the same client's
// JobState looks only in the queues it runs (just "default") and answers ErrJobNotFound,
// which is documented as "an unknown id, another tenant's job, or a job whose index
// expired": StateHandler tells the job's own tenant 404 "no such job" for a job it has
// just accepted. JobState should find a job in the queue it was enqueued to.
func TestStateOfAJobOnAQueueTheClientDoesNotRun(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	ctx := context.Background()
	res, err := c.Enqueue(ctx, emailArgs{To: "ann@example.com"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	if n := rdb.XLen(ctx, c.Inspector().QueueKeys(res.Queue).Stream()).Val(); res.Queue != "mail" || n != 1 {
		t.Fatalf("enqueued to %q (%d entries), want mail", res.Queue, n)
	}
	st, err := c.JobState(ctx, "acme", res.JobID)
	if err != nil || st.Status != onceflow.StatusQueued || st.Queue != "mail" {
		t.Fatalf("JobState of the job the client just enqueued to %q: %+v, %v; want queued on mail", res.Queue, st, err)
	}
}

// opsReport is a kind whose arguments carry a default tenant (JobArgsWithOpts).
type opsReport struct {
	Title string `json:"title"`
}

func (opsReport) Kind() string { return "ops.report" }

func (opsReport) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Tenant: "ops"} }

// RouteConfig.Opts says "the key, the tenant and the job id always come from the
// request", and a tenant function may return "" for none. But Route passes the request's
// tenant through Enqueue's defaulting (cmp.Or), so a request whose tenant is "" enqueues
// a job owned by the kind's default tenant ("ops"): a tenant the request never
// authenticated as owns (and can read) it, while the job id was derived for tenant "",
// and the caller's own StateHandler answers 404 for the job it was just given.
func TestRouteTenantComesFromTheRequest(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	none := func(*http.Request) (string, error) { return "", nil }
	post, err := onceflow.Route(c, onceflow.RouteConfig[opsReport]{Tenant: none})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/reports", post)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	a := postJSON(t, srv.URL+"/v1/reports", "", "report-key-0000000001", "application/json", `{"title":"weekly"}`)
	if a.code != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.code, a.body)
	}
	var accepted struct {
		JobID string `json:"job_id"`
	}
	if err := json.Unmarshal([]byte(a.body), &accepted); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if st, err := c.JobState(ctx, "ops", accepted.JobID); err == nil {
		t.Errorf("tenant ops reads the job a request of tenant \"\" enqueued: %+v", st)
	}
	if st, err := c.JobState(ctx, "", accepted.JobID); err != nil || st.Status != onceflow.StatusQueued {
		t.Fatalf("the request's own tenant \"\" reads its job: %+v, %v; want queued", st, err)
	}
}

// A key is scoped by its queue (its record lives with the queue): the same tenant, kind
// and key on another queue is another key and another job, with another id, never a
// second job under the first one's id; on that queue it is idempotent in turn. (Before,
// the second enqueue added a job with the first one's derived id and other arguments.)
func TestKeyedEnqueueOnAnotherQueueIsAnotherJob(t *testing.T) {
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
}

// A route's queue is fixed (RouteConfig.Queue, else the kind's own), so a key names
// one job whatever the body: the same key with another body is 422, and nothing more is
// enqueued on any queue. (Before, RouteConfig.Opts could pick the queue per request, and
// a key reused with a body that mapped to another queue enqueued a second job with the
// first one's id: the key's record lives with the queue.)
func TestRouteQueueIsFixedSoAKeyIsOneJob(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {}, "urgent": {}})
	post, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{
		Tenant: func(*http.Request) (string, error) { return "acme", nil },
		Queue:  "urgent",
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(post)
	t.Cleanup(srv.Close)
	const key = "ticket-key-000000000001"
	if a := postJSON(t, srv.URL, "", key, "application/json", `{"subject":"refund me","body":"b"}`); a.code != http.StatusAccepted {
		t.Fatalf("first POST: %d %s", a.code, a.body)
	}
	if a := postJSON(t, srv.URL, "", key, "application/json", `{"subject":"refund me twice","body":"b"}`); a.code != http.StatusUnprocessableEntity {
		t.Errorf("the same key with another body: %d %s; want 422", a.code, a.body)
	}
	ctx := context.Background()
	if u, d := rdb.XLen(ctx, c.Inspector().QueueKeys("urgent").Stream()).Val(), rdb.XLen(ctx, c.Inspector().QueueKeys(onceflow.DefaultQueue).Stream()).Val(); u != 1 || d != 0 {
		t.Fatalf("jobs on urgent %d, on default %d; want 1 and 0", u, d)
	}
}

// Two workflows in one program: one whose kind runs on the default queue and declares
// no Queues (as docs/first-workflow.md's replies does), one that declares its own
// queue's settings (Workflow.Queues). NewClient merges the Queues into Config.Queues,
// which is then no longer empty, so the default ("DefaultQueue and the queue each of
// Workers' kinds names") is not applied: nothing works the default queue, and the first
// workflow's jobs wait for ever, with no error at start.
func TestWorkflowQueuesDoNotDropTheDefaultQueue(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var sorted atomic.Int64
	plain := onceflow.Workflow{Name: "plain", Workers: func(ws *onceflow.Workers) error {
		return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error {
			sorted.Add(1)
			return nil
		}))
	}}
	mail := onceflow.Workflow{Name: "mail", Queues: map[string]onceflow.QueueConfig{"mail": {Concurrency: 4}},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[emailArgs](func(context.Context, *onceflow.Job[emailArgs]) error { return nil }))
		}}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t), Workflows: []onceflow.Workflow{plain, mail}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(context.Background(), sortArgs{Strings: []string{"x"}}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	deadline := time.Now().Add(5 * time.Second)
	for sorted.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if sorted.Load() != 1 {
		t.Fatalf("the plain workflow's job never ran: the client works queues %v", c.Inspector().Queues())
	}
}

// A route's queue that onceflow cannot use is the server's mistake, found when the route
// is made, never a 400 that shows a client the server's configuration.
func TestRouteRefusesAnUnusableQueueAtOnce(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	_, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{
		Tenant: func(*http.Request) (string, error) { return "acme", nil },
		Queue:  "internal:billing-7", // a colon: not a usable queue name
	})
	if err == nil || !strings.Contains(err.Error(), "internal:billing-7") {
		t.Fatalf("Route with an unusable queue: %v, want an error naming it", err)
	}
}
