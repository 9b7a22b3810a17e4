package retry_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// A call that is rate limited once, with Retry-After: 2, then succeeds. The injected
// clock makes the example run without sleeping and shows the delay Do chose.
func ExampleDo() {
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	policy := retry.Policy{
		Clock: clock,
		OnRetry: func(r retry.Retry) {
			fmt.Printf("attempt %d failed (%s); retrying in %v (from Retry-After: %t)\n", r.Attempt, r.Class, r.Delay, r.FromRetryAfter)
		},
	}
	deadline := retry.AfterOn(clock, 60*time.Second) // the whole delivery's budget

	calls := 0
	summary, err := retry.Do(context.Background(), policy, deadline, func(ctx context.Context) (string, error) {
		calls++
		if calls == 1 {
			h := http.Header{"Retry-After": {"2"}}
			return "", retry.NewStatusError(http.StatusTooManyRequests, h, clock.Now())
		}
		return "a short summary", nil
	})
	fmt.Println(summary, err, calls)

	// A 400 is not retried: it would fail the same way every time.
	_, err = retry.Do(context.Background(), policy, deadline, func(ctx context.Context) (string, error) {
		return "", retry.NewStatusError(http.StatusBadRequest, nil, clock.Now())
	})
	var se *retry.StatusError
	fmt.Println(errors.As(err, &se), retry.Classify(err).Class, retry.Transient(err))
	// Output:
	// attempt 1 failed (rate_limited); retrying in 2s (from Retry-After: true)
	// a short summary <nil> 2
	// true client_error false
}
