package retry

import (
	"context"
	"math"
	"sync/atomic"
	"time"
)

// Deadline is the time budget of one delivery, across attempts and sleeps. It is read
// on its Clock: with the SystemClock, time.Now readings carry the monotonic clock, so
// wall-clock changes (NTP steps, a laptop waking) neither stretch nor shrink it. The
// zero Deadline has no limit. A Deadline is a value, safe for concurrent use; its copies
// share one extension (Extend).
type Deadline struct {
	at    time.Time
	clock Clock
	ext   *atomic.Int64 // nanoseconds added by Extend
}

// After returns a Deadline budget from now on the system clock.
func After(budget time.Duration) Deadline { return AfterOn(SystemClock{}, budget) }

// AfterOn returns a Deadline budget from clock's now. A nil clock is the SystemClock.
func AfterOn(clock Clock, budget time.Duration) Deadline {
	if clock == nil {
		clock = SystemClock{}
	}
	return Deadline{at: clock.Now().Add(budget), clock: clock, ext: new(atomic.Int64)}
}

// Extend moves the end of d, and of every copy of it, later by by: a wait that must not
// count against the budget (a limiter's wait for capacity). It does nothing to the zero
// Deadline or for a by of zero or less. Safe for concurrent use.
func (d Deadline) Extend(by time.Duration) {
	if d.ext != nil && by > 0 {
		d.ext.Add(int64(by))
	}
}

// end is d's instant with its extensions.
func (d Deadline) end() time.Time {
	if d.ext == nil {
		return d.at
	}
	return d.at.Add(time.Duration(d.ext.Load()))
}

type deadlineKey struct{}

// ExtendDeadline extends (Deadline.Extend) the Deadline of the Do whose attempt ctx
// belongs to, if any: Do gives each attempt's context its Deadline, so code below an
// attempt (a limiter waiting for capacity before the call is made) can keep the wait
// out of the delivery's budget. The attempt's own per-call timeout is not extended.
func ExtendDeadline(ctx context.Context, by time.Duration) {
	if d, ok := ctx.Value(deadlineKey{}).(Deadline); ok {
		d.Extend(by)
	}
}

// IsZero reports whether d has no limit.
func (d Deadline) IsZero() bool { return d.clock == nil }

// At returns the instant the deadline passes, its extensions included; the zero time
// for the zero Deadline.
func (d Deadline) At() time.Time { return d.end() }

// Remaining returns the time left, negative once passed; math.MaxInt64 for the zero
// Deadline.
func (d Deadline) Remaining() time.Duration {
	if d.clock == nil {
		return math.MaxInt64
	}
	return d.end().Sub(d.clock.Now())
}

// Expired reports whether no time is left.
func (d Deadline) Expired() bool { return d.Remaining() <= 0 }
