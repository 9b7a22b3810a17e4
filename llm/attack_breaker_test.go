package llm_test

import (
	"context"
	"iter"
	"testing"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/llm"
)

// gated answers each call with the error it receives on its channel (nil: success), so
// a test decides when and how each call made before a trip ends.
type gated struct {
	entered chan struct{}
	answers chan error
}

func (g *gated) Complete(ctx context.Context, _ *llm.Request) (*llm.Response, error) {
	g.entered <- struct{}{}
	if err := <-g.answers; err != nil {
		return nil, err
	}
	return &llm.Response{Content: "ok"}, nil
}

func (g *gated) Stream(context.Context, *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(func(llm.Chunk, error) bool) {}
}

// When the quota runs out, the calls already in flight (long generations the provider
// accepted before) still complete. Such a success says nothing about the quota now: it
// must not close a breaker that a later quota answer tripped, or every worker resumes
// full concurrency at once and each of its calls meets the exhausted quota, instead of
// one probe per interval.
func TestAttackStaleSuccessDoesNotCloseTheBreaker(t *testing.T) {
	t.Parallel()
	b, err := breaker.New(breaker.Config{Name: "llm", ProbeInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	model := &gated{entered: make(chan struct{}, 2), answers: make(chan error)}
	c := llm.WithBreaker(model, b)
	ctx := context.Background()

	done := make(chan error, 2)
	for range 2 { // both allowed while the breaker is closed
		go func() {
			_, err := c.Complete(ctx, &llm.Request{})
			done <- err
		}()
	}
	// Both calls are in flight (past Allow, at the provider); one ends first with the
	// quota answer.
	for range 2 {
		select {
		case <-model.entered:
		case <-time.After(10 * time.Second):
			t.Fatal("the calls did not reach the model")
		}
	}
	model.answers <- quotaError()
	for deadline := time.Now().Add(10 * time.Second); b.Err() == nil; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a quota answer did not trip the breaker")
		}
	}
	model.answers <- nil // and the other, a long generation started before the trip, completes
	// Which goroutine got which answer does not matter: both calls were allowed while
	// the breaker was closed.
	errs := []error{<-done, <-done}
	if (errs[0] == nil) == (errs[1] == nil) {
		t.Fatalf("answers %v, want one quota error and one success", errs)
	}
	if b.Err() == nil {
		t.Fatal("a call allowed before the trip closed the breaker by succeeding after it; no probe was made")
	}
}
