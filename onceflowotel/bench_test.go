package onceflowotel_test

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/queue"
)

// BenchmarkJobSpan measures what tracing adds to one delivery, against a baseline of one
// Redis round trip (PING, the cheapest thing a real job does) in the same run: a noop
// job through QueueHandler and through a Client's Middleware with every span sampled
// and exported (batched, to an exporter that drops them), and through QueueHandler with
// a sampler that records nothing (docs/BENCHMARKS.md).
func BenchmarkJobSpan(b *testing.B) {
	rdb, _ := testenv.Redis(b)
	ping := queue.HandlerFunc(func(ctx context.Context, _ *queue.Job) error { return rdb.Ping(ctx).Err() })
	noop := queue.HandlerFunc(func(context.Context, *queue.Job) error { return nil })
	job := &queue.Job{Message: queue.Message{JobID: "5f0c8a2e-1c9b-4d7e-9a41-7d2f0b6c3e11", Tenant: "acme",
		TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, ID: "1-0", Deliveries: 1}
	sampled := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()))
	unsampled := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()))
	b.Cleanup(func() { _ = sampled.Shutdown(context.Background()); _ = unsampled.Shutdown(context.Background()) })
	for _, v := range []struct {
		name string
		h    queue.Handler
	}{
		{"redis-roundtrip", ping},
		{"span", onceflowotel.QueueHandler(sampled, "summaries", noop)},
		{"span-not-sampled", onceflowotel.QueueHandler(unsampled, "summaries", noop)},
		{"middleware-span", middlewareHandler(onceflowotel.Middleware(sampled))},
	} {
		b.Run(v.name, func(b *testing.B) {
			ctx := context.Background()
			for b.Loop() {
				if err := v.h.Handle(ctx, job); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// middlewareHandler runs a job through mw around a noop, as a Client runs its middleware.
func middlewareHandler(mw onceflow.Middleware) queue.Handler {
	run := mw(func(context.Context, *onceflow.JobInfo) error { return nil })
	return queue.HandlerFunc(func(ctx context.Context, j *queue.Job) error {
		return run(ctx, &onceflow.JobInfo{ID: j.JobID, Kind: "summary", Queue: "summaries", Tenant: j.Tenant,
			Delivery: int(j.Deliveries), Args: j.Payload, TraceParent: j.TraceParent})
	})
}
