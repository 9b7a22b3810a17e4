package onceflowotel

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// w3c encodes and decodes the W3C traceparent (and tracestate) headers. It is used
// whatever the global propagator: the stream's and the outbox's traceparent fields hold
// W3C traceparents.
var w3c = propagation.TraceContext{}

// TraceParent returns the W3C traceparent of the span in ctx
// ("00-<trace id>-<span id>-<flags>"), or "" when ctx holds no valid span. It is what
// travels in a stream message's traceparent field and an outbox row's traceparent
// column; give it to onceflow.Config.TraceParent so that jobs carry their enqueuer's
// span. It is safe for concurrent use.
func TraceParent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	w3c.Inject(ctx, c)
	return c["traceparent"]
}

// ContextWithTraceParent returns ctx carrying the span context a traceparent names, as
// a remote parent for the next span started from it. An empty or malformed traceparent
// leaves ctx as it is, so the next span starts a new trace.
func ContextWithTraceParent(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return w3c.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
}
