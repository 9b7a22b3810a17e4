package outbox

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestClassOfSortsFailuresIntoPermanentTimeoutRetryableAndUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	expired, cancel := context.WithTimeout(ctx, -time.Second)
	defer cancel()
	for _, c := range []struct {
		ctx  context.Context
		err  error
		want string
	}{
		{ctx, Permanent(errors.New("400")), classPermanent},
		{ctx, fmt.Errorf("post: %w", context.DeadlineExceeded), classTimeout},
		{expired, errors.New("anything after the deadline"), classTimeout},
		{ctx, errors.New("503"), classRetryable},
		{ctx, fmt.Errorf("enqueue: %w", Unavailable(errors.New("connection refused"))), classUnavailable},
		{expired, Unavailable(context.DeadlineExceeded), classUnavailable},
		{ctx, Permanent(Unavailable(errors.New("both"))), classPermanent},
	} {
		if got := classOf(c.ctx, c.err); got != c.want {
			t.Errorf("classOf(%v) = %s, want %s", c.err, got, c.want)
		}
	}
}

// The delay of a send that met an outage grows with the outage's age, between the
// backoff's base and cap, per topic, and starts again once a send of the topic
// succeeded.
func TestOutageDelayGrowsWithTheOutage(t *testing.T) {
	t.Parallel()
	const base, most = time.Second, time.Minute
	var o outages
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	upper := func(topic string, at time.Duration) time.Duration {
		var worst time.Duration
		for range 2000 {
			d := o.delay(topic, start.Add(at), base, most)
			if d < 0 {
				t.Fatalf("negative delay %v", d)
			}
			worst = max(worst, d)
		}
		return worst
	}
	for _, c := range []struct {
		at, lo, hi time.Duration
	}{
		{0, base / 2, base}, // the first failure: up to base
		{10 * time.Second, 5 * time.Second, 10 * time.Second},
		{30 * time.Second, 15 * time.Second, 30 * time.Second},
		{time.Hour, most / 2, most}, // capped
	} {
		if got := upper("a", c.at); got < c.lo || got > c.hi {
			t.Errorf("%v into the outage: longest delay %v, want in [%v, %v]", c.at, got, c.lo, c.hi)
		}
	}
	if got := upper("b", time.Hour); got > base {
		t.Errorf("another topic's first failure: delay up to %v, want at most base %v", got, base)
	}
	o.over("a")
	if got := upper("a", 2*time.Hour); got > base {
		t.Errorf("after a success: delay up to %v, want the outage to start again at base %v", got, base)
	}
}
