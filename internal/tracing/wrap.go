package tracing

import (
	"context"
	"errors"
	"iter"
	"net/http"
	"strconv"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/llmmetrics"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// HTTPHandler returns h with a server span per request, named after the matched route
// ("POST /v1/summaries") and continuing the caller's traceparent header when it sends
// one. The probes and the scrape (/healthz, /readyz, /metrics) are not traced. Headers
// (Authorization, Idempotency-Key) are not recorded.
func HTTPHandler(tp trace.TracerProvider, h http.Handler) http.Handler {
	return otelhttp.NewHandler(h, "http",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(w3c),
		otelhttp.WithFilter(func(r *http.Request) bool {
			switch r.URL.Path {
			case "/healthz", "/readyz", "/metrics":
				return false
			}
			return true
		}),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
			if r.Pattern != "" {
				return r.Pattern
			}
			return r.Method
		}),
	)
}

// Handler returns h with a consumer span around each delivery of a job of the named
// queue ("<queue> process"), a child of the span whose traceparent the message carries
// (the POST that enqueued it), or the root of a new trace when it carries none. The
// inner handler sees job.TraceParent replaced by the delivery span's, so what it
// propagates (the outbox row it writes) continues from the delivery. The span records
// the job id, tenant, entry id, delivery count and the error of a failed run.
func Handler(tp trace.TracerProvider, queueName string, h queue.Handler) queue.Handler {
	tracer := tp.Tracer(instrumentation)
	name := queueName + " process"
	return queue.HandlerFunc(func(ctx context.Context, job *queue.Job) error {
		ctx, span := tracer.Start(WithRemoteParent(ctx, job.TraceParent), name,
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
		if err != nil {
			fate := "retry"
			if errors.Is(err, queue.ErrPermanent) {
				fate = "dead_letter"
			}
			span.SetAttributes(attribute.String("onceflow.job.fate", fate))
			span.RecordError(err)
			span.SetStatus(codes.Error, "job failed")
		}
		return err
	})
}

// LLMClient returns c with a client span per call ("chat <model>"): one per attempt,
// since the retry loop calls the client once per attempt. It records the provider, the
// model, the response id, token usage and finish reason, and for a failure its retry
// class and whether it was ambiguous (the provider may have run it). Prompts and
// answers are not recorded.
func LLMClient(tp trace.TracerProvider, provider string, c llm.Client) llm.Client {
	return &tracedLLM{tracer: tp.Tracer(instrumentation), provider: provider, next: c}
}

type tracedLLM struct {
	tracer   trace.Tracer
	provider string
	next     llm.Client
}

func (t *tracedLLM) start(ctx context.Context, req *llm.Request, stream bool) (context.Context, trace.Span) {
	name := "chat"
	if req.Model != "" {
		name += " " + req.Model
	}
	return t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
		attribute.String("gen_ai.operation.name", "chat"),
		attribute.String("gen_ai.provider.name", t.provider),
		attribute.String("gen_ai.request.model", req.Model),
		attribute.Bool("onceflow.llm.stream", stream),
	))
}

func (t *tracedLLM) end(span trace.Span, resp *llm.Response, err error) {
	if resp != nil {
		span.SetAttributes(
			attribute.String("gen_ai.response.id", resp.ID),
			attribute.String("gen_ai.response.model", resp.Model),
			attribute.StringSlice("gen_ai.response.finish_reasons", []string{resp.FinishReason}),
			attribute.Int("gen_ai.usage.input_tokens", resp.Usage.InputTokens),
			attribute.Int("gen_ai.usage.output_tokens", resp.Usage.OutputTokens),
		)
	}
	if err != nil {
		v := retry.Classify(err)
		span.SetAttributes(attribute.String("error.type", string(v.Class)),
			attribute.Bool("onceflow.llm.retryable", v.Retryable),
			attribute.Bool("onceflow.llm.ambiguous", llmmetrics.Ambiguous(err)))
		if v.HasRetryAfter {
			span.SetAttributes(attribute.Float64("onceflow.llm.retry_after_seconds", v.RetryAfter.Seconds()))
		}
		span.RecordError(err)
		span.SetStatus(codes.Error, string(v.Class))
	}
	span.End()
}

// Complete implements llm.Client.
func (t *tracedLLM) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	ctx, span := t.start(ctx, req, false)
	resp, err := t.next.Complete(ctx, req)
	t.end(span, resp, err)
	return resp, err
}

// Stream implements llm.Client; the span lasts until the stream ends or the caller
// stops reading.
func (t *tracedLLM) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		ctx, span := t.start(ctx, req, true)
		resp := &llm.Response{}
		var failed error
		defer func() { t.end(span, resp, failed) }()
		for c, err := range t.next.Stream(ctx, req) {
			if err != nil {
				failed = err
			}
			if c.ID != "" {
				resp.ID = c.ID
			}
			if c.Done {
				resp.FinishReason = c.FinishReason
				if c.Usage != nil {
					resp.Usage = *c.Usage
				}
			}
			if !yield(c, err) {
				return
			}
		}
	}
}

// Sender returns s with a span around each send ("outbox send <topic>"), a child of the
// span whose traceparent the row carries (the delivery that wrote it). The inner sender
// sees m.Traceparent replaced by the send span's, so a webhook receiver's trace
// continues from the send. The span records the row id, topic, dedupe key and attempt.
func Sender(tp trace.TracerProvider, s outbox.Sender) outbox.Sender {
	tracer := tp.Tracer(instrumentation)
	return outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		ctx, span := tracer.Start(WithRemoteParent(ctx, m.Traceparent), "outbox send "+m.Topic,
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
			span.SetAttributes(attribute.Bool("onceflow.outbox.permanent", outbox.IsPermanent(err)))
			span.RecordError(err)
			span.SetStatus(codes.Error, "send failed")
		}
		return err
	})
}
