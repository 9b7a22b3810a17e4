package onceflowotel_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

type TicketArgs struct {
	Subject string `json:"subject"`
}

func (TicketArgs) Kind() string { return "ticket.triage" }

// A Client whose jobs continue the trace of the request that enqueued them: the
// middleware gives each run a span, TraceParent puts the enqueuer's span in the job.
// (A real program exports spans with an OTLP exporter instead of recording them.)
func ExampleMiddleware() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	prefix := fmt.Sprintf("example%d", time.Now().UnixNano())
	defer tidy(rdb, prefix)

	done := make(chan trace.SpanContext, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[TicketArgs](func(ctx context.Context, job *onceflow.Job[TicketArgs]) error {
		done <- trace.SpanContextFromContext(ctx) // model calls and effects started from ctx are children
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{
		Redis: rdb, Prefix: prefix, Workers: workers, Logger: slog.New(slog.DiscardHandler),
		Middleware:  []onceflow.Middleware{onceflowotel.Middleware(tp)},
		TraceParent: onceflowotel.TraceParent,
	})
	if err != nil {
		panic(err)
	}

	ctx, request := tp.Tracer("app").Start(context.Background(), "POST /v1/tickets")
	if _, err := client.Enqueue(ctx, TicketArgs{Subject: "refund please"}, &onceflow.EnqueueOpts{Key: "ticket-42"}); err != nil {
		panic(err)
	}
	request.End()

	runCtx, stop := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(runCtx) }()
	inJob := <-done
	stop()
	<-stopped

	for _, s := range rec.Ended() {
		fmt.Printf("%s (same trace: %v)\n", s.Name(), s.SpanContext().TraceID() == request.SpanContext().TraceID())
	}
	fmt.Println("the worker's ctx holds the job's span:", inJob.SpanID() == rec.Ended()[1].SpanContext().SpanID())
	// Output:
	// POST /v1/tickets (same trace: true)
	// default process (same trace: true)
	// the worker's ctx holds the job's span: true
}

// A model client whose every attempt is a span, a child of the span in ctx.
func ExampleLLMClient() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	model := onceflowotel.LLMClient(tp, "openai", fake.New()) // wrap the provider's client
	_, err := model.Complete(context.Background(), &llm.Request{
		Model:    "gpt-4.1-mini",
		Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise: numbers are up."}},
	})
	if err != nil {
		panic(err)
	}
	s := rec.Ended()[0]
	fmt.Println(s.Name(), s.SpanKind())
	// Output: chat gpt-4.1-mini client
}

// An outbox sender whose sends continue the trace of the job that wrote the row; the
// webhook (here the inner sender) gets the send span's traceparent.
func ExampleSender() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	webhook := outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
		fmt.Println("Traceparent:", m.Traceparent[:35]) // 00-<trace id>: the job's trace
		return nil
	})
	sender := onceflowotel.Sender(tp, webhook)
	row := outbox.Message{ID: 1, Topic: "payments.refund", DedupeKey: "refund:order-9",
		Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"} // written by the job
	if err := sender.Send(context.Background(), row); err != nil {
		panic(err)
	}
	fmt.Println(rec.Ended()[0].Name())
	// Output:
	// Traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736
	// outbox send payments.refund
}

// A queue.Worker's handler with a span per delivery, for programs that run the queue
// package directly.
func ExampleQueueHandler() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	h := onceflowotel.QueueHandler(tp, "summaries", queue.HandlerFunc(func(context.Context, *queue.Job) error { return nil }))
	job := &queue.Job{Message: queue.Message{JobID: "job-1", TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, ID: "1-0", Deliveries: 1}
	if err := h.Handle(context.Background(), job); err != nil {
		panic(err)
	}
	s := rec.Ended()[0]
	fmt.Println(s.Name(), s.Parent().SpanID())
	// Output: summaries process 00f067aa0ba902b7
}

// TraceParent and ContextWithTraceParent carry a span across a store: what one writes,
// the other continues.
func ExampleTraceParent() {
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(context.Background())

	ctx, span := tp.Tracer("app").Start(context.Background(), "enqueue")
	stored := onceflowotel.TraceParent(ctx) // e.g. in a message field
	span.End()

	_, child := tp.Tracer("app").Start(onceflowotel.ContextWithTraceParent(context.Background(), stored), "process")
	defer child.End()
	fmt.Println(len(stored), child.SpanContext().TraceID() == span.SpanContext().TraceID())
	// Output: 55 true
}

// ContextWithTraceParent continues a trace from a stored traceparent (a message field,
// an outbox row): the next span is its child.
func ExampleContextWithTraceParent() {
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(context.Background())

	ctx := onceflowotel.ContextWithTraceParent(context.Background(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	_, span := tp.Tracer("app").Start(ctx, "send refund")
	defer span.End()
	fmt.Println(span.SpanContext().TraceID())
	// Output: 4bf92f3577b34da6a3ce929d0e0e4736
}

// A server span per request, named after the route, continuing the caller's trace.
func ExampleHTTPHandler() {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/tickets", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusAccepted) })
	srv := httptest.NewServer(onceflowotel.HTTPHandler(tp, mux))
	defer srv.Close()

	req, _ := http.NewRequest("POST", srv.URL+"/v1/tickets", nil)
	req.Header.Set("Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	srv.Close() // the span ends with the request
	s := rec.Ended()[0]
	fmt.Println(resp.StatusCode, s.Name(), s.SpanContext().TraceID())
	// Output: 202 POST /v1/tickets 4bf92f3577b34da6a3ce929d0e0e4736
}

// tidy removes the keys an example made under prefix.
func tidy(rdb *redis.Client, prefix string) {
	ctx := context.Background()
	if keys, _ := rdb.Keys(ctx, prefix+":*").Result(); len(keys) > 0 {
		rdb.Del(ctx, keys...)
	}
}
