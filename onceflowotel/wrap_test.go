package onceflowotel_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

const (
	parentTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	parentSpan  = "00f067aa0ba902b7"
	parentTP    = "00-" + parentTrace + "-" + parentSpan + "-01"
)

func TestTraceParentRoundTrip(t *testing.T) {
	_, tp := newRecorder(t)
	if got := onceflowotel.TraceParent(context.Background()); got != "" {
		t.Fatalf("TraceParent without a span = %q", got)
	}
	ctx, span := tp.Tracer("t").Start(context.Background(), "parent")
	header := onceflowotel.TraceParent(ctx)
	want := "00-" + span.SpanContext().TraceID().String() + "-" + span.SpanContext().SpanID().String() + "-01"
	if header != want {
		t.Fatalf("TraceParent = %q, want %q", header, want)
	}
	span.End()

	_, child := tp.Tracer("t").Start(onceflowotel.ContextWithTraceParent(context.Background(), header), "child")
	child.End()
	ro := child.(sdktrace.ReadOnlySpan)
	if ro.Parent().SpanID() != span.SpanContext().SpanID() || !ro.Parent().IsRemote() || ro.SpanContext().TraceID() != span.SpanContext().TraceID() {
		t.Fatalf("child of a traceparent: parent %v, trace %v", ro.Parent(), ro.SpanContext().TraceID())
	}
	for _, bad := range []string{"", "garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01"} {
		_, root := tp.Tracer("t").Start(onceflowotel.ContextWithTraceParent(context.Background(), bad), "root")
		root.End()
		if p := root.(sdktrace.ReadOnlySpan).Parent(); p.IsValid() {
			t.Errorf("traceparent %q gave parent %v, want a new root", bad, p)
		}
	}
}

// A traceparent read from a stream message or an outbox row is outside input: any
// string gives either a valid remote parent whose traceparent round-trips, or none.
func FuzzContextWithTraceParent(f *testing.F) {
	for _, s := range []string{"", parentTP, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
		"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", "garbage"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ctx := onceflowotel.ContextWithTraceParent(context.Background(), s)
		sc := trace.SpanContextFromContext(ctx)
		if !sc.IsValid() {
			return
		}
		if !sc.IsRemote() {
			t.Fatalf("%q: a parent that is not remote", s)
		}
		again := onceflowotel.TraceParent(ctx)
		if sc2 := trace.SpanContextFromContext(onceflowotel.ContextWithTraceParent(context.Background(), again)); !sc2.Equal(sc) {
			t.Fatalf("%q: traceparent %q does not round-trip", s, again)
		}
	})
}

// QueueHandler: a consumer span per delivery, child of the message's traceparent; the
// inner handler sees the span's traceparent; the fate of a failure is recorded.
func TestQueueHandlerSpans(t *testing.T) {
	rec, tp := newRecorder(t)
	var inner string
	results := []error{nil, retry.Permanent(errors.New("bad input")), onceflow.Unavailable(errors.New("quota")),
		onceflow.RetryAfter(2*time.Second, errors.New("later")), errors.New("flaky")}
	i := 0
	h := onceflowotel.QueueHandler(tp, "summaries", queue.HandlerFunc(func(_ context.Context, j *queue.Job) error {
		inner = j.TraceParent
		err := results[i]
		i++
		return err
	}))
	job := &queue.Job{Message: queue.Message{JobID: "job-1", Tenant: "acme", TraceParent: parentTP}, ID: "1-0", Deliveries: 2}
	for range results {
		_ = h.Handle(context.Background(), job)
	}
	if job.TraceParent != parentTP {
		t.Fatalf("the caller's job was changed: traceparent %q", job.TraceParent)
	}
	spans := spansNamed(rec, "summaries process")
	if len(spans) != len(results) {
		t.Fatalf("%d spans, want %d", len(spans), len(results))
	}
	s := spans[0]
	if s.Parent().TraceID().String() != parentTrace || s.Parent().SpanID().String() != parentSpan || s.SpanKind() != trace.SpanKindConsumer {
		t.Fatalf("span parent %v kind %v", s.Parent(), s.SpanKind())
	}
	for k, want := range map[string]string{"onceflow.job_id": "job-1", "onceflow.tenant": "acme", "messaging.message.id": "1-0",
		"messaging.message.delivery_count": "2", "messaging.destination.name": "summaries"} {
		if !hasAttr(s, k, want) {
			t.Errorf("attribute %s: want %q in %v", k, want, s.Attributes())
		}
	}
	if want := "00-" + parentTrace + "-" + spans[len(spans)-1].SpanContext().SpanID().String() + "-01"; inner != want {
		t.Errorf("the inner handler saw traceparent %q, want the delivery span's %q", inner, want)
	}
	for n, fate := range []string{"", "dead_letter", "hand_back", "retry", "retry"} {
		s := spans[n]
		_, has := attr(s, "onceflow.job.fate")
		switch {
		case fate == "" && (has || s.Status().Code == codes.Error):
			t.Errorf("success %d: fate recorded or error status %v", n, s.Status())
		case fate != "" && (!hasAttr(s, "onceflow.job.fate", fate) || s.Status().Code != codes.Error):
			t.Errorf("failure %d (%v): attributes %v status %v, want fate %s", n, results[n], s.Attributes(), s.Status(), fate)
		}
	}
	if !hasAttr(spans[3], "onceflow.job.retry_after_seconds", "2") {
		t.Errorf("RetryAfter's delay not recorded: %v", spans[3].Attributes())
	}
}

