package onceflow_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// stream returns the job ids in the default queue's stream, in order.
func (e *dbEnv) stream() []string {
	e.t.Helper()
	entries, err := e.rdb.XRange(context.Background(), queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}.Stream(), "-", "+").Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		e.t.Fatal(err)
	}
	var ids []string
	for _, en := range entries {
		ids = append(ids, en.Values["job_id"].(string))
	}
	return ids
}

// added returns how many entries were ever added to the default queue's stream
// (XINFO STREAM entries-added), which the workers' trimming of acknowledged entries
// does not lower, unlike the stream's length.
func (e *dbEnv) added() int64 {
	e.t.Helper()
	info, err := e.rdb.XInfoStream(context.Background(), queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}.Stream()).Result()
	if err != nil {
		if err.Error() == "ERR no such key" {
			return 0
		}
		e.t.Fatal(err)
	}
	return info.EntriesAdded
}

// onlyJob fails the test unless every entry still in the stream (trimming may have
// removed acknowledged ones) is the job id.
func (e *dbEnv) onlyJob(id string) {
	e.t.Helper()
	for _, got := range e.stream() {
		if got != id {
			e.t.Fatalf("stream holds job %s, want only %s", got, id)
		}
	}
}

// pending returns the default queue's unacknowledged entries.
func (e *dbEnv) pending() int64 {
	e.t.Helper()
	p, err := e.rdb.XPending(context.Background(), queue.Keys{Prefix: e.prefix, Queue: onceflow.DefaultQueue}.Stream(), queue.DefaultGroup).Result()
	if err != nil {
		return -1
	}
	return p.Count
}

// enqueueInTx runs EnqueueTx with the user's own write in one transaction and commits
// it, or rolls it back.
func (e *dbEnv) enqueueInTx(c *onceflow.Client, args refundArgs, opts *onceflow.EnqueueOpts, commit bool) *onceflow.EnqueueResult {
	e.t.Helper()
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1) ON CONFLICT DO NOTHING`, args.OrderID); err != nil {
		e.t.Fatal(err)
	}
	res, err := c.EnqueueTx(ctx, tx, args, opts)
	if err != nil {
		e.t.Fatal(err)
	}
	if commit {
		if err := tx.Commit(ctx); err != nil {
			e.t.Fatal(err)
		}
	}
	return res
}

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
