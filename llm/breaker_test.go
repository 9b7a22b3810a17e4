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

func quotaError() error {
	h := http.Header{}
	return llm.NewAPIError("openai", http.StatusTooManyRequests, h,
		[]byte(`{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}`), time.Now(), nil)
}

// A quota answer trips the breaker: the calls after it never reach the provider and fail
// with an unavailable error; a probe that succeeds closes it. Other errors do not trip.
func TestWithBreakerStopsCallsOnQuota(t *testing.T) {
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
}
