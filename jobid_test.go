package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
)

// Two tenants that choose the same job id: the second's enqueue is refused with
// ErrJobIDTaken, with or without a key, and nothing of it is written; the first keeps its
// job (its index and its state); the owner may enqueue its id again.
func TestCallerJobIDsOfTwoTenantsDoNotCollide(t *testing.T) {
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
}

// After the first job's index expired, another tenant's (or kind's) job with the same
// id is enqueued, but its Commit finds the first job's completion record: it fails
// permanently with ErrJobIDTaken (so it is dead-lettered with the reason) instead of
// being taken as done, and writes nothing; the reason names neither the other tenant
// nor its kind. A redelivery of the first job is still done.
func TestCommitOfAnIDCompletedByAnotherJobIsRefused(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	var runs atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, refundWorker(&runs))
	onceflow.AddWorker(ws, onceflow.WorkFunc[refundTxArgs](func(ctx context.Context, j *onceflow.Job[refundTxArgs]) error {
		return j.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
			c.Exec(`INSERT INTO refunds (job_id, order_id, amount_cents) VALUES ($1, $2, $3)`, j.ID+"/tx", j.Args.OrderID, j.Args.AmountCents)
			return nil
		})
	}))
	c := e.client(onceflow.Config{Workers: ws})
	h := c.Inspector().Handler(onceflow.DefaultQueue)
	run := func(kind, tenant string, args any, entry string) error {
		payload, _ := json.Marshal(args)
		return h.Handle(context.Background(), &queue.Job{
			Message: queue.Message{JobID: "order-1", Kind: kind, Tenant: tenant, Payload: payload, EnqueuedAt: time.Now()},
			ID:      entry, Deliveries: 1,
		})
	}
	args := refundArgs{OrderID: "o-1", AmountCents: 100}
	if err := run(args.Kind(), "acme", args, "1-0"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, kind, tenant string
		args               any
	}{
		{"Commit, another tenant", args.Kind(), "globex", refundArgs{OrderID: "o-2", AmountCents: 5}},
		{"Commit, no tenant", args.Kind(), "", refundArgs{OrderID: "o-2", AmountCents: 5}},
		{"CommitTx, another kind", refundTxArgs{}.Kind(), "acme", refundTxArgs{OrderID: "o-3", AmountCents: 7}},
	} {
		err := run(tc.kind, tc.tenant, tc.args, "2-0")
		if !errors.Is(err, onceflow.ErrJobIDTaken) || !onceflow.IsPermanent(err) {
			t.Fatalf("%s: %v, want a permanent ErrJobIDTaken", tc.name, err)
		}
		if msg := err.Error(); containsAny(msg, "acme", "refund.issue") {
			t.Fatalf("%s: the reason %q names the other job's tenant or kind", tc.name, msg)
		}
	}
	if err := run(args.Kind(), "acme", args, "3-0"); err != nil {
		t.Fatalf("a redelivery of acme's own job: %v, want done", err)
	}
	if n := e.count(`SELECT count(*) FROM refunds`); n != 1 || runs.Load() != 4 {
		t.Fatalf("%d refunds after %d runs, want acme's one", n, runs.Load())
	}
	if c, _, o := e.effects("order-1"); c != 1 || o != 2 {
		t.Fatalf("completions %d, effects %d; want acme's 1 and 2", c, o)
	}
}

// refundTxArgs is a second kind committing with CommitTx.
type refundTxArgs struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
}

func (refundTxArgs) Kind() string { return "refund.tx" }

// containsAny reports whether s contains any of subs.
func containsAny(s string, subs ...string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}
