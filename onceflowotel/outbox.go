package onceflowotel

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// Sender returns s with a producer span around each send ("outbox send <topic>"), a
// child of the span whose traceparent the outbox row carries (the job that wrote it). The
// inner sender sees m.Traceparent replaced by the send span's, so a webhook receiver's
// trace continues from the send. The span records the row id, topic, dedupe key and
// attempt, and for a failure the error and whether it is permanent. The result is safe
// for concurrent use when s is.
func Sender(tp trace.TracerProvider, s outbox.Sender) outbox.Sender {
	t := tracer(tp)
	return outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		ctx, span := t.Start(ContextWithTraceParent(ctx, m.Traceparent), "outbox send "+m.Topic,
			trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(
				attribute.String("messaging.operation.type", "send"),
				attribute.String("messaging.destination.name", m.Topic),
				attribute.String("onceflow.outbox.id", strconv.FormatInt(m.ID, 10)),
				attribute.String("onceflow.outbox.dedupe_key", m.DedupeKey),
				attribute.Int("onceflow.outbox.attempt", m.Attempts+1),
			))
		defer span.End()
		m.Traceparent = TraceParent(ctx)
		err := s.Send(ctx, m)
		if err != nil {
			span.SetAttributes(attribute.Bool("onceflow.outbox.permanent", retry.IsPermanent(err)))
			span.RecordError(err)
			span.SetStatus(codes.Error, "send failed")
		}
		return err
	})
}
