package gatewaybench

import (
	"math"
	"slices"
	"time"
)

func sortDurations(ds []time.Duration) { slices.Sort(ds) }

func sortFloats(fs []float64) { slices.Sort(fs) }

// quantile returns the nearest-rank q-quantile (0 to 1) of sorted: the smallest value
// with at least a fraction q of the values at or below it; 0 when empty.
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(q * float64(len(sorted))))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

// median returns the median of fs (the mean of the middle two for an even count); 0
// when empty. fs is not modified.
func median(fs []float64) float64 {
	if len(fs) == 0 {
		return 0
	}
	s := slices.Clone(fs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// timeline records when a reader got its bytes: after the i-th read it had cum[i]
// bytes, at[i] after the trial's origin.
type timeline struct {
	at  []time.Duration
	cum []int
}

func (t *timeline) add(at time.Duration, n int) {
	total := n
	if len(t.cum) > 0 {
		total += t.cum[len(t.cum)-1]
	}
	t.at = append(t.at, at)
	t.cum = append(t.cum, total)
}

// bytes returns the number of bytes received.
func (t *timeline) bytes() int {
	if len(t.cum) == 0 {
		return 0
	}
	return t.cum[len(t.cum)-1]
}

// reached returns when the reader had at least n bytes (n ≥ 1), and false if it never
// did.
func (t *timeline) reached(n int) (time.Duration, bool) {
	i, _ := slices.BinarySearch(t.cum, n)
	if i == len(t.cum) {
		return 0, false
	}
	return t.at[i], true
}

// lags returns, for every byte offset from from to the end of joiner's bytes (and of
// first's), how much later joiner got that byte than first did.
func lags(first, joiner *timeline, from int) []time.Duration {
	end := min(first.bytes(), joiner.bytes())
	var out []time.Duration
	i, j := 0, 0 // indexes of the reads that delivered byte b
	for b := from; b < end; b++ {
		for first.cum[i] <= b {
			i++
		}
		for joiner.cum[j] <= b {
			j++
		}
		out = append(out, joiner.at[j]-first.at[i])
	}
	return out
}
