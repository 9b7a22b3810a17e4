package ledger

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

func TestCallAloneDoesNotLinger(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	l, err := New(pool, Config{GroupLinger: MaxGroupLinger, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	call := func(work string) Call { return Call{Key: "k-" + work, Work: work, RequestHash: "h"} }

	waitIdle(t, l.inserts)
	first, _, err := l.Begin(ctx, call("job-1/s"))
	if err != nil {
		t.Fatal(err)
	}
	if n := l.inserts.lingered.Load(); n != 0 {
		t.Fatalf("a call alone lingered %d times", n)
	}
	if _, _, err := first.Succeed(ctx, Result{}); err != nil {
		t.Fatal(err)
	}
	if n := l.answers.lingered.Load(); n != 0 {
		t.Fatalf("the answer of a call alone lingered %d times", n)
	}

	// With another call in progress, a write waits for it to join.
	other, _, err := l.Begin(ctx, call("job-2/s"))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Fail(ctx, nil, false)
	waitIdle(t, l.inserts) // else the runner of other's write takes the next one, lingering for nothing
	if _, _, err := l.Begin(ctx, call("job-3/s")); err != nil {
		t.Fatal(err)
	}
	if n := l.inserts.lingered.Load(); n != 1 {
		t.Fatalf("a call beside another in progress lingered %d times, want 1", n)
	}
}

// waitIdle waits until no runner of g is in flight: a write then starts one of its own.
func waitIdle(t *testing.T, g *group) {
	t.Helper()
	testenv.WaitFor(t, 5*time.Second, "the group's runner to end", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.running == 0
	})
}
