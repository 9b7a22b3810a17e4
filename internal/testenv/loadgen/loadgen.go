// Package loadgen is a small closed-loop HTTP load generator for benchmarks: a fixed
// number of workers each send one request at a time for a fixed duration, and the
// result has the request rate and a latency histogram (p50, p99 within 1%).
//
// It measures a server and a client sharing one machine, so its numbers are only
// comparable with other numbers from the same run; report ratios.
package loadgen

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// Config configures Run.
type Config struct {
	// Concurrency is the number of workers, each with one request in flight.
	// Default: 32.
	Concurrency int
	// Duration is how long workers start new requests; Run returns once the last
	// in-flight request has finished. Default: 5s.
	Duration time.Duration
	// NewRequest builds the seq-th request (from 0) of worker. Required.
	NewRequest func(worker, seq int) (*http.Request, error)
	// Client sends the requests. Default: a client whose transport keeps Concurrency
	// idle connections per host.
	Client *http.Client
	// Check judges a response (its body has been read into body). A non-nil error
	// counts the request as failed. Default: any 2xx succeeds.
	Check func(resp *http.Response, body []byte) error
}

// Result is what one Run measured.
type Result struct {
	// Requests is the number of completed requests, failed ones included.
	Requests int64
	// Failures counts transport errors and responses Check rejected.
	Failures int64
	// FirstFailure describes the first failure, if any.
	FirstFailure string
	// Status counts responses by status code.
	Status map[int]int64
	// Elapsed is the time from the first request to the end of the last.
	Elapsed time.Duration
	// Latency holds every completed request's latency.
	Latency *Histogram
}

// RPS returns completed requests per second.
func (r *Result) RPS() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Requests) / r.Elapsed.Seconds()
}

// String summarises the result on one line.
func (r *Result) String() string {
	return fmt.Sprintf("%d requests in %v: %.0f req/s, p50 %v, p99 %v, max %v, %d failed",
		r.Requests, r.Elapsed.Round(time.Millisecond), r.RPS(), r.Latency.Quantile(0.5).Round(time.Microsecond),
		r.Latency.Quantile(0.99).Round(time.Microsecond), r.Latency.Max().Round(time.Microsecond), r.Failures)
}

// Run sends requests as cfg says until cfg.Duration has passed or ctx is cancelled. It
// returns an error only for an invalid Config; failed requests are counted in Result.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.NewRequest == nil {
		return nil, errors.New("loadgen: Config.NewRequest is required")
	}
	cfg.Concurrency = cmp.Or(cfg.Concurrency, 32)
	cfg.Duration = cmp.Or(cfg.Duration, 5*time.Second)
	if cfg.Concurrency < 0 || cfg.Duration < 0 {
		return nil, errors.New("loadgen: negative Concurrency or Duration")
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Transport: &http.Transport{
			MaxIdleConns: cfg.Concurrency, MaxIdleConnsPerHost: cfg.Concurrency,
		}}
		defer cfg.Client.CloseIdleConnections()
	}
	if cfg.Check == nil {
		cfg.Check = func(resp *http.Response, _ []byte) error {
			if resp.StatusCode/100 != 2 {
				return fmt.Errorf("status %d", resp.StatusCode)
			}
			return nil
		}
	}
	type workerResult struct {
		hist     Histogram
		status   map[int]int64
		n, fails int64
		first    string
	}
	results := make([]workerResult, cfg.Concurrency)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	deadline := start.Add(cfg.Duration)
	var wg sync.WaitGroup
	for w := range cfg.Concurrency {
		wg.Go(func() {
			res := &results[w]
			res.status = map[int]int64{}
			buf := make([]byte, 0, 4096)
			for seq := 0; ctx.Err() == nil && time.Now().Before(deadline); seq++ {
				req, err := cfg.NewRequest(w, seq)
				if err != nil {
					res.fails++
					if res.first == "" {
						res.first = "build request: " + err.Error()
					}
					cancel()
					return
				}
				t0 := time.Now()
				resp, err := cfg.Client.Do(req.WithContext(ctx))
				if err == nil {
					buf, err = readAll(resp.Body, buf[:0])
					_ = resp.Body.Close()
				}
				res.hist.Record(time.Since(t0))
				res.n++
				if err == nil {
					res.status[resp.StatusCode]++
					err = cfg.Check(resp, buf)
				}
				if err != nil && ctx.Err() == nil {
					res.fails++
					if res.first == "" {
						res.first = err.Error()
					}
				}
			}
		})
	}
	wg.Wait()
	out := &Result{Elapsed: time.Since(start), Status: map[int]int64{}, Latency: &Histogram{}}
	for i := range results {
		r := &results[i]
		out.Requests += r.n
		out.Failures += r.fails
		if out.FirstFailure == "" {
			out.FirstFailure = r.first
		}
		out.Latency.Merge(&r.hist)
		for code, n := range r.status {
			out.Status[code] += n
		}
	}
	return out, nil
}

func readAll(r io.Reader, buf []byte) ([]byte, error) {
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if errors.Is(err, io.EOF) {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
}
