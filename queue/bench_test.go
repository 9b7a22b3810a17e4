package queue

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

// Run with (docs/BENCHMARKS.md, "Queue"):
//
//	go test -run '^$' -bench . -benchtime 20000x -count 3 ./queue/
//
// BenchmarkWorkerVsRaw drains b.N pre-filled messages twice, in the same run: first with
// a raw go-redis loop (XREADGROUP COUNT n, then one XACK for the batch) as the ceiling,
// then with a Worker at Concurrency n and a no-op handler (from Run to the last XACK,
// so group creation, the first reclaim scan and starting handler goroutines count). It
// reports both rates, their ratio and the consumer's Redis round trips per job.

// discard drops the worker's logs, which would otherwise interleave with the figures.
var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// prefill adds n well-formed messages to keys' stream with pipelined XADDs.
func prefill(b *testing.B, rdb *redis.Client, keys Keys, n int) {
	b.Helper()
	ctx := context.Background()
	for done := 0; done < n; {
		pipe := rdb.Pipeline()
		for i := 0; i < 1000 && done < n; i, done = i+1, done+1 {
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), Values: message(done, nil).Values()})
		}
		if _, err := pipe.Exec(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// consumerClient returns a client of its own, with a round-trip counter.
func consumerClient(b *testing.B) (*redis.Client, *roundtrip.Counter) {
	b.Helper()
	rdb, err := connect.Redis(testenv.RedisURL(b))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rdb.Close() })
	rt := &roundtrip.Counter{}
	rdb.AddHook(rt)
	return rdb, rt
}

// rawDrain consumes n messages with XREADGROUP COUNT batch / XACK and returns the time.
func rawDrain(b *testing.B, n, batch int) (time.Duration, int64) {
	rdb, prefix := testenv.Redis(b)
	keys := Keys{Prefix: prefix, Queue: "bench"}
	prefill(b, rdb, keys, n)
	if err := CreateGroup(context.Background(), rdb, keys, "raw"); err != nil {
		b.Fatal(err)
	}
	c, rt := consumerClient(b)
	ctx := context.Background()
	began := time.Now()
	ids := make([]string, 0, batch)
	for got := 0; got < n; {
		res, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "raw", Consumer: "c", Streams: []string{keys.Stream(), ">"}, Count: int64(batch), Block: time.Second}).Result()
		if err != nil {
			b.Fatal(err)
		}
		ids = ids[:0]
		for _, m := range res[0].Messages {
			ids = append(ids, m.ID)
		}
		if err := c.XAck(ctx, keys.Stream(), "raw", ids...).Err(); err != nil {
			b.Fatal(err)
		}
		got += len(ids)
	}
	return time.Since(began), rt.Redis()
}

// ackWatch is a go-redis hook that closes done once n entries were acknowledged.
type ackWatch struct {
	n     int64
	acked atomic.Int64
	done  chan struct{}
}

func (h *ackWatch) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *ackWatch) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.count(cmd, err)
		return err
	}
}

// ProcessPipelineHook counts the XACK the acknowledger pipelines with its success
// records.
func (h *ackWatch) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			h.count(cmd, cmd.Err())
		}
		return err
	}
}

func (h *ackWatch) count(cmd redis.Cmder, err error) {
	if c, ok := cmd.(*redis.IntCmd); ok && cmd.Name() == "xack" && err == nil {
		if h.acked.Add(c.Val()) == h.n {
			close(h.done)
		}
	}
}

