package retry_test

import (
	"math"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// TestFullJitterStatistics draws many delays for each retry number and checks that they
// stay in [0, min(cap, base·2ⁿ)], are spread over the whole interval (not all equal,
// some in the lowest and some in the highest tenth) and average about half the bound.
func TestFullJitterStatistics(t *testing.T) {
	t.Parallel()
	const base, cap, draws = 500 * time.Millisecond, 8 * time.Second, 20000
	r := retrytest.NewRand(42)
	for n := 0; n < 8; n++ {
		upper := min(cap, base*time.Duration(1<<n))
		var sum float64
		var low, high int
		seen := map[time.Duration]bool{}
		for range draws {
			d := retry.FullJitter(r, base, cap, n)
			if d < 0 || d > upper {
				t.Fatalf("n=%d: delay %v outside [0, %v]", n, d, upper)
			}
			seen[d] = true
			sum += float64(d)
			switch {
			case d < upper/10:
				low++
			case d > upper-upper/10:
				high++
			}
		}
		if len(seen) < draws/2 {
			t.Errorf("n=%d: only %d distinct delays in %d draws", n, len(seen), draws)
		}
		mean := sum / draws / float64(upper)
		if math.Abs(mean-0.5) > 0.03 {
			t.Errorf("n=%d: mean delay %.3f of the bound, want about 0.5", n, mean)
		}
		// Each tenth should get about 10% of the draws; accept 7% to 13%.
		for name, k := range map[string]int{"lowest": low, "highest": high} {
			if f := float64(k) / draws; f < 0.07 || f > 0.13 {
				t.Errorf("n=%d: %.3f of the draws in the %s tenth, want about 0.1", n, f, name)
			}
		}
	}
}

func TestFullJitterBounds(t *testing.T) {
	t.Parallel()
	// The top of the range is exactly min(cap, base·2ⁿ).
	for n, want := range []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 8 * time.Second} {
		if got := retry.FullJitter(retrytest.Max{}, 500*time.Millisecond, 8*time.Second, n); got != want {
			t.Errorf("upper bound for n=%d: %v, want %v", n, got, want)
		}
	}
	// Huge retry numbers and durations do not overflow.
	for _, n := range []int{62, 63, 64, 1000} {
		if got := retry.FullJitter(retrytest.Max{}, time.Hour, math.MaxInt64, n); got < 0 {
			t.Errorf("n=%d overflowed: %v", n, got)
		}
	}
	if got := retry.FullJitter(nil, 0, time.Second, 1); got != 0 {
		t.Errorf("zero base: %v", got)
	}
}