// LLMClient: one client span per call, complete or streamed, with the provider's usage
// and, for a failure, its retry class.
func TestLLMClientSpans(t *testing.T) {
	rec, tp := newRecorder(t)
	f := fake.New()
	c := onceflowotel.LLMClient(tp, "openai", f)
	req := &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise: numbers are up."}}}
	resp, err := c.Complete(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	var chunks int
	for _, err := range c.Stream(context.Background(), req) {
		if err != nil {
			t.Fatal(err)
		}
		chunks++
	}
	f.FailNext(&llm.APIError{StatusCode: http.StatusTooManyRequests, Message: "slow down"})
	if _, err := c.Complete(context.Background(), req); err == nil {
		t.Fatal("scripted failure not returned")
	}
	spans := spansNamed(rec, "chat gpt-4.1-mini")
	if len(spans) != 3 || chunks < 2 {
		t.Fatalf("%d spans, %d chunks", len(spans), chunks)
	}
	for n, s := range spans[:2] {
		if s.SpanKind() != trace.SpanKindClient || !hasAttr(s, "gen_ai.provider.name", "openai") || !hasAttr(s, "gen_ai.response.id", resp.ID) ||
			!hasAttr(s, "gen_ai.usage.output_tokens", strconv.Itoa(resp.Usage.OutputTokens)) || s.Status().Code == codes.Error {
			t.Errorf("span %d: kind %v attributes %v status %v", n, s.SpanKind(), s.Attributes(), s.Status())
		}
	}
	if !hasAttr(spans[1], "onceflow.llm.stream", "true") {
		t.Errorf("stream span: %v", spans[1].Attributes())
	}
	failed := spans[2]
	if failed.Status().Code != codes.Error || !hasAttr(failed, "error.type", "rate_limited") || !hasAttr(failed, "onceflow.llm.retryable", "true") {
		t.Errorf("failed call: status %v attributes %v", failed.Status(), failed.Attributes())
	}
}

// Sender: a producer span per send, child of the row's traceparent; the inner sender
// sees the send span's, and a permanent failure is marked.
func TestSenderSpans(t *testing.T) {
	rec, tp := newRecorder(t)
	var inner string
	fail := false
	s := onceflowotel.Sender(tp, outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
		inner = m.Traceparent
		if fail {
			return retry.Permanent(errors.New("410 gone"))
		}
		return nil
	}))
	m := outbox.Message{ID: 7, Topic: "payments.refund", DedupeKey: "refund:order-9", Traceparent: parentTP, Attempts: 2}
	if err := s.Send(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	fail = true
	if err := s.Send(context.Background(), m); !retry.IsPermanent(err) {
		t.Fatalf("Send = %v, want the permanent error", err)
	}
	spans := spansNamed(rec, "outbox send payments.refund")
	if len(spans) != 2 {
		t.Fatalf("%d spans", len(spans))
	}
	ok, bad := spans[0], spans[1]
	if ok.Parent().SpanID().String() != parentSpan || ok.SpanKind() != trace.SpanKindProducer ||
		!hasAttr(ok, "onceflow.outbox.id", "7") || !hasAttr(ok, "onceflow.outbox.attempt", "3") || !hasAttr(ok, "onceflow.outbox.dedupe_key", "refund:order-9") {
		t.Errorf("send span: parent %v kind %v attributes %v", ok.Parent(), ok.SpanKind(), ok.Attributes())
	}
	if want := "00-" + parentTrace + "-" + bad.SpanContext().SpanID().String() + "-01"; inner != want {
		t.Errorf("inner sender saw %q, want the send span's %q", inner, want)
	}
	if bad.Status().Code != codes.Error || !hasAttr(bad, "onceflow.outbox.permanent", "true") {
		t.Errorf("failed send: status %v attributes %v", bad.Status(), bad.Attributes())
	}
}

// HTTPHandler: a server span named after the matched route, continuing the caller's
// traceparent; the probes are not traced.
func TestHTTPHandlerSpans(t *testing.T) {
	rec, tp := newRecorder(t)
	mux := http.NewServeMux()
	var inHandler trace.SpanContext
	mux.HandleFunc("POST /v1/tickets", func(w http.ResponseWriter, r *http.Request) {
		inHandler = trace.SpanContextFromContext(r.Context())
		w.WriteHeader(http.StatusAccepted)
	})
	mux.HandleFunc("GET /healthz", func(http.ResponseWriter, *http.Request) {})
	h := onceflowotel.HTTPHandler(tp, mux)
	req := httptest.NewRequest("POST", "/v1/tickets", nil)
	req.Header.Set("Traceparent", parentTP)
	h.ServeHTTP(httptest.NewRecorder(), req)
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/healthz", nil))
	if n := len(rec.Ended()); n != 1 {
		t.Fatalf("%d spans, want 1 (probes untraced)", n)
	}
	s := rec.Ended()[0]
	if s.Name() != "POST /v1/tickets" || s.SpanKind() != trace.SpanKindServer || s.Parent().SpanID().String() != parentSpan {
		t.Fatalf("span %q kind %v parent %v", s.Name(), s.SpanKind(), s.Parent())
	}
	if inHandler.SpanID() != s.SpanContext().SpanID() {
		t.Fatalf("the handler's ctx holds span %v, want the server span", inHandler.SpanID())
	}
}
