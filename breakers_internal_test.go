package onceflow

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/retry"
)

// Only the provider's own failures count towards the llm breaker's run: not the
// ledger's (PostgreSQL answers 503 to package retry), not the job's, not shutdown.
func TestProviderFailure(t *testing.T) {
	t.Parallel()
	status := func(code int) error { return retry.NewStatusError(code, nil, time.Now()) }
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"503 after the attempts", &retry.ExhaustedError{Attempts: 2, Err: status(503)}, true},
		{"429 after the attempts", &retry.ExhaustedError{Attempts: 2, Err: status(429)}, true},
		{"timeout at the delivery deadline", &retry.DeadlineExceededError{Attempts: 1, Err: &retry.AttemptTimeoutError{Limit: time.Second, Err: context.DeadlineExceeded}}, true},
		{"the deadline before any call", &retry.DeadlineExceededError{}, false},
		{"a 400", status(400), false},
		{"the ledger's PostgreSQL", &retry.ExhaustedError{Attempts: 2, Err: errors.Join(ledger.ErrUnavailable, status(503))}, false},
		{"a call in flight elsewhere", &retry.ExhaustedError{Attempts: 2, Err: fmt.Errorf("%w", ledger.ErrInFlight)}, false},
		{"shutdown", fmt.Errorf("retry: stopped after 1 attempts: %w (last error: %w)", context.Canceled, status(503)), false},
		{"an open breaker", &breaker.OpenError{Name: "llm"}, false},
		{"nil", nil, false},
	} {
		if got := providerFailure(tc.err); got != tc.want {
			t.Errorf("%s: providerFailure(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

// Of many jobs whose model calls fail at once right after a call that worked (a provider
// that drops every connection together), exactly one spends a delivery: whether a run
// of failures is under way is decided as each failure is counted, not read before.
func TestConcurrentProviderFailuresSpendOneDelivery(t *testing.T) {
	t.Parallel()
	failure := &retry.ExhaustedError{Attempts: 2, Err: retry.NewStatusError(503, nil, time.Now())}
	for range 2000 {
		b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 1000})
		if err != nil {
			t.Fatal(err)
		}
		m := &model{breaker: b}
		const jobs = 16
		var spent atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range jobs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if !retry.Outage(m.callError("summarise", failure, time.Now())) {
					spent.Add(1)
				}
			}()
		}
		close(start)
		wg.Wait()
		if n := spent.Load(); n != 1 {
			t.Fatalf("%d of %d concurrent failures after a success spent a delivery, want 1", n, jobs)
		}
	}
}

// A model call sent during an outage whose failure comes back after other calls worked
// again is the outage's: it spends no delivery. A call sent before the outage began, or
// after it ended, that fails spends one: a job whose own input fails beside a flaky
// provider's short runs is still dead-lettered.
func TestProviderFailureOfACallSentDuringAnOutageSpendsNoDeliveryAfterIt(t *testing.T) {
	failure := &retry.ExhaustedError{Attempts: 2, Err: retry.NewStatusError(503, nil, time.Now())}
	b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 1000})
	if err != nil {
		t.Fatal(err)
	}
	m := &model{breaker: b}
	before := time.Now()
	time.Sleep(time.Millisecond)
	if retry.Outage(m.callError("summarise", failure, time.Now())) {
		t.Fatal("the failure that starts a run spent no delivery")
	}
	time.Sleep(time.Millisecond)
	sent := time.Now()
	time.Sleep(time.Millisecond)
	b.Success() // another job's call: the provider is back
	if err := m.callError("summarise", failure, sent); !retry.Outage(err) {
		t.Fatalf("a call sent during the outage, failing after it: %v, want the outage's (no delivery spent)", err)
	}
	if retry.Outage(m.callError("summarise", failure, before)) {
		t.Fatal("a call sent before the outage began that failed after it ended spent no delivery")
	}
	b.Success()
	time.Sleep(time.Millisecond)
	if retry.Outage(m.callError("summarise", failure, time.Now())) {
		t.Fatal("a call sent after the outage ended that failed spent no delivery")
	}
}
