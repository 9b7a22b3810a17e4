package openai_test

// HTTP/2 failures from a provider's edge, through the real SDK over TLS: a stream reset
// (RST_STREAM INTERNAL_ERROR) before the headers or halfway through the body, a GOAWAY
// below or covering the request's stream, and a connection whose pings go unanswered.
// Each is retryable; whether it is ambiguous for the ledger depends on whether the
// server may have processed the request.

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv/h2fault"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

// h2Client is the adapter pointed at srv, over HTTP/2, with health-check pings short
// enough for the silent server to be noticed within a test.
func h2Client(srv *h2fault.Server) *openai.Client {
	hc := srv.Client()
	hc.Transport.(*http.Transport).HTTP2 = &http.HTTP2Config{SendPingTimeout: 100 * time.Millisecond, PingTimeout: 100 * time.Millisecond}
	return openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "sk-test-not-a-real-key", HTTPClient: hc})
}

func call(c llm.Client, stream bool) func(ctx context.Context) (*llm.Response, error) {
	return func(ctx context.Context) (*llm.Response, error) {
		if stream {
			return llm.Collect(c.Stream(ctx, summarise("job-h2")))
		}
		return c.Complete(ctx, summarise("job-h2"))
	}
}

// assertTransportFailure checks what the job handler and the ledger decide from err.
func assertTransportFailure(t *testing.T, err error, ambiguous bool) {
	t.Helper()
	if v := retry.Classify(err); !v.Retryable || v.Class != retry.ClassConnection {
		t.Fatalf("Classify(%v) = %+v, want a retryable connection error", err, v)
	}
	if got := ledger.IsAmbiguous(err); got != ambiguous {
		t.Fatalf("ledger.IsAmbiguous(%v) = %t, want %t", err, got, ambiguous)
	}
	if got := retry.NotProcessed(err); got == ambiguous {
		t.Fatalf("retry.NotProcessed(%v) = %t, want %t", err, got, !ambiguous)
	}
}

func TestHTTP2StreamResetIsRetried(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		fault  h2fault.Fault
		stream bool
	}{
		{"reset before headers", h2fault.ResetBeforeHeaders, false},
		{"reset mid-body", h2fault.ResetMidBody, false},
		{"stream reset before headers", h2fault.ResetBeforeHeaders, true},
		{"stream reset mid-body", h2fault.ResetMidBody, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			srv := h2fault.Start(t, fs, tc.fault, tc.fault) // two requests fail, later ones reach fake-llm
			c := h2Client(srv)

			_, err = call(c, tc.stream)(context.Background())
			assertTransportFailure(t, err, true) // the request arrived: it may have been processed

			var retries []retry.Retry
			p := retry.Policy{Clock: retrytest.NewClock(t0), OnRetry: func(r retry.Retry) { retries = append(retries, r) }}
			resp, err := retry.Do(context.Background(), p, retry.After(time.Minute), call(c, tc.stream))
			if err != nil || resp.Content == "" {
				t.Fatalf("Do: %+v, %v: the retry after the reset should have succeeded", resp, err)
			}
			if len(retries) != 1 || retries[0].Class != retry.ClassConnection {
				t.Fatalf("retries %+v, want one connection retry", retries)
			}
			if srv.Requests() != 3 {
				t.Fatalf("the server saw %d requests, want 3 (the lone call, the reset attempt and its retry)", srv.Requests())
			}
		})
	}
}

func TestHTTP2GoAwayAndLostConnectionAreRetried(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		g         h2fault.GoAway
		ambiguous bool
	}{
		{"GOAWAY below the request's stream: not processed", h2fault.GoAwayUnprocessed, false},
		{"GOAWAY covering the request, then close", h2fault.GoAwayProcessed, true},
		{"pings unanswered: connection lost", h2fault.Silent, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := h2fault.StartGoAway(t, tc.g)
			var retries []retry.Retry
			p := retry.Policy{MaxAttempts: 2, Clock: retrytest.NewClock(t0), OnRetry: func(r retry.Retry) { retries = append(retries, r) }}
			_, err := retry.Do(context.Background(), p, retry.After(time.Minute), call(h2Client(srv), false))
			var ex *retry.ExhaustedError
			if !errors.As(err, &ex) || ex.Attempts != 2 || !retry.Transient(err) {
				t.Fatalf("err %v, want ExhaustedError after 2 attempts (transient: the queue redelivers)", err)
			}
			assertTransportFailure(t, err, tc.ambiguous)
			if len(retries) != 1 || srv.Requests() != 2 {
				t.Fatalf("%d retries, %d requests: want 1 retry and 2 requests", len(retries), srv.Requests())
			}
		})
	}
}
