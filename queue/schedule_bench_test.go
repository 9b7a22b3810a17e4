package queue

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
)

// The figures of docs/RELIABILITY.md, "Retries and hand-backs": run with
//
//	go test -run '^$' -bench 'RetryLatency|ShutdownHandBack' -benchtime 1x ./queue
//
// They report times (custom metrics), not ns/op.

// quiet discards the benchmarks' worker logs (a benchmark's b.Log is always printed).
var quiet = slog.New(slog.DiscardHandler)

// percentile returns the p-th percentile (0..1) of sorted ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return ds[min(int(float64(len(ds)-1)*p+0.5), len(ds)-1)]
}

// retryGaps enqueues jobs that each fail once with fail(), and returns for each the time
// from the failed run's return to the start of its next attempt, sorted.
func retryGaps(b *testing.B, jobs int, cfg WorkerConfig, fail func() error) []time.Duration {
	b.Helper()
	rdb, keys := setup(b)
	var mu sync.Mutex
	failedAt := map[string]time.Time{}
	var gaps []time.Duration
	done := make(chan struct{})
	cfg.Redis, cfg.Keys = rdb, keys
	cfg.Handler = HandlerFunc(func(_ context.Context, j *Job) error {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		if at, ok := failedAt[j.JobID]; ok {
			gaps = append(gaps, now.Sub(at))
			if len(gaps) == jobs {
				close(done)
			}
			return nil
		}
		failedAt[j.JobID] = time.Now() // as the run returns
		return fail()
	})
	cfg.Logger = quiet
	w := start(b, cfg)
	for i := range jobs {
		if _, err := Enqueue(context.Background(), rdb, keys, message(i, nil)); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		b.Fatalf("only %d of %d retries ran", len(gaps), jobs)
	}
	w.stop(b)
	slices.Sort(gaps)
	return gaps
}

// BenchmarkRetryLatency measures the time from a transient failure to the next attempt:
// with the default full-jitter backoff at RetryBase 1s (the draw is uniform in [0, 1s]
// for a first failure), and the mechanism's own overhead beyond an exact delay (a
// failure with a Retry-After of 1s). ClaimIdle is the default 2 minutes: none of this
// waits for it.
func BenchmarkRetryLatency(b *testing.B) {
	const jobs = 200
	for range b.N {
		jitter := retryGaps(b, jobs, WorkerConfig{RetryBase: time.Second, RetryMax: time.Second},
			func() error { return errors.New("blip") })
		b.ReportMetric(float64(percentile(jitter, 0.5).Milliseconds()), "jitter-median-ms")
		b.ReportMetric(float64(percentile(jitter, 0.99).Milliseconds()), "jitter-p99-ms")
		exact := retryGaps(b, jobs, WorkerConfig{}, func() error { return retry.RetryAfter(time.Second, errors.New("429")) })
		for i := range exact {
			exact[i] -= time.Second
		}
		b.ReportMetric(float64(percentile(exact, 0.5).Microseconds())/1000, "overhead-median-ms")
		b.ReportMetric(float64(percentile(exact, 0.99).Microseconds())/1000, "overhead-p99-ms")
	}
}

// BenchmarkShutdownHandBack measures the time from a worker's stop (its Run's context
// cancelled, as SIGTERM does in `onceflow work`) to its cut job starting on another
// worker, with ShutdownTimeout 500ms and ClaimIdle the default 2 minutes (no reclaim).
func BenchmarkShutdownHandBack(b *testing.B) {
	var took []time.Duration
	for i := range b.N {
		rdb, keys := setup(b)
		started := make(chan struct{}, 1)
		a := start(b, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "a", ShutdownTimeout: 500 * time.Millisecond, Logger: quiet,
			Handler: HandlerFunc(func(ctx context.Context, _ *Job) error { started <- struct{}{}; <-ctx.Done(); return ctx.Err() })})
		if _, err := Enqueue(context.Background(), rdb, keys, message(i, nil)); err != nil {
			b.Fatal(err)
		}
		<-started
		elsewhere := make(chan time.Time, 1)
		other := start(b, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "b", Logger: quiet,
			Handler: HandlerFunc(func(context.Context, *Job) error { elsewhere <- time.Now(); return nil })})
		time.Sleep(100 * time.Millisecond) // b is reading
		sent := time.Now()
		go a.cancel() // as SIGTERM does; the worker's cleanup waits for it
		select {
		case at := <-elsewhere:
			took = append(took, at.Sub(sent))
		case <-time.After(30 * time.Second):
			b.Fatal("the cut job did not start elsewhere")
		}
		other.stop(b)
	}
	slices.Sort(took)
	b.ReportMetric(float64(percentile(took, 0.5).Milliseconds()), "median-ms")
	b.ReportMetric(float64(percentile(took, 1).Milliseconds()), "max-ms")
}
