package loadgen

import (
	"math"
	"math/bits"
	"time"
)

// Histogram records durations in log-linear buckets (128 per power of two, so any
// reported quantile is within 1% of the true value) in constant memory. The zero value
// is ready. It is not safe for concurrent use: give each goroutine its own and Merge.
type Histogram struct {
	counts   []uint64
	n        uint64
	sum      float64
	min, max time.Duration
}

const (
	subBits    = 7
	subBuckets = 1 << subBits // 128
	linear     = 2 * subBuckets
	numBuckets = linear + (64-subBits-1)*subBuckets
)

func bucketOf(v uint64) int {
	if v < linear {
		return int(v) // #nosec G115 -- v < linear (256)
	}
	e := bits.Len64(v) - (subBits + 1)                   // >= 1
	m := v >> uint(e)                                    // in [128, 255]
	return linear + (e-1)*subBuckets + int(m-subBuckets) // #nosec G115 -- m-subBuckets < 128
}

// upperOf returns the largest value that falls into bucket i.
func upperOf(i int) uint64 {
	if i < linear {
		return uint64(max(i, 0)) // #nosec G115 -- 0 <= i < linear
	}
	e := (i-linear)/subBuckets + 1
	m := uint64((i-linear)%subBuckets + subBuckets)
	return (m+1)<<uint(e) - 1
}

// Record adds one duration; negative durations count as zero.
func (h *Histogram) Record(d time.Duration) {
	if d < 0 {
		d = 0
	}
	if h.counts == nil {
		h.counts = make([]uint64, numBuckets)
	}
	h.counts[bucketOf(uint64(d))]++
	if h.n == 0 || d < h.min {
		h.min = d
	}
	if d > h.max {
		h.max = d
	}
	h.n++
	h.sum += float64(d)
}

// Merge adds every value recorded in o.
func (h *Histogram) Merge(o *Histogram) {
	if o.n == 0 {
		return
	}
	if h.counts == nil {
		h.counts = make([]uint64, numBuckets)
	}
	for i, c := range o.counts {
		h.counts[i] += c
	}
	if h.n == 0 || o.min < h.min {
		h.min = o.min
	}
	h.max = max(h.max, o.max)
	h.n += o.n
	h.sum += o.sum
}

// Count returns the number of recorded values.
func (h *Histogram) Count() uint64 { return h.n }

// Min and Max return the exact extremes (zero when empty).
func (h *Histogram) Min() time.Duration { return h.min }

// Max returns the largest recorded value.
func (h *Histogram) Max() time.Duration { return h.max }

// Mean returns the exact mean (zero when empty).
func (h *Histogram) Mean() time.Duration {
	if h.n == 0 {
		return 0
	}
	return time.Duration(h.sum / float64(h.n))
}

// Quantile returns the value below or at which a fraction q (0 to 1) of the recorded
// values lie, within 1%; zero when empty. Quantile(0) is Min and Quantile(1) is Max.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	if q >= 1 {
		return h.max
	}
	if q <= 0 {
		return h.min
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	if rank == 0 {
		rank = 1
	}
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return min(time.Duration(min(upperOf(i), math.MaxInt64)), h.max) // #nosec G115 -- capped at MaxInt64
		}
	}
	return h.max
}
