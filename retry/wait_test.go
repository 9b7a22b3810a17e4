package retry_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
)

func TestWaitErrorIsNeitherRetriedNorAnOutage(t *testing.T) {
	cause := errors.New("HTTP 429")
	err := fmt.Errorf("model step: %w", &retry.WaitError{Delay: 3 * time.Second, Reason: "rate limit", Err: cause})
	v := retry.Classify(err)
	if v.Class != retry.ClassWaiting || v.Retryable || !v.HasRetryAfter || v.RetryAfter != 3*time.Second {
		t.Fatalf("verdict %+v, want waiting, not retryable, with its delay", v)
	}
	if !retry.Transient(err) || retry.Outage(err) || retry.IsPermanent(err) {
		t.Fatalf("transient %v outage %v permanent %v, want true false false", retry.Transient(err), retry.Outage(err), retry.IsPermanent(err))
	}
	if !errors.Is(err, retry.ErrWaiting) || !errors.Is(err, cause) {
		t.Fatal("a WaitError matches ErrWaiting and unwraps to its cause")
	}
	calls := 0
	_, got := retry.Do(context.Background(), retry.Policy{}, retry.After(time.Minute), func(context.Context) (int, error) {
		calls++
		return 0, err
	})
	if calls != 1 || !errors.Is(got, retry.ErrWaiting) {
		t.Fatalf("Do made %d calls and returned %v, want one call and the wait", calls, got)
	}
}

func TestDeadlineExtendIsSharedByCopiesAndAttempts(t *testing.T) {
	d := retry.After(time.Second)
	copyOf := d
	d.Extend(time.Hour)
	if r := copyOf.Remaining(); r < time.Hour {
		t.Fatalf("a copy's remaining %v after Extend(1h), want over an hour", r)
	}
	var zero retry.Deadline
	zero.Extend(time.Hour) // no effect, no panic
	if !zero.IsZero() {
		t.Fatal("the zero deadline stays unlimited")
	}
	// Code under an attempt extends the Do's deadline: the wait is not charged.
	d = retry.After(2 * time.Second)
	attempts := 0
	_, err := retry.Do(context.Background(), retry.Policy{Base: time.Millisecond, Cap: time.Millisecond, MinAttempt: time.Millisecond, MaxAttempts: 3},
		d, func(ctx context.Context) (int, error) {
			attempts++
			retry.ExtendDeadline(ctx, 10*time.Second)
			return 0, context.DeadlineExceeded
		})
	if attempts != 3 || !errors.As(err, new(*retry.ExhaustedError)) {
		t.Fatalf("attempts %d err %v", attempts, err)
	}
	if r := d.Remaining(); r < 30*time.Second {
		t.Fatalf("remaining %v after three attempts extended it by 10s each, want about 32s", r)
	}
	retry.ExtendDeadline(context.Background(), time.Hour) // no deadline in ctx: nothing
}
