package onceflow

import (
	"context"
	"errors"
	"fmt"
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
