package redisstore

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/queue"
)

// BenchmarkAcceptStep measures the accept of a new key with the queue's enqueue
// (queue.EnqueueStep, then Store.AcceptStep) on the shared test Redis, without HTTP:
// the Go path and its one script, one goroutine (serial) and 64 (parallel). It reports
// accepts per second and Redis round trips per accept. Run it with
//
//	go test -run '^$' -bench AcceptStep -benchtime 20000x ./idempotency/redisstore/
func BenchmarkAcceptStep(b *testing.B) {
	for _, par := range []int{0, 32} {
		name := "serial"
		if par > 0 {
			name = "parallel"
		}
		b.Run(name, func(b *testing.B) {
			rdb, prefix := testenv.Redis(b)
			var rt roundtrip.Counter
			rdb.AddHook(&rt)
			ctx := context.Background()
			s, err := New(rdb, Config{Prefix: prefix, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				b.Fatal(err)
			}
			if err := s.Preload(ctx, queue.StepFunctions()...); err != nil {
				b.Fatal(err)
			}
			keys := queue.Keys{Prefix: prefix, Queue: "summaries"}
			resp := accepted()
			payload := []byte(benchBody)
			var n atomic.Int64
			accept := func() error {
				i := n.Add(1)
				scope := idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/summaries", Key: fmt.Sprintf("bench-key-%012d", i)}
				step, err := queue.EnqueueStep(keys, queue.Message{JobID: fmt.Sprintf("00000000-0000-4000-8000-%012x", i), Tenant: "acme", Payload: payload})
				if err != nil {
					return err
				}
				_, replayed, err := s.AcceptStep(ctx, scope, testFP, resp, step)
				if err == nil && replayed {
					err = fmt.Errorf("key %d replayed", i)
				}
				return err
			}
			rt.Reset()
			b.ResetTimer()
			if par == 0 {
				for range b.N {
					if err := accept(); err != nil {
						b.Fatal(err)
					}
				}
			} else {
				b.SetParallelism(par)
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if err := accept(); err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "accepts/s")
			b.ReportMetric(float64(rt.Redis())/float64(b.N), "rt/accept")
		})
	}
}
