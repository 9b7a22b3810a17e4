package cli

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/onceflow/onceflow/internal/testenv"
)

// collectedSpan is one span a fakeCollector received.
type collectedSpan struct {
	name, trace, id, parent, pid string
}

// fakeCollector is an OTLP/HTTP trace receiver (POST /v1/traces, protobuf), the wire
// format a real collector speaks.
type fakeCollector struct {
	mu    sync.Mutex
	spans []collectedSpan
	auth  []string // Authorization headers seen
}

func (c *fakeCollector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var req coltrace.ExportTraceServiceRequest
	if r.URL.Path != "/v1/traces" || proto.Unmarshal(body, &req) != nil {
		http.Error(w, "bad export", http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	c.auth = append(c.auth, r.Header.Get("Authorization"))
	for _, rs := range req.GetResourceSpans() {
		pid := ""
		for _, a := range rs.GetResource().GetAttributes() {
			if a.GetKey() == "process.pid" {
				pid = fmt.Sprint(a.GetValue().GetIntValue())
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				c.spans = append(c.spans, collectedSpan{name: sp.GetName(), trace: hex.EncodeToString(sp.GetTraceId()),
					id: hex.EncodeToString(sp.GetSpanId()), parent: hex.EncodeToString(sp.GetParentSpanId()), pid: pid})
			}
		}
	}
	c.mu.Unlock()
	out, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (c *fakeCollector) find(name string) (collectedSpan, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.spans {
		if s.name == name {
			return s, true
		}
	}
	return collectedSpan{}, false
}

// Tracing switched on by the standard variable, across three real processes: serve,
// work and relay each export their spans over OTLP/HTTP to a collector, and the spans
// form one trace because the traceparent travels in the stream message and the outbox
// row. The exporter's headers (a credential) reach the collector.
func TestServeWorkRelayExportOneTraceOverOTLP(t *testing.T) {
	t.Parallel()
	col := &fakeCollector{}
	colSrv := httptest.NewServer(col)
	t.Cleanup(colSrv.Close)
	sink := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(sink.Close)

	_, prefix := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		testAPIKeys, "ONCEFLOW_SHUTDOWN_TIMEOUT=5s", "ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + sink.URL,
		"ONCEFLOW_RELAY_INTERVAL=50ms", "ONCEFLOW_HTTP_ADDR=127.0.0.1:0",
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + colSrv.URL, "OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer collector-token",
		"OTEL_BSP_SCHEDULE_DELAY=100"}
	bin := testenv.Binary(t)
	serve := testenv.Start(t, bin, env, "serve")
	work := testenv.Start(t, bin, env, "work")
	relay := testenv.Start(t, bin, env, "relay")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	base := "http://" + fmt.Sprint(serve.WaitLog(ctx, "http listening")["addr"])
	for _, p := range []*testenv.Process{serve, work, relay} {
		if l := p.WaitLog(ctx, "tracing on: OTLP over HTTP"); l["endpoint"] != colSrv.URL+"/v1/traces" {
			t.Errorf("tracing endpoint logged as %v", l["endpoint"])
		}
	}
	work.WaitLog(ctx, "worker started")

	req, _ := http.NewRequest("POST", base+"/v1/summaries", bytes.NewReader([]byte(`{"text":"hello","notify":"a@example.com"}`)))
	req.Header.Set("Authorization", "Bearer test-key-acme-0123456789")
	req.Header.Set("Idempotency-Key", "otlp-test-key-000001")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("POST: %d", resp.StatusCode)
	}
	testenv.WaitFor(t, 30*time.Second, "the send span at the collector", func() bool {
		_, ok := col.find("outbox send email.summary_ready")
		return ok
	})
	for _, p := range []*testenv.Process{serve, work, relay} {
		p.Signal(syscall.SIGTERM)
		if code := p.Wait(20 * time.Second); code != 0 {
			t.Errorf("exit %d after SIGTERM", code)
		}
	}

	post, _ := col.find("POST /v1/summaries")
	process, _ := col.find("summaries process")
	chat, _ := col.find("chat gpt-4.1-mini")
	send, _ := col.find("outbox send email.summary_ready")
	if post.id == "" || process.id == "" || chat.id == "" {
		t.Fatalf("spans missing at the collector: %+v", col.spans)
	}
	if process.parent != post.id || chat.parent != process.id || send.parent != process.id {
		t.Errorf("parents: process %s (want %s), chat %s (want %s), send %s (want %s)",
			process.parent, post.id, chat.parent, process.id, send.parent, process.id)
	}
	if post.trace != process.trace || process.trace != send.trace || chat.trace != post.trace {
		t.Errorf("not one trace: %s %s %s %s", post.trace, process.trace, chat.trace, send.trace)
	}
	if post.pid == process.pid || process.pid == send.pid {
		t.Errorf("spans from pids %s, %s, %s: want three processes", post.pid, process.pid, send.pid)
	}
	col.mu.Lock()
	defer col.mu.Unlock()
	for _, a := range col.auth {
		if a != "Bearer collector-token" {
			t.Errorf("export carried Authorization %q", a)
		}
	}
	for _, p := range []*testenv.Process{serve, work, relay} {
		if strings.Contains(p.Stderr(), "collector-token") {
			t.Errorf("the exporter's credential is in the logs")
		}
	}
}

// The OpenTelemetry variables are settings like the others: a bad one stops the process
// at start with exit 2 and a line naming it, never echoing a secret.
func TestBadTracingVariablesExit2(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	for _, tc := range []struct{ env, name string }{
		{"OTEL_EXPORTER_OTLP_ENDPOINT=collector:4318", "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{"OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{"OTEL_EXPORTER_OTLP_HEADERS=token hunter2-secret", "OTEL_EXPORTER_OTLP_HEADERS"},
	} {
		for _, cmd := range []string{"serve", "work", "relay", "run"} {
			p := testenv.Start(t, bin, []string{tc.env, testAPIKeys}, cmd)
			if code := p.Wait(10 * time.Second); code != 2 {
				t.Errorf("%s with %s: exit %d, want 2", cmd, tc.env, code)
			}
			if !strings.Contains(p.Stderr(), "invalid "+tc.name) || strings.Count(strings.TrimSpace(p.Stderr()), "\n") != 0 {
				t.Errorf("%s with %s: stderr %q, want one line naming %s", cmd, tc.env, p.Stderr(), tc.name)
			}
			if strings.Contains(p.Stderr(), "hunter2") {
				t.Errorf("%s: a header value is echoed: %s", cmd, p.Stderr())
			}
		}
	}
}
