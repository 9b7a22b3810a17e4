package onceflowotel

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// Middleware returns an onceflow.Middleware that runs each job in a consumer span
// ("<queue> process"), a child of the span whose traceparent the job was enqueued with
// (see TraceParent and onceflow.Config.TraceParent), or the root of a new trace when it
// carries none. The job's Worker gets the span in its ctx, so its model calls, enqueues
// and effects continue the trace; next middlewares see JobInfo.TraceParent set to the
// span's. List it first in Config.Middleware to time the others too. The span records
// the job id, kind, tenant, queue and delivery count, and for a failure the error and
// its fate (onceflow.job.fate: dead_letter, hand_back or retry). Safe for concurrent
// use.
func Middleware(tp trace.TracerProvider) onceflow.Middleware {
	t := tracer(tp)
	return func(next onceflow.JobFunc) onceflow.JobFunc {
		return func(ctx context.Context, info *onceflow.JobInfo) error {
			ctx, span := t.Start(ContextWithTraceParent(ctx, info.TraceParent), info.Queue+" process",
				trace.WithSpanKind(trace.SpanKindConsumer),
				trace.WithAttributes(
					attribute.String("messaging.system", "redis"),
					attribute.String("messaging.operation.type", "process"),
					attribute.String("messaging.destination.name", info.Queue),
					attribute.Int("messaging.message.delivery_count", info.Delivery),
					attribute.String("onceflow.job_id", info.ID),
					attribute.String("onceflow.job.kind", info.Kind),
					attribute.String("onceflow.tenant", info.Tenant),
				))
			defer span.End()
			i := *info
			i.TraceParent = TraceParent(ctx)
			err := next(ctx, &i)
			endJob(span, err)
			return err
		}
	}
}

// QueueHandler returns h with a consumer span around each delivery of a job of the named
// queue ("<queue> process"), for programs that run a queue.Worker themselves; a Client
// takes Middleware instead. The span is a child of the span whose traceparent the
// message carries (the request that enqueued it), or the root of a new trace when it
// carries none. The inner handler sees job.TraceParent replaced by the delivery span's,
// so what it propagates (the outbox row it writes) continues from the delivery. The
// span records the job id, tenant, stream entry id, delivery count, and for a failure
// the error and its fate. Safe for concurrent use.
func QueueHandler(tp trace.TracerProvider, queueName string, h queue.Handler) queue.Handler {
	t := tracer(tp)
	name := queueName + " process"
	return queue.HandlerFunc(func(ctx context.Context, job *queue.Job) error {
		ctx, span := t.Start(ContextWithTraceParent(ctx, job.TraceParent), name,
			trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(
				attribute.String("messaging.system", "redis"),
				attribute.String("messaging.operation.type", "process"),
				attribute.String("messaging.destination.name", queueName),
				attribute.String("messaging.message.id", job.ID),
				attribute.Int64("messaging.message.delivery_count", job.Deliveries),
				attribute.String("onceflow.job_id", job.JobID),
				attribute.String("onceflow.tenant", job.Tenant),
			))
		defer span.End()
		j := *job
		j.TraceParent = TraceParent(ctx)
		err := h.Handle(ctx, &j)
		endJob(span, err)
		return err
	})
}

// endJob records a failed run's error and fate on its span: dead_letter for a permanent
// error, hand_back for an unavailable dependency (no delivery spent), retry otherwise
// (with the delay a RetryAfter asked for).
func endJob(span trace.Span, err error) {
	if err == nil {
		return
	}
	fate := "retry"
	var delay *retry.DelayError
	switch {
	case errors.Is(err, retry.ErrPermanent):
		fate = "dead_letter"
	case errors.Is(err, retry.ErrUnavailable):
		fate = "hand_back"
	case errors.As(err, &delay):
		span.SetAttributes(attribute.Float64("onceflow.job.retry_after_seconds", delay.Delay.Seconds()))
	}
	span.SetAttributes(attribute.String("onceflow.job.fate", fate))
	span.RecordError(err)
	span.SetStatus(codes.Error, "job failed")
}
