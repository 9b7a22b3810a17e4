package queue

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/retry"
)

// One permanent marker: a handler returning retry.Permanent (as the model-call helpers
// do) is dead-lettered after one run, like one returning queue.Permanent, not redelivered
// until MaxDeliveries.
func TestRetryPermanentDeadLettersAtOnce(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var runs atomic.Int32
	start(t, WorkerConfig{Redis: rdb, Keys: keys, MaxDeliveries: 5, ClaimIdle: 100 * time.Millisecond, ClaimInterval: 10 * time.Millisecond,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			runs.Add(1)
			return fmt.Errorf("model: %w", retry.Permanent(errors.New("HTTP 400 context_length_exceeded")))
		})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(deadLetters(t, rdb, keys)) == 1 })
	time.Sleep(300 * time.Millisecond)
	if n := runs.Load(); n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
	if d := deadLetters(t, rdb, keys)[0]; d.Reason != "permanent: model: HTTP 400 context_length_exceeded" {
		t.Fatalf("reason %q", d.Reason)
	}
	if !errors.Is(Permanent(errors.New("x")), retry.ErrPermanent) || ErrPermanent != retry.ErrPermanent || ErrUnavailable != retry.ErrUnavailable {
		t.Fatal("queue's markers are not retry's")
	}
}

// A handler asking to run again after a delay shorter than ClaimIdle is reclaimed after
// about that delay, not after ClaimIdle, and the run counts as a delivery.
func TestRetryAfterShortensTheWait(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	var mu sync.Mutex
	var at []time.Time
	var seen []int64
	const claimIdle = 5 * time.Second
	start(t, WorkerConfig{Redis: rdb, Keys: keys, ClaimIdle: claimIdle, ClaimInterval: 20 * time.Millisecond,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			mu.Lock()
			defer mu.Unlock()
			at = append(at, time.Now())
			seen = append(seen, j.Deliveries)
			if len(at) == 1 {
				return retry.RetryAfter(200*time.Millisecond, errors.New("downstream in maintenance"))
			}
			return nil
		})})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 4*time.Second, "the second run, well before ClaimIdle", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(at) == 2
	})
	mu.Lock()
	defer mu.Unlock()
	if gap := at[1].Sub(at[0]); gap < 150*time.Millisecond {
		t.Fatalf("run again after %v, want about the 200ms asked for", gap)
	}
	if seen[0] != 1 || seen[1] != 2 {
		t.Fatalf("deliveries %v, want 1 then 2", seen)
	}
}
