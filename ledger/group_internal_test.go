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

// A group takes writes of distinct keys, at most max of them and at most maxGroupBytes
// of arguments (its first write whatever its size); the others wait, in their order, for
// the next group.
func TestTakeLeavesDuplicateKeysAndWhatPassesTheBoundsForTheNextGroup(t *testing.T) {
	big := string(make([]byte, maxGroupBytes/2+1))
	write := func(key string, args ...any) *groupWrite {
		return &groupWrite{key: key, args: args, size: argBytes(args)}
	}
	g := &group{max: 3, running: 1}
	g.queue = []*groupWrite{write("a", "x"), write("a", "y"), write("b", big), write("c", big), write("d", []byte("z")), write("e")}
	keys := func(ws []*groupWrite) (s string) {
		for _, w := range ws {
			s += w.key
		}
		return s
	}
	if got := keys(g.take()); got != "abd" {
		t.Fatalf("first group %q, want abd (a's second write, and c past the bytes bound, wait)", got)
	}
	if got := keys(g.queue); got != "ace" {
		t.Fatalf("left queued %q, want ace in their order", got)
	}
	if got := keys(g.take()); got != "ace" {
		t.Fatalf("second group %q, want ace", got)
	}
	g.queue = []*groupWrite{write("f", big, big)}
	if got := keys(g.take()); got != "f" {
		t.Fatalf("a write over the bound alone: group %q, want f", got)
	}
	if g.take() != nil || g.running != 0 {
		t.Fatalf("an empty queue: want no group and the runner ended (running %d)", g.running)
	}
}
