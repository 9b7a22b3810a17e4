package outbox

import "time"

// Backoff returns the delay before the next attempt after failure number attempt
// (1 for the first failure), with full jitter: a uniformly random duration between 0
// and min(cap, base * 2^(attempt-1)), where r in [0, 1) is the random draw. Workers
// that fail together therefore do not retry in lockstep.
func Backoff(attempt int, base, cap time.Duration, r float64) time.Duration {
	if attempt < 1 {
		attempt = 1
	}
	ceiling := cap
	if attempt-1 < 62 {
		if d := base << (attempt - 1); d > 0 && d < cap && d>>(attempt-1) == base {
			ceiling = d
		}
	}
	if r < 0 {
		r = 0
	}
	if r >= 1 {
		r = 0.999999999
	}
	return time.Duration(r * float64(ceiling))
}
