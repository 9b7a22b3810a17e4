package limiter_test

import (
	"context"
	"iter"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
)

// panicky is a model client (Config.Model is the user's own llm.Client, or an adapter
// meeting an answer it did not expect) that panics in Complete.
type panicky struct{}

func (panicky) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	panic("adapter bug: nil pointer on an unexpected answer")
}
func (panicky) Stream(context.Context, *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(func(llm.Chunk, error) bool) { panic("adapter bug") }
}

// TestPanickingCallEndsItsPermit: a regression test (attack round 2 of issue 15).
//
// Scenario: the client behind Wrap panics (a bug in a custom llm.Client or an adapter).
// The worker recovers the panic (outcomePanic: the job is retried), but Wrap's client
// never ends the permit: it has no defer. The permit holds the model's concurrency and
// the tenant's cap for its whole lease (2 minutes), and its budget reservation is then
// charged whole, for a call whose fate is unknown. With ONCEFLOW_LLM_CONCURRENCY=1,
// one panic stops the model for the whole fleet for 2 minutes; N panics in a row hold N
// slots.
//
// What should happen: Complete/Stream end the permit in a defer when the call panics
// (as a call sent and lost: Result{Sent: true, Ambiguous: true}), then re-panic.
func TestPanickingCallEndsItsPermit(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{Concurrency: 1}, MaxWait: time.Millisecond})
	c := l.Wrap(panicky{})
	ctx := limiter.WithTenant(context.Background(), "acme")
	func() {
		defer func() { _ = recover() }() // the worker's recover
		_, _ = c.Complete(ctx, &llm.Request{Model: "m", Messages: []llm.Message{{Role: "user", Content: "hi"}}})
	}()
	p, err := l.Acquire(context.Background(), call("acme", "next", 10, 10))
	if err != nil {
		t.Fatalf("after one call panicked (and was recovered), the next call to a model with concurrency 1: %v; it stays blocked for the permit's 2-minute lease", err)
	}
	p.Done(limiter.Result{})
}
