package webhook_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
	"github.com/onceflow/onceflow/retry"
)

var msg = outbox.Message{ID: 1, Topic: "email.summary_ready", DedupeKey: "summary_ready:3f2a",
	Payload: json.RawMessage(`{"job_id":"3f2a","to":"a@example.com"}`), Traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}

func newSender(t *testing.T, url string, timeout time.Duration) *webhook.Sender {
	t.Helper()
	s, err := webhook.New(webhook.Config{URL: url, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestPostsTheContractBodyWithTheDedupeKeyAsIdempotencyKey(t *testing.T) {
	t.Parallel()
	var got *http.Request
	var body []byte
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r
		body, _ = io.ReadAll(r.Body)
		w.WriteHeader(http.StatusAccepted)
	}))
	defer srv.Close()
	if err := newSender(t, srv.URL+"/hooks/x", 0).Send(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	if got.Method != http.MethodPost || got.URL.Path != "/hooks/x" || got.Header.Get("Content-Type") != "application/json" ||
		got.Header.Get("Idempotency-Key") != msg.DedupeKey || got.Header.Get("Traceparent") != msg.Traceparent {
		t.Fatalf("request %s %s headers %v", got.Method, got.URL, got.Header)
	}
	var b map[string]json.RawMessage
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatal(err)
	}
	if len(b) != 3 || string(b["topic"]) != `"email.summary_ready"` || string(b["dedupe_key"]) != `"summary_ready:3f2a"` ||
		string(b["payload"]) != string(msg.Payload) {
		t.Fatalf("body %s", body)
	}
}

func TestStatusClassification(t *testing.T) {
	t.Parallel()
	cases := []struct {
		status     int
		retryAfter string
		permanent  bool
		wait       time.Duration
	}{
		{200, "", false, 0}, {204, "", false, 0},
		{408, "", false, 0}, {409, "", false, 0}, {429, "7", false, 7 * time.Second}, {500, "", false, 0},
		{502, "", false, 0}, {503, "120", false, 2 * time.Minute}, {504, "", false, 0},
		{400, "", true, 0}, {401, "", true, 0}, {403, "", true, 0}, {404, "", true, 0}, {410, "", true, 0},
		{413, "", true, 0}, {422, "", true, 0}, {301, "", true, 0},
	}
	for _, c := range cases {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if c.retryAfter != "" {
				w.Header().Set("Retry-After", c.retryAfter)
			}
			if c.status == 301 {
				w.Header().Set("Location", "/elsewhere")
			}
			w.WriteHeader(c.status)
			_, _ = io.WriteString(w, `{"detail":"why"}`)
		}))
		err := newSender(t, srv.URL, 0).Send(context.Background(), msg)
		srv.Close()
		if c.status < 300 {
			if err != nil {
				t.Errorf("%d: %v, want sent", c.status, err)
			}
			continue
		}
		var se *webhook.StatusError
		if !errors.As(err, &se) || se.Status != c.status {
			t.Errorf("%d: error %v, want a *StatusError", c.status, err)
			continue
		}
		if retry.IsPermanent(err) != c.permanent {
			t.Errorf("%d: permanent = %v, want %v", c.status, retry.IsPermanent(err), c.permanent)
		}
		if d, _ := outbox.RetryAfterOf(err); d != c.wait {
			t.Errorf("%d: retry after %v, want %v", c.status, d, c.wait)
		}
		if !strings.Contains(err.Error(), `{"detail":"why"}`) {
			t.Errorf("%d: error %q lacks the response body", c.status, err)
		}
	}
}

func TestTimeoutsAndConnectionErrorsAreRetryable(t *testing.T) {
	t.Parallel()
	slow := httptest.NewServer(webhooksink.New(webhooksink.Options{Latency: 5 * time.Second}))
	defer slow.Close()
	start := time.Now()
	err := newSender(t, slow.URL, 100*time.Millisecond).Send(context.Background(), msg)
	if err == nil || retry.IsPermanent(err) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("slow receiver: %v, want a retryable deadline error", err)
	}
	if time.Since(start) > 4*time.Second {
		t.Fatalf("per-send timeout not applied: took %v", time.Since(start))
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now: connection refused
	err = newSender(t, "http://"+addr+"/x?token=secret-token", time.Second).Send(context.Background(), msg)
	if err == nil || retry.IsPermanent(err) {
		t.Fatalf("refused connection: %v, want a retryable error", err)
	}
	if strings.Contains(err.Error(), "secret-token") {
		t.Fatalf("error leaks the URL's token: %v", err)
	}
}

func TestADedupeKeyThatCannotBeAHeaderIsPermanent(t *testing.T) {
	t.Parallel()
	sink := webhooksink.New(webhooksink.Options{})
	srv := httptest.NewServer(sink)
	defer srv.Close()
	m := msg
	m.DedupeKey = "summary_ready:1\r\nX-Injected: 1"
	if err := newSender(t, srv.URL, 0).Send(context.Background(), m); !retry.IsPermanent(err) {
		t.Fatalf("err %v, want permanent", err)
	}
	if sink.Stats().Deliveries != 0 {
		t.Fatal("delivered anyway")
	}
}

func TestNewRejectsBadURLs(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"", "ftp://x/y", "http://", "::"} {
		if _, err := webhook.New(webhook.Config{URL: u}); err == nil {
			t.Errorf("New(%q) accepted", u)
		}
	}
}

// A payments API expects its own document: PayloadOnly posts the payload alone, with the
// dedupe key still the Idempotency-Key and the same headers as the default body.
func TestPayloadOnlyPostsJustThePayloadWithTheKey(t *testing.T) {
	t.Parallel()
	sink := webhooksink.New(webhooksink.Options{})
	var got http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Clone()
		sink.ServeHTTP(w, r)
	}))
	defer srv.Close()
	s, err := webhook.New(webhook.Config{URL: srv.URL, Body: webhook.PayloadOnly})
	if err != nil {
		t.Fatal(err)
	}
	refund := outbox.Message{ID: 7, Topic: "payments.refund", DedupeKey: "refund:t-1:order-9",
		Payload: json.RawMessage(`{"order_id":"order-9","amount_cents":1250}`)}
	if err := s.Send(context.Background(), refund); err != nil {
		t.Fatal(err)
	}
	ds := sink.Deliveries()
	if len(ds) != 1 || ds[0].Key != refund.DedupeKey || string(ds[0].Body) != string(refund.Payload) {
		t.Fatalf("deliveries %+v, want one with the payload alone as body and the dedupe key", ds)
	}
	if got.Get("Content-Type") != "application/json" || got.Get("Idempotency-Key") != refund.DedupeKey {
		t.Fatalf("headers %v", got)
	}
}

// A Body func that fails exhausts the row at once: the same message would fail again.
func TestBodyErrorIsPermanent(t *testing.T) {
	t.Parallel()
	sink := webhooksink.New(webhooksink.Options{})
	srv := httptest.NewServer(sink)
	defer srv.Close()
	s, err := webhook.New(webhook.Config{URL: srv.URL, Body: func(outbox.Message) ([]byte, error) {
		return nil, errors.New("no amount")
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(context.Background(), msg); !retry.IsPermanent(err) || !strings.Contains(err.Error(), "no amount") {
		t.Fatalf("err %v, want permanent naming the cause", err)
	}
	if sink.Stats().Deliveries != 0 {
		t.Fatal("posted anyway")
	}
}
