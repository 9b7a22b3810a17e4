package queue

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// A handler that reports a dependency down (Unavailable) spends no attempt: with
// MaxDeliveries 2, eight such runs each see attempt 1, the job is never dead-lettered,
// and when the dependency is back the next run succeeds and is acknowledged.
func TestUnavailableSpendsNoDelivery(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var down atomic.Bool
	down.Store(true)
	var mu sync.Mutex
	var seen []int64
	var ok atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 2, ClaimIdle: 60 * time.Millisecond, ClaimInterval: 10 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			mu.Lock()
			seen = append(seen, j.Deliveries)
			n := len(seen)
			mu.Unlock()
			if down.Load() {
				if n >= 8 {
					down.Store(false)
				}
				return Unavailable(errors.New("model provider: quota exhausted"))
			}
			ok.Add(1)
			return nil
		})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 20*time.Second, "the job to succeed", func() bool { return ok.Load() == 1 })
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	if d := deadLetters(t, rdb, keys); len(d) != 0 {
		t.Fatalf("dead letters %+v, want none", d)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 9 || slices.ContainsFunc(seen, func(d int64) bool { return d != 1 }) {
		t.Fatalf("deliveries seen = %v, want nine runs, each delivery 1", seen)
	}
}

// A plain error still spends deliveries, as before.
func TestUnavailableIsNotPlainError(t *testing.T) {
	if errors.Is(errors.New("x"), ErrUnavailable) || !errors.Is(Unavailable(errors.New("x")), ErrUnavailable) {
		t.Fatal("ErrUnavailable matching")
	}
	inner := errors.New("inner")
	if err := Unavailable(inner); !errors.Is(err, inner) || err.Error() != "inner" || Unavailable(nil) != nil {
		t.Fatalf("Unavailable(inner) = %v", err)
	}
}

// gate is a Gate that blocks while closed and admits limit jobs per Admit otherwise.
type gate struct {
	mu     sync.Mutex
	open   chan struct{}
	limit  int
	admits atomic.Int32
}

func (g *gate) Admit(ctx context.Context) (int, error) {
	g.mu.Lock()
	open := g.open
	g.mu.Unlock()
	select {
	case <-open:
		g.admits.Add(1)
		return g.limit, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// While the Gate blocks, the worker takes no job, new or reclaimable; once it admits
// with a limit of 1, the worker runs the backlog at most one job per Admit.
func TestGateHoldsBackAndLimits(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	g := &gate{open: make(chan struct{}), limit: 1}
	var done atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Gate: g, Concurrency: 8,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			done.Add(1)
			return nil
		})})
	for i := range 6 {
		enqueue(t, rdb, keys, message(i, nil))
	}
	time.Sleep(300 * time.Millisecond)
	if n := done.Load(); n != 0 {
		t.Fatalf("%d jobs ran while the gate was closed", n)
	}
	if p := pendingIDs(t, rdb, keys, DefaultGroup); len(p) != 0 {
		t.Fatalf("the worker read %d entries while the gate was closed", len(p))
	}
	close(g.open)
	testenv.WaitFor(t, 10*time.Second, "the backlog", func() bool { return done.Load() == 6 })
	// Each Admit let one job through: six jobs took at least six admits.
	if a := g.admits.Load(); a < 6 {
		t.Fatalf("%d admits for 6 jobs with a limit of 1", a)
	}
	w.stop(t)
}
