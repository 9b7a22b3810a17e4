package onceflowotel_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

type greetArgs struct {
	Name string `json:"name"`
}

func (greetArgs) Kind() string { return "greet" }

type refuseArgs struct{}

func (refuseArgs) Kind() string { return "refuse" }

func newRecorder(t *testing.T) (*tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return rec, tp
}

// spansNamed returns the ended spans called name.
func spansNamed(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, a := range s.Attributes() {
		if string(a.Key) == key {
			return a.Value, true
		}
	}
	return attribute.Value{}, false
}

func hasAttr(s sdktrace.ReadOnlySpan, key, want string) bool {
	v, ok := attr(s, key)
	return ok && v.String() == want
}

// A library user's program: a Client with the otel middleware and TraceParent, jobs
// enqueued from inside a traced request. Each job's run is one consumer span, a child of
// the enqueuer's span across Redis; what the worker does from its ctx (a model call
// through LLMClient, an effect through Sender, with the traceparent an outbox row would
// carry) continues that trace. A job enqueued without a span starts a trace of its own,
// and a permanent failure is recorded on its span.
func TestMiddlewareGivesEachJobASpanContinuingTheEnqueuersTrace(t *testing.T) {
	t.Parallel()
	rec, tp := newRecorder(t)
	rdb, prefix := testenv.Redis(t)

	model := onceflowotel.LLMClient(tp, "fake", fake.New())
	var sent sync.Map // job id -> the traceparent the sender's inner sender saw
	sender := onceflowotel.Sender(tp, outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
		sent.Store(m.DedupeKey, m.Traceparent)
		return nil
	}))
	var mu sync.Mutex
	inJob := map[string]trace.SpanContext{} // job id -> the span in the worker's ctx
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[greetArgs](func(ctx context.Context, job *onceflow.Job[greetArgs]) error {
		mu.Lock()
		inJob[job.ID] = trace.SpanContextFromContext(ctx)
		mu.Unlock()
		if _, err := model.Complete(ctx, &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "Greet " + job.Args.Name}}}); err != nil {
			return err
		}
		// What an outbox row written by this job carries, relayed later.
		row := outbox.Message{ID: 1, Topic: "email.greeting", DedupeKey: job.ID, Traceparent: onceflowotel.TraceParent(ctx)}
		return sender.Send(context.Background(), row) // the relay: no span in its ctx
	}))
	onceflow.AddWorker(ws, onceflow.WorkFunc[refuseArgs](func(context.Context, *onceflow.Job[refuseArgs]) error {
		return onceflow.Permanent(errors.New("no"))
	}))
	c, err := onceflow.NewClient(onceflow.Config{
		Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t),
		Middleware:  []onceflow.Middleware{onceflowotel.Middleware(tp)},
		TraceParent: onceflowotel.TraceParent,
	})
	if err != nil {
		t.Fatal(err)
	}

	// The enqueuer: an HTTP request's span, say.
	reqCtx, request := tp.Tracer("app").Start(context.Background(), "POST /v1/greetings")
	keyed, err := c.Enqueue(reqCtx, greetArgs{Name: "Ada"}, &onceflow.EnqueueOpts{Key: "greet-ada", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := c.Enqueue(reqCtx, greetArgs{Name: "Grace"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	refused, err := c.Enqueue(reqCtx, refuseArgs{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	request.End()
	untraced, err := c.Enqueue(context.Background(), greetArgs{Name: "Linus"}, nil)
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	testenv.WaitFor(t, 10*time.Second, "four job spans and three sends", func() bool {
		n := 0
		sent.Range(func(any, any) bool { n++; return true })
		return len(spansNamed(rec, "default process")) == 4 && n == 3
	})

	jobSpans := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spansNamed(rec, "default process") {
		v, _ := attr(s, "onceflow.job_id")
		if _, dup := jobSpans[v.AsString()]; dup {
			t.Fatalf("two spans for job %s", v.AsString())
		}
		jobSpans[v.AsString()] = s
	}
	reqSC := request.SpanContext()
	for _, id := range []string{keyed.JobID, plain.JobID, refused.JobID} {
		s := jobSpans[id]
		if s == nil {
			t.Fatalf("no span for job %s", id)
		}
		if s.SpanContext().TraceID() != reqSC.TraceID() || s.Parent().SpanID() != reqSC.SpanID() || !s.Parent().IsRemote() {
			t.Errorf("job %s: span in trace %s with parent %s (remote %v), want a child of the enqueuer's %s/%s",
				id, s.SpanContext().TraceID(), s.Parent().SpanID(), s.Parent().IsRemote(), reqSC.TraceID(), reqSC.SpanID())
		}
		if s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("job %s: span kind %v", id, s.SpanKind())
		}
	}
	if s := jobSpans[untraced.JobID]; s == nil || s.Parent().IsValid() || s.SpanContext().TraceID() == reqSC.TraceID() {
		t.Errorf("job enqueued without a span: %v, want the root of a new trace", s)
	}
	ada := jobSpans[keyed.JobID]
	for k, want := range map[string]string{
		"onceflow.job_id": keyed.JobID, "onceflow.job.kind": "greet", "onceflow.tenant": "acme",
		"messaging.destination.name": "default", "messaging.message.delivery_count": "1", "messaging.system": "redis",
	} {
		if !hasAttr(ada, k, want) {
			t.Errorf("job span attribute %s: want %q in %v", k, want, ada.Attributes())
		}
	}
	if ada.Status().Code == codes.Error {
		t.Errorf("a successful job's span has status %v", ada.Status())
	}
	if no := jobSpans[refused.JobID]; no.Status().Code != codes.Error || !hasAttr(no, "onceflow.job.fate", "dead_letter") || len(no.Events()) == 0 {
		t.Errorf("permanent failure: status %v, attributes %v, events %d", no.Status(), no.Attributes(), len(no.Events()))
	}

	// Inside the job: the worker's ctx holds the job's span; the model call and the send
	// are its children (the send through the traceparent its row would carry).
	chats := spansNamed(rec, "chat gpt-4.1-mini")
	sends := spansNamed(rec, "outbox send email.greeting")
	if len(chats) != 3 || len(sends) != 3 {
		t.Fatalf("%d chat spans and %d send spans, want 3 each", len(chats), len(sends))
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range []string{keyed.JobID, plain.JobID, untraced.JobID} {
		job := jobSpans[id]
		if inJob[id].SpanID() != job.SpanContext().SpanID() {
			t.Errorf("job %s: the worker's ctx holds span %s, want the job's %s", id, inJob[id].SpanID(), job.SpanContext().SpanID())
		}
		if !slices.ContainsFunc(chats, func(s sdktrace.ReadOnlySpan) bool { return s.Parent().SpanID() == job.SpanContext().SpanID() }) {
			t.Errorf("job %s: no model-call span is a child of the job's span", id)
		}
		i := slices.IndexFunc(sends, func(s sdktrace.ReadOnlySpan) bool { return hasAttr(s, "onceflow.outbox.dedupe_key", id) })
		if i < 0 {
			t.Fatalf("job %s: no send span", id)
		}
		send := sends[i]
		if send.Parent().SpanID() != job.SpanContext().SpanID() || send.SpanContext().TraceID() != job.SpanContext().TraceID() {
			t.Errorf("job %s: send span's parent %s, want the job's %s", id, send.Parent().SpanID(), job.SpanContext().SpanID())
		}
		got, _ := sent.Load(id)
		if want := fmt.Sprintf("00-%s-%s-01", send.SpanContext().TraceID(), send.SpanContext().SpanID()); got != want {
			t.Errorf("job %s: the inner sender saw traceparent %q, want the send span's %q", id, got, want)
		}
	}
}

// Without the middleware nothing is traced and no traceparent travels: the job's message
// carries none and the worker's ctx has no span.
func TestWithoutTheMiddlewareNothingIsTraced(t *testing.T) {
	t.Parallel()
	_, tp := newRecorder(t)
	rdb, prefix := testenv.Redis(t)
	got := make(chan trace.SpanContext, 1)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[greetArgs](func(ctx context.Context, _ *onceflow.Job[greetArgs]) error {
		got <- trace.SpanContextFromContext(ctx)
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	reqCtx, span := tp.Tracer("app").Start(context.Background(), "request")
	defer span.End()
	if _, err := c.Enqueue(reqCtx, greetArgs{Name: "Ada"}, nil); err != nil {
		t.Fatal(err)
	}
	msgs, err := rdb.XRange(context.Background(), queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}.Stream(), "-", "+").Result()
	if err != nil || len(msgs) != 1 {
		t.Fatalf("stream: %v %v", msgs, err)
	}
	if tpv := msgs[0].Values["traceparent"]; tpv != nil && tpv != "" {
		t.Fatalf("message carries traceparent %v without Config.TraceParent", tpv)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	select {
	case sc := <-got:
		if sc.IsValid() {
			t.Fatalf("worker ctx holds span %v", sc)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not run")
	}
}
