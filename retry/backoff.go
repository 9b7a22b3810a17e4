package retry

import (
	"math"
	"time"
)

// FullJitter returns the sleep before retry number n (0 for the first retry): a uniformly
// random duration in [0, min(cap, base·2ⁿ)], both ends included. Spreading retries over
// the whole interval, instead of around its end, keeps clients that failed together
// from retrying together. Non-positive base or cap give 0; a nil r uses math/rand/v2.
func FullJitter(r Rand, base, cap time.Duration, n int) time.Duration {
	if base <= 0 || cap <= 0 {
		return 0
	}
	if r == nil {
		r = globalRand{}
	}
	upper := cap
	if n < 62 && base <= cap>>uint(n) { // base·2ⁿ ≤ cap without overflow
		upper = base << uint(n)
	}
	if upper == math.MaxInt64 {
		return time.Duration(r.Int64N(int64(upper)))
	}
	return time.Duration(r.Int64N(int64(upper) + 1))
}
