package retry

import (
	"math"
	"time"
)

// Deadline is the time budget of one delivery, across attempts and sleeps. It is read
// on its Clock: with the SystemClock, time.Now readings carry the monotonic clock, so
// wall-clock changes (NTP steps, a laptop waking) neither stretch nor shrink it. The
// zero Deadline has no limit. A Deadline is a value, safe for concurrent use.
type Deadline struct {
	at    time.Time
	clock Clock
}

// After returns a Deadline budget from now on the system clock.
func After(budget time.Duration) Deadline { return AfterOn(SystemClock{}, budget) }

// AfterOn returns a Deadline budget from clock's now. A nil clock is the SystemClock.
func AfterOn(clock Clock, budget time.Duration) Deadline {
	if clock == nil {
		clock = SystemClock{}
	}
	return Deadline{at: clock.Now().Add(budget), clock: clock}
}

// IsZero reports whether d has no limit.
func (d Deadline) IsZero() bool { return d.clock == nil }

// At returns the instant the deadline passes; the zero time for the zero Deadline.
func (d Deadline) At() time.Time { return d.at }

// Remaining returns the time left, negative once passed; math.MaxInt64 for the zero
// Deadline.
func (d Deadline) Remaining() time.Duration {
	if d.clock == nil {
		return math.MaxInt64
	}
	return d.at.Sub(d.clock.Now())
}

// Expired reports whether no time is left.
func (d Deadline) Expired() bool { return d.Remaining() <= 0 }
