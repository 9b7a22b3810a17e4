package llm_test

import (
	"context"
	"errors"
	"iter"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// scripted is a model client that answers with err (nil: a response) and counts calls.
type scripted struct {
	calls atomic.Int64
	err   atomic.Pointer[error]
}

func (s *scripted) answer() error {
	s.calls.Add(1)
	if e := s.err.Load(); e != nil {
		return *e
	}
	return nil
}

func (s *scripted) set(err error) { s.err.Store(&err) }

func (s *scripted) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	if err := s.answer(); err != nil {
		return nil, err
	}
	return &llm.Response{Content: "ok"}, nil
}

func (s *scripted) Stream(context.Context, *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		if err := s.answer(); err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if yield(llm.Chunk{Content: "o"}, nil) {
			yield(llm.Chunk{Done: true, FinishReason: "stop"}, nil)
		}
	}
}

// replayer is a layer below WithBreaker that, while replay is set, answers from a
// record (MarkReplayed) instead of calling next.
type replayer struct {
	next   llm.Client
	replay atomic.Bool
}

func (r *replayer) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	if r.replay.Load() {
		llm.MarkReplayed(ctx)
		return &llm.Response{Content: "recorded"}, nil
	}
	return r.next.Complete(ctx, req)
}

func (r *replayer) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	if r.replay.Load() {
		return func(yield func(llm.Chunk, error) bool) {
			llm.MarkReplayed(ctx)
			yield(llm.Chunk{Done: true, Content: "recorded"}, nil)
		}
	}
	return r.next.Stream(ctx, req)
}

func quotaError() error {
	h := http.Header{}
	return llm.NewAPIError("openai", http.StatusTooManyRequests, h,
		[]byte(`{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}`), time.Now(), nil)
}

// WithBreaker stops a model's calls while the provider's quota is out, and lets one probe find out when it is back.
func TestWithBreakerStopsCallsWhileTheQuotaIsOut(t *testing.T) {
	t.Parallel()
	// An answer a layer below replays from a record (MarkReplayed: the ledger) reaches no
	// provider: it does not end a run of failures, and it does not close an open breaker
	// when it took the probe's ticket, which goes back for the next call to probe.
	t.Run("a replayed answer says nothing of the provider", func(t *testing.T) {
		t.Parallel()
		b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 2, ProbeInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		model := &scripted{}
		replaying := &replayer{next: model}
		c := llm.WithBreaker(replaying, b)
		ctx := context.Background()
		b.Failure(errors.New("503"))
		replaying.replay.Store(true)
		if _, err := c.Complete(ctx, &llm.Request{}); err != nil {
			t.Fatal(err)
		}
		for _, err := range c.Stream(ctx, &llm.Request{}) {
			if err != nil {
				t.Fatal(err)
			}
		}
		if b.Failing() != 1 {
			t.Fatalf("a replayed answer ended the run of failures (%d)", b.Failing())
		}
		if !b.Failure(errors.New("503")) {
			t.Fatal("the second failure in a row did not open the breaker")
		}
		time.Sleep(60 * time.Millisecond) // the probe is due
		if _, err := c.Complete(ctx, &llm.Request{}); err != nil {
			t.Fatal(err)
		}
		if b.Err() == nil {
			t.Fatal("a replayed answer that took the probe closed the breaker")
		}
		replaying.replay.Store(false)
		if _, err := c.Complete(ctx, &llm.Request{}); err != nil {
			t.Fatalf("the next call, which should be the probe: %v", err)
		}
		if b.Err() != nil {
			t.Fatal("the probe that reached the provider did not close the breaker")
		}
	})
	// A quota answer trips the breaker: the calls after it never reach the provider and fail
	// with an unavailable error; a probe that succeeds closes it. Other errors do not trip.
	t.Run("stops calls on quota", func(t *testing.T) {
		b, err := breaker.New(breaker.Config{Name: "llm", ProbeInterval: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		model := &scripted{}
		c := llm.WithBreaker(model, b)
		ctx := context.Background()

		model.set(llm.NewAPIError("openai", http.StatusServiceUnavailable, http.Header{}, nil, time.Now(), nil))
		if _, err := c.Complete(ctx, &llm.Request{}); err == nil || b.Err() != nil {
			t.Fatalf("a 503 (%v) tripped the breaker: %v", err, b.Err())
		}
		model.set(quotaError())
		if _, err := c.Complete(ctx, &llm.Request{}); retry.Classify(err).Class != retry.ClassQuota {
			t.Fatalf("first quota answer: %v", err)
		}
		if b.Err() == nil {
			t.Fatal("a quota answer did not trip the breaker")
		}
		before := model.calls.Load()
		for range 10 {
			_, err := c.Complete(ctx, &llm.Request{})
			if !errors.Is(err, retry.ErrUnavailable) {
				t.Fatalf("call while stopped: %v, want unavailable", err)
			}
			for _, err := range c.Stream(ctx, &llm.Request{}) {
				if !errors.Is(err, retry.ErrUnavailable) {
					t.Fatalf("stream while stopped: %v, want unavailable", err)
				}
			}
		}
		if n := model.calls.Load() - before; n != 0 {
			t.Fatalf("%d calls reached the provider while stopped", n)
		}

		model.set(nil) // the quota is back; the next probe finds it
		time.Sleep(150 * time.Millisecond)
		var got []llm.Chunk
		for ch, err := range c.Stream(ctx, &llm.Request{}) {
			if err != nil {
				t.Fatalf("probe stream: %v", err)
			}
			got = append(got, ch)
		}
		if len(got) != 2 || b.Err() != nil {
			t.Fatalf("probe: %d chunks, breaker %v; want a whole stream and a closed breaker", len(got), b.Err())
		}
		if _, err := c.Complete(ctx, &llm.Request{}); err != nil {
			t.Fatalf("after closing: %v", err)
		}
	})
	// When the quota runs out, the calls already in flight (long generations the provider
	// accepted before) still complete. Such a success says nothing about the quota now: it
	// must not close a breaker that a later quota answer tripped, or every worker resumes
	// full concurrency at once and each of its calls meets the exhausted quota, instead of
	// one probe per interval.
	t.Run("a success that began before the trip does not close it", func(t *testing.T) {
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
		testenv.WaitFor(t, 10*time.Second, "the quota answer to trip the breaker", func() bool { return b.Err() != nil })
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
	})
}

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
