package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Clock is the time source of Do and Deadline. Tests inject one whose Sleep returns at
// once after advancing Now, so backoff never sleeps for real. Implementations must be
// safe for concurrent use when Policies sharing them run concurrently.
type Clock interface {
	// Now returns the current time. Readings from time.Now carry the monotonic clock,
	// which is what Deadline arithmetic uses.
	Now() time.Time
	// Sleep waits for d, or until ctx is done, in which case it returns ctx.Err().
	Sleep(ctx context.Context, d time.Duration) error
}

// SystemClock is the real Clock: time.Now and a timer.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// Sleep waits for d or until ctx is done.
func (SystemClock) Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Rand is the randomness of the jitter: Int64N returns a uniform value in [0, n) for
// n > 0. *math/rand/v2.Rand satisfies it (but is not safe for concurrent use; guard it
// or give each goroutine its own).
type Rand interface {
	Int64N(n int64) int64
}

// globalRand is math/rand/v2's top-level source, safe for concurrent use.
type globalRand struct{}

func (globalRand) Int64N(n int64) int64 { return rand.Int64N(n) } // #nosec G404 -- backoff jitter, not a secret
