package openai_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
)

// BenchmarkComplete measures one model call against in-process fake-llm over
// loopback HTTP, made directly (the baseline) and through retry.Do (per-call context
// deadline, classification hooks). The ratio of the two is the cost of the retry
// layer on the happy path; docs/BENCHMARKS.md reports it.
func BenchmarkComplete(b *testing.B) {
	s, err := fakeserver.New(fakeserver.Config{})
	if err != nil {
		b.Fatal(err)
	}
	ts := httptest.NewServer(s)
	b.Cleanup(func() { s.Close(); ts.Close() })
	c := newClient(ts.URL, nil)
	ctx := context.Background()
	req := &llm.Request{
		Messages:  []llm.Message{{Role: llm.RoleUser, Content: "Summarise for the account team:\n\nThe March invoice was charged twice."}},
		MaxTokens: 200,
	}
	b.Run("direct", func(b *testing.B) {
		for b.Loop() {
			if _, err := c.Complete(ctx, req); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("retry.Do", func(b *testing.B) {
		p := retry.Policy{}
		for b.Loop() {
			if _, err := retry.Do(ctx, p, retry.After(time.Minute), func(ctx context.Context) (*llm.Response, error) {
				return c.Complete(ctx, req)
			}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkClassify measures classifying a mapped provider error and a wrapped
// network error, the work done once per failed attempt.
func BenchmarkClassify(b *testing.B) {
	apiErr := fmt.Errorf("summarise: %w", llm.NewAPIError("openai", 429, nil,
		[]byte(`{"error":{"message":"slow down","type":"requests","code":"rate_limit_exceeded"}}`), time.Now(), nil))
	netErr := fmt.Errorf("post: %w", errors.New("read tcp 127.0.0.1:1->127.0.0.1:2: connection reset by peer"))
	for name, err := range map[string]error{"api_error": apiErr, "unknown": netErr} {
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				_ = retry.Classify(err)
			}
		})
	}
}
