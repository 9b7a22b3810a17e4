package cli

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/summaries"
)

// One trace across the queue, with the command's own wiring (deps, appClient,
// appServer) hosting the summaries workflow and the SDK's in-memory recorder: the client's traceparent → the POST's server span → (stream
// message) → the delivery's span → the model call's span, and → (outbox row) → the
// relay's send span → the webhook's Traceparent header.
func TestOneTraceFromThePOSTThroughTheQueueAndTheOutbox(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	var mu sync.Mutex
	var hooks []string
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hooks = append(hooks, r.Header.Get("Traceparent"))
		mu.Unlock()
	}))
	t.Cleanup(sink.Close)

	_, prefix := testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	cfg := config.Defaults()
	cfg.RedisURL, cfg.DatabaseURL, cfg.Prefix = testenv.RedisURL(t), dsn, prefix
	cfg.APIKeys = map[string]string{"test-key-acme-0123456789": "acme"}
	cfg.Sender, cfg.WebhookURL = "webhook", sink.URL
	cfg.RelayInterval, cfg.ShutdownTimeout = 50*time.Millisecond, 5*time.Second
	cfg.HTTPAddr = fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))

	ctx, cancel := context.WithCancel(context.Background())
	d, err := newDeps(ctx, cfg, testenv.Logger(t), true, true)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	d.tp = tp
	e := &env{app: App{Workflows: func(h Host) ([]onceflow.Workflow, error) {
		sender, err := h.Sender()
		if err != nil {
			return nil, err
		}
		return []onceflow.Workflow{summaries.Workflow(summaries.Options{Tenant: h.Tenant, Sender: sender,
			Model: h.Config.LLMModel, Logger: h.Logger, Registerer: h.Registerer})}, nil
	}}}
	c, err := d.appClient(e, true)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.appServer(c)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- runAll(ctx, d, s, cfg.HTTPAddr, func(ctx context.Context) error { return c.RunWorkers(ctx) }, c.RunRelay)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()

	// The caller is itself traced: its traceparent starts the trace.
	const clientTrace, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	var resp *http.Response
	testenv.WaitFor(t, 10*time.Second, "the API to listen", func() bool {
		req, _ := http.NewRequest("POST", "http://"+cfg.HTTPAddr+"/v1/summaries",
			bytes.NewReader([]byte(`{"text":"Quarterly numbers are up.","notify":"a@example.com"}`)))
		req.Header.Set("Authorization", "Bearer test-key-acme-0123456789")
		req.Header.Set("Idempotency-Key", "trace-test-key-0001")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Traceparent", "00-"+clientTrace+"-"+clientSpan+"-01")
		resp, err = http.DefaultClient.Do(req)
		return err == nil
	})
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("POST: %d", resp.StatusCode)
	}
	jobID := strings.TrimPrefix(resp.Header.Get("Location"), "/v1/summaries/")
	testenv.WaitFor(t, 20*time.Second, "the webhook", func() bool { mu.Lock(); defer mu.Unlock(); return len(hooks) == 1 })
	testenv.WaitFor(t, 10*time.Second, "the send span", func() bool { return findSpan(rec, "outbox send email.summary_ready") != nil })

	post := mustSpan(t, rec, "POST /v1/summaries")
	process := mustSpan(t, rec, "summaries process")
	chat := mustSpan(t, rec, "chat "+cfg.LLMModel)
	send := mustSpan(t, rec, "outbox send email.summary_ready")
	for _, sp := range []sdktrace.ReadOnlySpan{post, process, chat, send} {
		if got := sp.SpanContext().TraceID().String(); got != clientTrace {
			t.Errorf("span %q is in trace %s, want the client's %s", sp.Name(), got, clientTrace)
		}
	}
	parentOf := func(child, parent sdktrace.ReadOnlySpan, wantKind trace.SpanKind) {
		t.Helper()
		if child.Parent().SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("span %q has parent %s, want %q (%s)", child.Name(), child.Parent().SpanID(), parent.Name(), parent.SpanContext().SpanID())
		}
		if child.SpanKind() != wantKind {
			t.Errorf("span %q is %v, want %v", child.Name(), child.SpanKind(), wantKind)
		}
	}
	if post.Parent().SpanID().String() != clientSpan || post.SpanKind() != trace.SpanKindServer {
		t.Errorf("POST span: parent %s kind %v, want the client's span %s and server", post.Parent().SpanID(), post.SpanKind(), clientSpan)
	}
	parentOf(process, post, trace.SpanKindConsumer)
	parentOf(chat, process, trace.SpanKindClient)
	parentOf(send, process, trace.SpanKindProducer)
	if !hasAttr(process, "onceflow.job_id", jobID) || !hasAttr(process, "onceflow.tenant", "acme") {
		t.Errorf("process span attributes %v lack job id %s and tenant acme", process.Attributes(), jobID)
	}

	// The hops carry W3C traceparents: the outbox row holds the delivery span's, the
	// webhook request the send span's.
	var row string
	if err := pool.QueryRow(context.Background(), `SELECT traceparent FROM outbox WHERE dedupe_key = $1`, "summary_ready:"+jobID).Scan(&row); err != nil {
		t.Fatal(err)
	}
	if want := "00-" + clientTrace + "-" + process.SpanContext().SpanID().String() + "-01"; row != want {
		t.Errorf("outbox row traceparent %q, want the delivery span's %q", row, want)
	}
	mu.Lock()
	hook := hooks[0]
	mu.Unlock()
	if want := "00-" + clientTrace + "-" + send.SpanContext().SpanID().String() + "-01"; hook != want {
		t.Errorf("webhook Traceparent %q, want the send span's %q", hook, want)
	}
	for _, sp := range rec.Ended() {
		if strings.Contains(sp.Name(), "healthz") || strings.Contains(sp.Name(), "metrics") {
			t.Errorf("probe traced: %q", sp.Name())
		}
	}
}

func findSpan(rec *tracetest.SpanRecorder, name string) sdktrace.ReadOnlySpan {
	for _, sp := range rec.Ended() {
		if sp.Name() == name {
			return sp
		}
	}
	return nil
}

func mustSpan(t *testing.T, rec *tracetest.SpanRecorder, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	sp := findSpan(rec, name)
	if sp == nil {
		var names []string
		for _, s := range rec.Ended() {
			names = append(names, s.Name())
		}
		t.Fatalf("no span %q; spans: %q", name, names)
	}
	return sp
}

func hasAttr(sp sdktrace.ReadOnlySpan, key, value string) bool {
	for _, kv := range sp.Attributes() {
		if string(kv.Key) == key && kv.Value.String() == value {
			return true
		}
	}
	return false
}