// workerDrain consumes n messages with a Worker at the given concurrency and a no-op
// handler, and returns the time from Run until the last XACK returned.
func workerDrain(b *testing.B, n, concurrency int) (time.Duration, int64) {
	rdb, prefix := testenv.Redis(b)
	keys := Keys{Prefix: prefix, Queue: "bench"}
	prefill(b, rdb, keys, n)
	if err := CreateGroup(context.Background(), rdb, keys, DefaultGroup); err != nil {
		b.Fatal(err)
	}
	c, rt := consumerClient(b)
	acks := &ackWatch{n: int64(n), done: make(chan struct{})}
	c.AddHook(acks)
	// ONCEFLOW_BENCH_RECORD_SUCCESSES=1 measures the cost of WorkerConfig.RecordSuccesses.
	w, err := NewWorker(WorkerConfig{Redis: c, Keys: keys, Concurrency: concurrency, Block: 20 * time.Millisecond,
		RecordSuccesses: os.Getenv("ONCEFLOW_BENCH_RECORD_SUCCESSES") == "1",
		Logger:          discard, Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	if err != nil {
		b.Fatal(err)
	}
	rt.Reset()
	ctx, cancel := context.WithCancel(context.Background())
	b.StartTimer()
	began := time.Now()
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	<-acks.done
	elapsed := time.Since(began)
	b.StopTimer()
	rts := rt.Redis()
	cancel()
	<-done
	if p := rdb.XPending(context.Background(), keys.Stream(), DefaultGroup).Val(); p.Count != 0 {
		b.Fatalf("%d entries left pending", p.Count)
	}
	return elapsed, rts
}

func BenchmarkWorkerVsRaw(b *testing.B) {
	for _, c := range []int{1, 64, 512} {
		b.Run(fmt.Sprintf("concurrency=%d", c), func(b *testing.B) {
			b.StopTimer() // ns/op is the worker's drain time alone
			rawTime, rawRT := rawDrain(b, b.N, c)
			workerTime, workerRT := workerDrain(b, b.N, c)
			raw := float64(b.N) / rawTime.Seconds()
			worker := float64(b.N) / workerTime.Seconds()
			b.ReportMetric(raw, "raw-jobs/s")
			b.ReportMetric(worker, "worker-jobs/s")
			b.ReportMetric(worker/raw, "worker/raw")
			b.ReportMetric(float64(rawRT)/float64(b.N), "raw-rt/job")
			b.ReportMetric(float64(workerRT)/float64(b.N), "worker-rt/job")
		})
	}
}

// BenchmarkEnqueue measures Enqueue (one Lua round trip: XADD, HSET tenant, index TTL)
// from 64 goroutines, beside a plain XADD of the same fields.
func BenchmarkEnqueue(b *testing.B) {
	b.Run("Enqueue", func(b *testing.B) {
		rdb, prefix := testenv.Redis(b)
		keys := Keys{Prefix: prefix, Queue: "bench"}
		var i atomic.Int64
		b.SetParallelism(32) // 2 cores x 32 = 64 goroutines
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := Enqueue(context.Background(), rdb, keys, message(int(i.Add(1)), nil)); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "jobs/s")
	})
	b.Run("XADD", func(b *testing.B) {
		rdb, prefix := testenv.Redis(b)
		keys := Keys{Prefix: prefix, Queue: "bench"}
		var i atomic.Int64
		b.SetParallelism(32)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: keys.Stream(), Values: message(int(i.Add(1)), nil).Values()}).Err(); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "jobs/s")
	})
}

// BenchmarkEndToEnd runs 8 producers calling Enqueue and one Worker (Concurrency 64,
// no-op handler) at once, and reports jobs per second from the first Enqueue to the last
// acknowledgement.
func BenchmarkEndToEnd(b *testing.B) {
	rdb, prefix := testenv.Redis(b)
	keys := Keys{Prefix: prefix, Queue: "bench"}
	if err := CreateGroup(context.Background(), rdb, keys, DefaultGroup); err != nil {
		b.Fatal(err)
	}
	c, _ := consumerClient(b)
	var handled atomic.Int64
	all := make(chan struct{})
	w, err := NewWorker(WorkerConfig{Redis: c, Keys: keys, Concurrency: 64, Block: 20 * time.Millisecond, Logger: discard,
		Handler: HandlerFunc(func(context.Context, *Job) error {
			if handled.Add(1) == int64(b.N) {
				close(all)
			}
			return nil
		})})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	b.ResetTimer()
	go func() { _ = w.Run(ctx); close(done) }()
	var wg sync.WaitGroup
	var next atomic.Int64
	for range 8 {
		wg.Go(func() {
			for i := int(next.Add(1)); i <= b.N; i = int(next.Add(1)) {
				if _, err := Enqueue(context.Background(), rdb, keys, message(i, nil)); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	<-all
	cancel()
	<-done
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "jobs/s")
}
