package loadgen

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

func within(t *testing.T, what string, got, want time.Duration, tol float64) {
	t.Helper()
	if d := float64(got-want) / float64(want); d > tol || d < -tol {
		t.Errorf("%s = %v, want %v within %.1f%%", what, got, want, tol*100)
	}
}

func TestHistogramQuantiles(t *testing.T) {
	var h Histogram
	vals := rand.Perm(10000)
	for _, v := range vals {
		h.Record(time.Duration(v+1) * time.Microsecond) // 1µs .. 10ms, uniform
	}
	if h.Count() != 10000 || h.Min() != time.Microsecond || h.Max() != 10*time.Millisecond {
		t.Fatalf("count %d min %v max %v", h.Count(), h.Min(), h.Max())
	}
	within(t, "p50", h.Quantile(0.5), 5000*time.Microsecond, 0.01)
	within(t, "p99", h.Quantile(0.99), 9900*time.Microsecond, 0.01)
	within(t, "p999", h.Quantile(0.999), 9990*time.Microsecond, 0.01)
	within(t, "mean", h.Mean(), 5000500*time.Nanosecond, 0.0001)
	if h.Quantile(1) != h.Max() || h.Quantile(0) != time.Microsecond {
		t.Errorf("Quantile(1) = %v, Quantile(0) = %v", h.Quantile(1), h.Quantile(0))
	}
	var empty Histogram
	if empty.Quantile(0.5) != 0 || empty.Mean() != 0 {
		t.Error("empty histogram reports values")
	}
}

func TestHistogramSmallAndHugeValues(t *testing.T) {
	var h Histogram
	for _, d := range []time.Duration{0, 1, 255, 256, time.Hour, 1<<63 - 1} {
		h.Record(d)
	}
	h.Record(-5)
	if h.Min() != 0 || h.Max() != 1<<63-1 || h.Count() != 7 {
		t.Fatalf("min %v max %v count %d", h.Min(), h.Max(), h.Count())
	}
	for v := uint64(0); v < 100000; v += 7 {
		if i := bucketOf(v); upperOf(i) < v || (i > 0 && upperOf(i-1) >= v) {
			t.Fatalf("value %d in bucket %d [.., %d]", v, i, upperOf(i))
		}
	}
}

func TestHistogramMerge(t *testing.T) {
	var a, b, all Histogram
	for i := 1; i <= 1000; i++ {
		d := time.Duration(i) * time.Millisecond
		all.Record(d)
		if i%2 == 0 {
			a.Record(d)
		} else {
			b.Record(d)
		}
	}
	a.Merge(&b)
	for _, q := range []float64{0.1, 0.5, 0.9, 0.99} {
		if a.Quantile(q) != all.Quantile(q) {
			t.Errorf("merged q%v = %v, want %v", q, a.Quantile(q), all.Quantile(q))
		}
	}
	if a.Count() != all.Count() || a.Min() != all.Min() || a.Max() != all.Max() {
		t.Error("merged extremes differ")
	}
}

func TestRunCountsEveryRequestAndItsStatusForItsDuration(t *testing.T) {
	var served atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := served.Add(1)
		if r.Header.Get("X-Fail") == "yes" {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, "ok %d", n)
	}))
	defer srv.Close()
	seen := map[[2]int]bool{}
	var mu = make(chan struct{}, 1)
	res, err := Run(context.Background(), Config{
		Concurrency: 4,
		Duration:    300 * time.Millisecond,
		NewRequest: func(worker, seq int) (*http.Request, error) {
			mu <- struct{}{}
			if seen[[2]int{worker, seq}] {
				t.Errorf("request (%d, %d) built twice", worker, seq)
			}
			seen[[2]int{worker, seq}] = true
			<-mu
			req, err := http.NewRequest("GET", srv.URL, nil)
			if seq%10 == 9 {
				req.Header.Set("X-Fail", "yes")
			}
			return req, err
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests == 0 || res.Requests != served.Load() || int64(res.Latency.Count()) != res.Requests {
		t.Fatalf("requests %d, served %d, latencies %d", res.Requests, served.Load(), res.Latency.Count())
	}
	if res.Status[200]+res.Status[500] != res.Requests || res.Failures != res.Status[500] || res.Status[500] == 0 {
		t.Fatalf("status %v, failures %d", res.Status, res.Failures)
	}
	if res.FirstFailure != "status 500" {
		t.Errorf("first failure %q", res.FirstFailure)
	}
	if got := res.RPS() * res.Elapsed.Seconds(); got < float64(res.Requests)-0.5 || got > float64(res.Requests)+0.5 {
		t.Errorf("RPS %v inconsistent with %d requests in %v", res.RPS(), res.Requests, res.Elapsed)
	}
	if res.Elapsed < 300*time.Millisecond {
		t.Errorf("run ended after %v, before its duration", res.Elapsed)
	}
	if _, err := Run(context.Background(), Config{}); err == nil {
		t.Error("Run without NewRequest succeeded")
	}
}

func TestRunStopsOnCancel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var n atomic.Int64
	res, err := Run(ctx, Config{Concurrency: 2, Duration: time.Hour, NewRequest: func(_, _ int) (*http.Request, error) {
		if n.Add(1) == 50 {
			cancel()
		}
		return http.NewRequest("GET", srv.URL, nil)
	}})
	if err != nil || res.Requests < 49 || res.Failures != 0 {
		t.Fatalf("cancelled run: %v, %+v", err, res)
	}
}
