// Package retrytest provides clocks and randomness for testing code that uses package
// retry without sleeping for real.
package retrytest

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/onceflow/onceflow/retry"
)

// Clock is a retry.Clock whose Sleep returns at once and records the duration. In manual
// mode (NewClock) time moves only by Sleep and Advance; in skip mode (NewSkipClock) real
// time passes as usual and every Sleep adds its duration on top, so the time code spends
// working is real while the time it spends waiting is simulated. It is safe for
// concurrent use.
type Clock struct {
	mu      sync.Mutex
	manual  bool
	now     time.Time     // manual mode: the current time
	start   time.Time     // creation time (skip mode: real, monotonic)
	skipped time.Duration // skip mode: total simulated sleep
	sleeps  []time.Duration
}

var _ retry.Clock = (*Clock)(nil)

// NewClock returns a manual Clock starting at start.
func NewClock(start time.Time) *Clock { return &Clock{manual: true, now: start, start: start} }

// NewSkipClock returns a Clock on real time whose sleeps are skipped but counted.
func NewSkipClock() *Clock { return &Clock{start: time.Now()} }

// Now returns the clock's current time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.manual {
		return c.now
	}
	return time.Now().Add(c.skipped)
}

// Sleep records d and advances the clock by it at once; it returns ctx.Err() when ctx is
// already done.
func (c *Clock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sleeps = append(c.sleeps, d)
	c.advance(d)
	return nil
}

// Advance moves the clock forward by d without recording a sleep.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advance(d)
}

func (c *Clock) advance(d time.Duration) {
	if d <= 0 {
		return
	}
	if c.manual {
		c.now = c.now.Add(d)
	} else {
		c.skipped += d
	}
}

// Sleeps returns every duration passed to Sleep, in order.
func (c *Clock) Sleeps() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.sleeps...)
}

// Elapsed returns how far the clock has moved since it was created: in manual mode the
// sleeps and advances, in skip mode real time plus the skipped sleeps.
func (c *Clock) Elapsed() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.manual {
		return c.now.Sub(c.start)
	}
	return time.Since(c.start) + c.skipped
}

// Rand is a seeded, mutex-guarded retry.Rand, so jitter is reproducible.
type Rand struct {
	mu sync.Mutex
	r  *rand.Rand
}

var _ retry.Rand = (*Rand)(nil)

// NewRand returns a Rand seeded with seed.
func NewRand(seed uint64) *Rand {
	return &Rand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))} // #nosec G404 -- seeded jitter for tests
}

// Int64N returns a value in [0, n).
func (r *Rand) Int64N(n int64) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.r.Int64N(n)
}

// Max is a retry.Rand that always draws the top of the range, so full jitter returns its
// upper bound: handy to assert the backoff's cap and growth exactly.
type Max struct{}

// Int64N returns n-1.
func (Max) Int64N(n int64) int64 { return n - 1 }
