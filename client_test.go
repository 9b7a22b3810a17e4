package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

type sortArgs struct {
	Strings []string `json:"strings"`
}

func (sortArgs) Kind() string { return "sort" }

type emailArgs struct {
	To string `json:"to"`
}

func (emailArgs) Kind() string { return "email.send" }

// EnqueueOpts sends every email job to its own queue.
func (emailArgs) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "mail"} }

type undeclaredArgs struct{}

func (undeclaredArgs) Kind() string { return "nobody.runs.this" }

// recorder collects what workers saw.
type recorder struct {
	mu   sync.Mutex
	seen []string
}

func (r *recorder) add(s string) {
	r.mu.Lock()
	r.seen = append(r.seen, s)
	r.mu.Unlock()
}

func (r *recorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}

func newClient(t *testing.T, rdb *redis.Client, prefix string, ws *onceflow.Workers, queues map[string]onceflow.QueueConfig) *onceflow.Client {
	t.Helper()
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Queues: queues, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func runClient(t *testing.T, c *onceflow.Client) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

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

// A keyed enqueue is idempotent: the same key and arguments again add nothing and give
// the same job id; other arguments with that key are refused; another tenant's key is
// another job.
func TestKeyedEnqueueIsIdempotent(t *testing.T) {
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
}

// A Worker returning an error from another package's vocabulary is understood: Permanent
// from the retry package dead-letters at once.
func TestWorkerErrorVocabulary(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var runs sync.WaitGroup
	runs.Add(1)
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

func TestNewClientChecksRedisOptions(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	if _, err := onceflow.NewClient(onceflow.Config{Redis: rdb}); !errors.Is(err, onceflow.ErrRedisOptions) {
		t.Fatalf("default go-redis options: %v, want ErrRedisOptions", err)
	}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil }))
	if err := onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error { return nil })); err == nil {
		t.Fatal("a second worker for one kind was accepted")
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

func containsPrefix(ss []string, p string) bool {
	for _, x := range ss {
		if strings.HasPrefix(x, p) {
			return true
		}
	}
	return false
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
