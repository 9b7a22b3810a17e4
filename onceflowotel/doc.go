// Package onceflowotel traces onceflow jobs with OpenTelemetry: a span for each run of
// a job, children for its model calls and its effects' sends, and the W3C traceparent
// that carries the trace through the Redis stream and the outbox table, so that one
// trace goes from the request that enqueued a job to the webhook its effect called:
//
//	POST /v1/tickets               server span (HTTPHandler, or your own otelhttp)
//	└─ default process             consumer span of each run of a job (Middleware for a
//	   │                           Client, QueueHandler for a queue.Worker), child of the
//	   │                           enqueuer's span through the message's traceparent
//	   ├─ chat gpt-4.1-mini        client span of each model attempt (LLMClient)
//	   └─ outbox send email.reply  the relay's send (Sender), child of the job's span
//	                               through the outbox row's traceparent column; the
//	                               webhook's Traceparent header continues from it
//
// With a Client:
//
//	client, err := onceflow.NewClient(onceflow.Config{
//		Redis:       rdb,
//		Workers:     workers,
//		Middleware:  []onceflow.Middleware{onceflowotel.Middleware(tp)}, // first: outermost
//		TraceParent: onceflowotel.TraceParent,                           // jobs carry the enqueuer's span
//	})
//
// Every function takes the trace.TracerProvider to use; nil means the global one
// (otel.GetTracerProvider). The package sets no globals and reads no environment:
// exporters, samplers and the OTEL_* variables are the program's business (the onceflow
// binary reads them in cmd/onceflow). The spans' instrumentation scope is ScopeName.
// Span attributes never hold prompts, answers, headers, payloads or Idempotency-Key
// values (docs/workflows-instrumentation.md lists them).
package onceflowotel

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope (tracer name) of every span this package
// starts.
const ScopeName = "github.com/onceflow/onceflow"

// tracer returns the tracer of tp, or of the global provider when tp is nil.
func tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopeName)
}
