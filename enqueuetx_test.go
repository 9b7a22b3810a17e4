package onceflow_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

func newEnqueueEnv(t *testing.T) *dbEnv {
	e := newDBEnv(t)
	e.exec(`CREATE TABLE orders (id text PRIMARY KEY)`)
	return e
}

// relayPass runs one pass of a relay on the client's Sender.
func relayPass(t *testing.T, e *dbEnv, c *onceflow.Client, store outbox.Store, cfg outbox.Config) (outbox.PassResult, error) {
	t.Helper()
	cfg.Logger = testenv.Logger(t)
	r, err := outbox.NewRelay(store, c.Inspector().Sender(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r.Pass(context.Background())
}

// A rolled-back EnqueueTx leaves no job; a committed one runs once, and its row is
// marked sent.
func TestEnqueueTxEnqueuesIfAndOnlyIfTheTransactionCommits(t *testing.T) {
	t.Parallel()
	e := newEnqueueEnv(t)
	var runs atomic.Int64
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs)})

	gone := e.enqueueInTx(c, refundArgs{OrderID: "o-rolled-back", AmountCents: 100}, nil, false)
	if res, err := relayPass(t, e, c, pgoutbox.New(e.pool), outbox.Config{}); err != nil || res.Claimed != 0 {
		t.Fatalf("relay after a rollback: %+v %v", res, err)
	}
	if n := e.count(`SELECT count(*) FROM outbox`); n != 0 || len(e.stream()) != 0 {
		t.Fatalf("after a rollback: %d outbox rows, stream %v", n, e.stream())
	}

	kept := e.enqueueInTx(c, refundArgs{OrderID: "o-committed", AmountCents: 100}, nil, true)
	runClient(t, c)
	// The relay marks the row sent after its enqueue, so the job may finish first.
	sent := func() int {
		return e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL`, onceflow.TopicEnqueue)
	}
	testenv.WaitFor(t, 20*time.Second, "the committed job's completion and its row marked sent", func() bool {
		n, _, _ := e.effects(kept.JobID)
		return n == 1 && e.pending() == 0 && sent() == 1
	})
	e.onlyJob(kept.JobID)
	if n := e.added(); n != 1 || runs.Load() != 1 {
		t.Fatalf("%d entries added, runs %d; want the committed job once", n, runs.Load())
	}
	if c, _, _ := e.effects(gone.JobID); c != 0 {
		t.Fatal("the rolled-back job completed")
	}
	if n := sent(); n != 1 {
		t.Fatalf("%d enqueue rows marked sent, want 1", n)
	}
}

// With a key, EnqueueTx's job id is Enqueue's (derived from the key), a second
// EnqueueTx is a replay, and the keyed accept it goes through makes a later Enqueue with
// the key a replay too (the arguments' bytes survive the outbox), or ErrKeyReused for
// other arguments.
func TestKeyedEnqueueTxSharesEnqueuesKey(t *testing.T) {
	t.Parallel()
	e := newEnqueueEnv(t)
	c := e.client(onceflow.Config{})
	args := refundArgs{OrderID: "o-keyed", AmountCents: 250}
	opts := &onceflow.EnqueueOpts{Key: "ticket-42", Tenant: "acme"}
	first := e.enqueueInTx(c, args, opts, true)
	again := e.enqueueInTx(c, args, opts, true)
	want := onceflow.JobID(onceflow.EnqueueScope("acme", args.Kind(), "ticket-42"))
	if first.JobID != want || first.Replayed || again.JobID != want || !again.Replayed {
		t.Fatalf("first %+v, again %+v; want job id %s, the second replayed", first, again, want)
	}
	if res, err := relayPass(t, e, c, pgoutbox.New(e.pool), outbox.Config{}); err != nil || res.Sent != 1 {
		t.Fatalf("relay: %+v %v", res, err)
	}
	ctx := context.Background()
	direct, err := c.Enqueue(ctx, args, opts)
	if err != nil || !direct.Replayed || direct.JobID != want {
		t.Fatalf("Enqueue with the key after EnqueueTx: %+v %v, want a replay of %s", direct, err, want)
	}
	if _, err := c.Enqueue(ctx, refundArgs{OrderID: "o-keyed", AmountCents: 999}, opts); !errors.Is(err, idempotency.ErrKeyReused) {
		t.Fatalf("other arguments: %v, want ErrKeyReused", err)
	}
	if got := e.stream(); !slices.Equal(got, []string{want}) {
		t.Fatalf("stream %v, want the job once", got)
	}
}

// killedBeforeMark is the outbox store of a relay that dies after the send and before
// recording it.
type killedBeforeMark struct{ *pgoutbox.Store }

func (killedBeforeMark) Settle(context.Context, string, outbox.Settlement) (outbox.Settled, error) {
	return outbox.Settled{}, errors.New("relay killed before marking")
}

// The relay dies between enqueueing EnqueueTx's job and marking its row: after the
// lease, the client's relay enqueues it again, with the same job id. Both entries run;
// Commit makes one completion, one refund and one set of effects, and both are
// acknowledged.
func TestRelayDiesBetweenEnqueueAndMarkTheJobCommitsOnce(t *testing.T) {
	t.Parallel()
	e := newEnqueueEnv(t)
	var runs atomic.Int64
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs), Relay: outbox.Config{PollInterval: 50 * time.Millisecond}})
	res := e.enqueueInTx(c, refundArgs{OrderID: "o-crash", AmountCents: 100}, nil, true)

	const lease = 2 * time.Second
	if _, err := relayPass(t, e, c, killedBeforeMark{pgoutbox.New(e.pool)}, outbox.Config{Name: "dying", Lease: lease}); err == nil {
		t.Fatal("the dying relay's pass reported no error")
	}
	if got := e.stream(); len(got) != 1 || e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL AND claimed_by = 'dying'`) != 1 {
		t.Fatalf("after the kill: stream %v; want the job enqueued and its row unmarked", got)
	}
	runClient(t, c)
	testenv.WaitFor(t, 30*time.Second, "the second enqueue, both deliveries and the row marked sent", func() bool {
		return e.added() == 2 && runs.Load() == 2 && e.pending() == 0 &&
			e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL`, onceflow.TopicEnqueue) == 1
	})
	e.onlyJob(res.JobID)
	if c, r, o := e.effects(res.JobID); c != 1 || r != 1 || o != 2 {
		t.Fatalf("completions %d, refunds %d, effects %d; want 1, 1, 2", c, r, o)
	}
}

// How long EnqueueTx's job waits for the relay: about its PollInterval.
func TestEnqueueTxLatency(t *testing.T) {
	t.Parallel()
	e := newEnqueueEnv(t)
	var mu sync.Mutex
	started := map[string]time.Time{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[refundArgs](func(_ context.Context, j *onceflow.Job[refundArgs]) error {
		mu.Lock()
		started[j.ID] = time.Now()
		mu.Unlock()
		return nil
	}))
	c := e.client(onceflow.Config{Workers: ws}) // default PollInterval, 250ms
	runClient(t, c)
	const n = 8
	var total, worst time.Duration
	for i := range n {
		time.Sleep(time.Duration(37*i%100) * time.Millisecond) // spread over the poll cycle
		committed := time.Now()
		res := e.enqueueInTx(c, refundArgs{OrderID: "o-lat", AmountCents: 1}, nil, true)
		var at time.Time
		testenv.WaitFor(t, 10*time.Second, "the job to start", func() bool {
			mu.Lock()
			defer mu.Unlock()
			at = started[res.JobID]
			return !at.IsZero()
		})
		d := at.Sub(committed)
		total += d
		worst = max(worst, d)
	}
	t.Logf("EnqueueTx commit to worker start, relay PollInterval %v: mean %v, worst %v over %d jobs",
		outbox.DefaultPollInterval, (total / n).Round(time.Millisecond), worst.Round(time.Millisecond), n)
}

// EnqueueTx with a caller-chosen job id that another tenant's EnqueueTx already wrote is
// refused with ErrJobIDTaken, as Enqueue refuses it (the outbox row's dedupe key is
// scoped by tenant): the second tenant's job is never silently dropped while its caller
// is told it was enqueued.
func TestEnqueueTxRefusesAnotherTenantsJobID(t *testing.T) {
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
// that job's index expires. The relay settles the row at once as permanent (as it does
// a reused key), after one pass, rather than retrying it MaxAttempts times.
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

// Redis is down when EnqueueTx's transaction commits, for longer than the relay's
// MaxAttempts sends: every send of the outbox row fails, as Unavailable, without
// counting an attempt, and once Redis is back the relay enqueues the job, which runs
// once. The row is sent, never exhausted.
func TestRedisOutageNeverExhaustsEnqueueTx(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := onceflow.NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	pool, _ := testenv.Postgres(t)
	e := &dbEnv{t: t, pool: pool, rdb: rdb, prefix: testenv.Prefix(t)}
	e.exec(`CREATE TABLE orders (id text PRIMARY KEY)`)
	e.exec(`CREATE TABLE refunds (job_id text PRIMARY KEY, order_id text NOT NULL, amount_cents integer NOT NULL)`)
	var runs atomic.Int64
	reg := prometheus.NewRegistry()
	const maxAttempts = 2
	c := e.client(onceflow.Config{Workers: refundWorkers(&runs), Registerer: reg, Relay: outbox.Config{
		MaxAttempts: maxAttempts, BackoffBase: 20 * time.Millisecond, BackoffCap: 100 * time.Millisecond,
		PollInterval: 20 * time.Millisecond,
	}})
	runClient(t, c)

	srv.Stop()
	res := e.enqueueInTx(c, refundArgs{OrderID: "o-outage", AmountCents: 100}, nil, true)
	// More failed sends than MaxAttempts (or, on the broken code, the exhaustion that
	// ends them).
	failures := func() float64 {
		return metricValue(t, reg, "onceflow_outbox_send_failures_total", nil)
	}
	testenv.WaitFor(t, 90*time.Second, "failed sends during the outage", func() bool {
		return failures() >= 3*maxAttempts || e.count(`SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`) > 0
	})
	if n := e.count(`SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`); n != 0 {
		t.Fatalf("the enqueue row was exhausted during the outage, after %v failed sends", failures())
	}
	if n := e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND attempts = 0 AND sent_at IS NULL`, onceflow.TopicEnqueue); n != 1 {
		t.Fatal("during the outage: want the enqueue row unsent with no attempt counted")
	}
	during := failures()
	srv.Start()

	// The relay marks the enqueue row sent after the enqueue: the job may run and commit
	// in between, so the wait covers the mark too.
	testenv.WaitFor(t, 90*time.Second, "the job's commit after the outage, and its enqueue row marked sent", func() bool {
		n, _, _ := e.effects(res.JobID)
		return n == 1 && e.pending() == 0 &&
			e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL`, onceflow.TopicEnqueue) == 1
	})
	if got := metricValue(t, reg, "onceflow_outbox_send_failures_total", map[string]string{"class": "unavailable"}); got < during {
		t.Errorf("send_failures_total{class=unavailable} %v, want the %v failures of the outage", got, during)
	}
	completions, refunds, effects := e.effects(res.JobID)
	sent := e.count(`SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL AND exhausted_at IS NULL`, onceflow.TopicEnqueue)
	if completions != 1 || refunds != 1 || effects != 2 || sent != 1 || runs.Load() != 1 || e.added() != 1 {
		t.Fatalf("after the outage: %d completions, %d refunds, %d effects, %d enqueue rows sent, %d runs, %d entries added; want 1, 1, 2, 1, 1, 1",
			completions, refunds, effects, sent, runs.Load(), e.added())
	}
	t.Logf("%v failed sends during the outage", during)
}

// A job a Worker enqueues in a transaction of its own may carry its model step's
// answer, as one it enqueues with Enqueue: EnqueueTx from the Worker records the answer
// first, so that the job cannot exist (once tx commits) while the answer it carries
// reads in flight and a worker killed before its Commit loses it.
func TestEnqueueTxFromAWorkerRecordsTheStepsAnswerFirst(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	after := make(chan answerOutcome, 1)
	var e *modelEnv
	e = newModelEnv(t, fakeserver.Config{}, onceflow.Config{DB: pool}, func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
		if j.Args.Text != "My invoice was charged twice." {
			return nil
		}
		st, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
		if err != nil {
			return err
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := e.client.EnqueueTx(ctx, tx, supportArgs{Text: "child: " + st.Response.Content}, &onceflow.EnqueueOpts{Key: "child-of-" + j.ID}); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		select {
		case after <- answerOutcome{state: answerState(t, pool, st.Key)}:
		default:
		}
		return j.Commit(ctx, nil)
	})
	e.start()
	e.enqueue("My invoice was charged twice.")
	if o := awaitOutcome(t, after, 30*time.Second, "EnqueueTx"); o.state != "succeeded" {
		t.Fatalf("a job enqueued with EnqueueTx carrying the step's answer committed while the answer reads %q; want succeeded", o.state)
	}
}
