package tracing

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// BenchmarkJobSpan measures what tracing adds to one delivery, against a baseline of one
// Redis round trip (PING, the cheapest thing a real job does) in the same run: a noop
// job through Handler with every span sampled and exported (batched, to an exporter
// that drops them), and with a sampler that records nothing (docs/BENCHMARKS.md).
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
		{"span", Handler(sampled, "summaries", noop)},
		{"span-not-sampled", Handler(unsampled, "summaries", noop)},
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
