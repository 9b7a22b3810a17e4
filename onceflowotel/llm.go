package onceflowotel

import (
	"context"
	"iter"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/llmmetrics"
	"github.com/onceflow/onceflow/retry"
)

// LLMClient returns c with a client span per call ("chat <model>"): one per attempt,
// when it wraps the client a retry loop or the llm_calls ledger calls once per attempt
// (wrap the provider's client, inside the ledger, so replays are not traced as calls).
// It records the provider, the model, the response id, token usage and finish reason,
// and for a failure its retry class (error.type), whether it is retryable and whether
// it was ambiguous (the provider may have run it). Prompts and answers are not recorded.
// The result is safe for concurrent use when c is.
func LLMClient(tp trace.TracerProvider, provider string, c llm.Client) llm.Client {
	return &tracedLLM{tracer: tracer(tp), provider: provider, next: c}
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
