package limiter_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
)

// State shows a model's configured limits, what its buckets hold now, its permits in
// flight and the fleet's pause.
func TestStateShowsBucketsInFlightAndPause(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Provider: "openai", Models: map[string]limiter.Limits{"gpt-4.1-mini": {RPM: 60, TPM: 100000, Concurrency: 4}}})
	ctx := context.Background()
	if got := l.Models(); !slices.Equal(got, []string{"gpt-4.1-mini"}) {
		t.Fatalf("models: %v", got)
	}
	p, err := l.Acquire(ctx, limiter.Call{Model: "gpt-4.1-mini", InputTokens: 500, OutputTokens: 500})
	if err != nil {
		t.Fatal(err)
	}
	st, err := l.State(ctx, "gpt-4.1-mini")
	if err != nil || len(st) != 1 {
		t.Fatal(st, err)
	}
	s := st[0]
	if s.Configured.RPM != 60 || s.InFlight != 1 || s.RequestsLeft < 58 || s.RequestsLeft > 59 || s.TokensLeft < 98000 || s.TokensLeft > 99100 || !s.PausedUntil.IsZero() {
		t.Fatalf("after one admission: %+v", s)
	}
	p.Done(limiter.Result{Sent: true})
	// A pause the fleet shares, as a 429 sets it.
	if err := rdb.HSet(ctx, l.Keys().Model("openai/gpt-4.1-mini"), "pause", time.Now().Add(time.Minute).UnixMilli(), "why", "429 from the provider").Err(); err != nil {
		t.Fatal(err)
	}
	st, _ = l.State(ctx, "gpt-4.1-mini", "never-called")
	if st[0].InFlight != 0 || st[0].Why != "429 from the provider" || time.Until(st[0].PausedUntil) < 50*time.Second {
		t.Fatalf("paused: %+v", st[0])
	}
	if st[1].RequestsLeft != -1 || st[1].InFlight != 0 {
		t.Fatalf("a model never called: %+v", st[1])
	}
}
