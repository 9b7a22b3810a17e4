package retry_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/onceflow/onceflow/retry"
)

// apiErr is a stand-in for a provider error, implementing the classification
// interfaces the way llm.APIError does. Real SDK errors are exercised in llm/openai and
// llm/anthropic; this table pins the rules themselves.
type apiErr struct {
	status      int
	typ, code   string
	after       time.Duration
	hasAfter    bool
	shouldRetry string
}

func (e *apiErr) Error() string                     { return fmt.Sprintf("api error %d %s/%s", e.status, e.typ, e.code) }
func (e *apiErr) HTTPStatus() int                   { return e.status }
func (e *apiErr) ProviderCode() (string, string)    { return e.typ, e.code }
func (e *apiErr) RetryAfter() (time.Duration, bool) { return e.after, e.hasAfter }
func (e *apiErr) ShouldRetry() (bool, bool)         { return retry.ParseShouldRetry(e.shouldRetry) }

func TestClassifyTable(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		err       error
		retryable bool
		class     retry.Class
	}{
		{"408", &apiErr{status: 408}, true, retry.ClassTimeout},
		{"409", &apiErr{status: 409}, true, retry.ClassConflict},
		{"429 rate limit", &apiErr{status: 429, typ: "requests", code: "rate_limit_exceeded"}, true, retry.ClassRateLimited},
		{"429 insufficient_quota", &apiErr{status: 429, typ: "insufficient_quota", code: "insufficient_quota"}, false, retry.ClassQuota},
		{"429 quota code only", &apiErr{status: 429, code: "insufficient_quota"}, false, retry.ClassQuota},
		{"429 anthropic spend limit", &apiErr{status: 429, typ: "rate_limit_error", code: "enforced_spend_limit_reached"}, false, retry.ClassQuota},
		{"402 billing_error", &apiErr{status: 402, typ: "billing_error"}, false, retry.ClassQuota},
		{"429 anthropic ramp limit", &apiErr{status: 429, typ: "rate_limit_error", code: "ramp_limit_exceeded"}, true, retry.ClassRateLimited},
		{"500", &apiErr{status: 500}, true, retry.ClassServerError},
		{"502", &apiErr{status: 502}, true, retry.ClassServerError},
		{"503", &apiErr{status: 503}, true, retry.ClassServerError},
		{"504", &apiErr{status: 504}, true, retry.ClassServerError},
		{"529 overloaded", &apiErr{status: 529, typ: "overloaded_error"}, true, retry.ClassServerError},
		{"599", &apiErr{status: 599}, true, retry.ClassServerError},
		{"5xx with quota words stays retryable", &apiErr{status: 503, code: "insufficient_quota"}, true, retry.ClassServerError},
		{"400 context length", &apiErr{status: 400, typ: "invalid_request_error", code: "context_length_exceeded"}, false, retry.ClassClientError},
		{"401", &apiErr{status: 401}, false, retry.ClassClientError},
		{"403", &apiErr{status: 403}, false, retry.ClassClientError},
		{"404", &apiErr{status: 404}, false, retry.ClassClientError},
		{"422", &apiErr{status: 422}, false, retry.ClassClientError},
		{"x-should-retry true wins over 400", &apiErr{status: 400, shouldRetry: "true"}, true, retry.ClassClientError},
		{"x-should-retry false wins over 503", &apiErr{status: 503, shouldRetry: "false"}, false, retry.ClassServerError},
		{"x-should-retry true wins over quota", &apiErr{status: 429, code: "insufficient_quota", shouldRetry: "true"}, true, retry.ClassQuota},
		{"x-should-retry garbage is ignored", &apiErr{status: 503, shouldRetry: "maybe"}, true, retry.ClassServerError},
		{"stream error event overloaded (status 200)", &apiErr{status: 200, typ: "overloaded_error"}, true, retry.ClassServerError},
		{"stream error event server_error", &apiErr{typ: "server_error"}, true, retry.ClassServerError},
		{"stream error event invalid request", &apiErr{typ: "invalid_request_error"}, false, retry.ClassUnknown},
		{"wrapped 429", fmt.Errorf("call model: %w", &apiErr{status: 429}), true, retry.ClassRateLimited},
		{"permanent 503", retry.Permanent(&apiErr{status: 503}), false, retry.ClassPermanent},
		{"permanent wrapped deeper", fmt.Errorf("x: %w", retry.Permanent(io.ErrUnexpectedEOF)), false, retry.ClassPermanent},
		{"deadline", &retry.DeadlineExceededError{Err: &apiErr{status: 429}}, false, retry.ClassDeadline},
		{"deadline wrapping a timeout", &retry.DeadlineExceededError{Err: context.DeadlineExceeded}, false, retry.ClassDeadline},
		{"canceled", fmt.Errorf("x: %w", context.Canceled), false, retry.ClassCanceled},
		{"attempt timeout", &retry.AttemptTimeoutError{Limit: time.Second, Err: errors.New("read body")}, true, retry.ClassTimeout},
		{"bare context deadline (per-call)", fmt.Errorf("post: %w", context.DeadlineExceeded), true, retry.ClassTimeout},
		{"exhausted keeps inner class", &retry.ExhaustedError{Attempts: 4, Err: &apiErr{status: 503}}, true, retry.ClassServerError},
		{"ECONNRESET", &net.OpError{Op: "read", Err: &osSyscallError{syscall.ECONNRESET}}, true, retry.ClassConnection},
		{"ECONNREFUSED", fmt.Errorf("dial: %w", syscall.ECONNREFUSED), true, retry.ClassConnection},
		{"EPIPE", fmt.Errorf("write: %w", syscall.EPIPE), true, retry.ClassConnection},
		{"DNS", &net.DNSError{Err: "no such host", Name: "x.invalid", IsNotFound: true}, true, retry.ClassConnection},
		{"unexpected EOF", fmt.Errorf("read body: %w", io.ErrUnexpectedEOF), true, retry.ClassConnection},
		// HTTP/2 and HTTP/1 protocol failures: x/net's types and net/http's messages
		// (its bundled HTTP/2 types are unexported); the real net/http errors are
		// produced by servers in TestClassifyRealHTTP2Failures.
		{"h2 RST_STREAM INTERNAL_ERROR (x/net)", urlErr(http2.StreamError{StreamID: 1, Code: http2.ErrCodeInternal, Cause: errors.New("received from peer")}), true, retry.ClassConnection},
		{"h2 RST_STREAM REFUSED_STREAM (x/net)", urlErr(http2.StreamError{StreamID: 3, Code: http2.ErrCodeRefusedStream, Cause: errors.New("received from peer")}), true, retry.ClassConnection},
		{"h2 local stream error (x/net)", urlErr(http2.StreamError{StreamID: 3, Code: http2.ErrCodeProtocol}), true, retry.ClassConnection},
		{"h2 GOAWAY then closed", urlErr(errors.New(`http2: server sent GOAWAY and closed the connection; LastStreamID=5, ErrCode=NO_ERROR, debug=""`)), true, retry.ClassConnection},
		{"h2 connection error (x/net)", urlErr(http2.ConnectionError(http2.ErrCodeProtocol)), true, retry.ClassConnection},
		{"h2 GOAWAY below our stream", urlErr(errors.New("http2: Transport received GOAWAY from server ErrCode:ENHANCE_YOUR_CALM")), true, retry.ClassConnection},
		{"h2 graceful GOAWAY after net/http's retries", urlErr(errors.New("http2: Transport received Server's graceful shutdown GOAWAY")), true, retry.ClassConnection},
		{"h2 client connection lost", fmt.Errorf("openai: %w", urlErr(errors.New("http2: client connection lost"))), true, retry.ClassConnection},
		{"h2 cannot retry after the body was written", urlErr(errors.New("http2: Transport: cannot retry err [http2: Transport received Server's graceful shutdown GOAWAY] after Request.Body was written; define Request.GetBody to avoid this error")), true, retry.ClassConnection},
		{"h1 transport connection broken", urlErr(fmt.Errorf("net/http: HTTP/1.x transport connection broken: %w", errors.New("http: persistConn.readLoop exiting"))), true, retry.ClassConnection},
		{"h1 server closed idle connection", urlErr(errors.New("http: server closed idle connection")), true, retry.ClassConnection},
		{"TLS alert from the peer", urlErr(&net.OpError{Op: "remote error", Err: tls.AlertError(20)}), true, retry.ClassConnection},
		{"reset while reading the body", fmt.Errorf("error reading response body: %w", &net.OpError{Op: "read", Net: "tcp", Err: &osSyscallError{syscall.ECONNRESET}}), true, retry.ClassConnection},
		{"joined errors are searched", errors.Join(errors.New("first"), errors.New("http2: client connection lost")), true, retry.ClassConnection},
		// ... and what merely quotes them is still unknown: the match is on the error
		// net/http created, not on text anywhere in a message.
		{"a decode error quoting an h2 message", fmt.Errorf("decode summary %q: %w", "http2: client connection lost", &jsonLikeError{}), false, retry.ClassUnknown},
		{"connection error that is not an h2 code", errors.New("connection error: the database is down"), false, retry.ClassUnknown},
		{"plain io.EOF is not a transport error", io.EOF, false, retry.ClassUnknown},
		{"unknown", errors.New("boom"), false, retry.ClassUnknown},
		{"json syntax error", fmt.Errorf("decode: %w", &jsonLikeError{}), false, retry.ClassUnknown},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v := retry.Classify(tc.err)
			if v.Retryable != tc.retryable || v.Class != tc.class {
				t.Fatalf("Classify(%v) = {retryable %t, class %s, reason %q}, want {retryable %t, class %s}",
					tc.err, v.Retryable, v.Class, v.Reason, tc.retryable, tc.class)
			}
			if v.Reason == "" {
				t.Errorf("empty reason")
			}
			if !strings.Contains(strings.Join(classNames(), ","), string(v.Class)) {
				t.Errorf("class %q is not in Classes()", v.Class)
			}
		})
	}
}

func urlErr(err error) error {
	return &url.Error{Op: "Post", URL: "https://api.example.com/v1/chat/completions", Err: err}
}

type osSyscallError struct{ err error }

func (e *osSyscallError) Error() string { return "syscall: " + e.err.Error() }
func (e *osSyscallError) Unwrap() error { return e.err }

type jsonLikeError struct{}

func (*jsonLikeError) Error() string { return "invalid character 'x' looking for beginning of value" }

func classNames() []string {
	var out []string
	for _, c := range retry.Classes() {
		out = append(out, string(c))
	}
	return out
}

func TestClassifyNil(t *testing.T) {
	t.Parallel()
	if v := retry.Classify(nil); v != (retry.Verdict{}) {
		t.Fatalf("Classify(nil) = %+v", v)
	}
	if retry.Transient(nil) {
		t.Fatal("Transient(nil)")
	}
}

func TestClassifyCarriesRetryAfter(t *testing.T) {
	t.Parallel()
	v := retry.Classify(fmt.Errorf("wrapped: %w", &apiErr{status: 429, after: 3 * time.Second, hasAfter: true}))
	if !v.HasRetryAfter || v.RetryAfter != 3*time.Second {
		t.Fatalf("verdict %+v, want Retry-After 3s", v)
	}
	v = retry.Classify(&apiErr{status: 429, after: -time.Second, hasAfter: true})
	if v.HasRetryAfter {
		t.Fatalf("negative Retry-After kept: %+v", v)
	}
	v = retry.Classify(&retry.DeadlineExceededError{Err: &apiErr{status: 429, after: time.Second, hasAfter: true}})
	if v.HasRetryAfter {
		t.Fatalf("a deadline verdict carries Retry-After: %+v", v)
	}
}

func TestClassifyStatus(t *testing.T) {
	t.Parallel()
	for status := 100; status <= 599; status++ {
		v := retry.ClassifyStatus(status)
		want := status == 408 || status == 409 || status == 429 || status >= 500
		if v.Retryable != want {
			t.Errorf("ClassifyStatus(%d).Retryable = %t, want %t", status, v.Retryable, want)
		}
		if status >= 400 && status < 500 && !want && v.Class != retry.ClassClientError {
			t.Errorf("ClassifyStatus(%d).Class = %s, want client_error", status, v.Class)
		}
	}
}

func TestStatusErrorFromHeaders(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	h := http.Header{}
	h.Set("Retry-After", "7")
	h.Set("X-Should-Retry", "false")
	err := retry.NewStatusError(503, h, now)
	v := retry.Classify(err)
	if v.Retryable || v.Class != retry.ClassServerError || !v.HasRetryAfter || v.RetryAfter != 7*time.Second {
		t.Fatalf("verdict %+v", v)
	}
	if !retry.Transient(&retry.ExhaustedError{Attempts: 2, Err: retry.NewStatusError(429, http.Header{}, now)}) {
		t.Fatal("an exhausted 429 is not transient")
	}
	if retry.Transient(retry.NewStatusError(400, http.Header{}, now)) {
		t.Fatal("a 400 is transient")
	}
	if !retry.Transient(&retry.DeadlineExceededError{}) || !retry.Transient(context.Canceled) {
		t.Fatal("deadline and cancellation must be transient for the queue")
	}
}

// The network errors below are real: produced by the standard library against servers
// on this machine, not built by hand.

func TestClassifyRealConnectionRefused(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	_, err = http.Get("http://" + addr + "/")
	assertClass(t, err, true, retry.ClassConnection)
}

func TestClassifyRealConnectionReset(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		buf := make([]byte, 1024)
		_, _ = c.Read(buf)                // wait for the request
		_ = c.(*net.TCPConn).SetLinger(0) // close with RST
		_ = c.Close()
	}()
	_, err = http.Post("http://"+ln.Addr().String()+"/", "text/plain", strings.NewReader("x"))
	assertClass(t, err, true, retry.ClassConnection)
}

func TestClassifyRealDNSFailure(t *testing.T) {
	t.Parallel()
	// A resolver whose DNS server cannot be reached: the lookup fails with a real
	// *net.DNSError without sending a packet anywhere.
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, address string) (net.Conn, error) {
		return nil, errors.New("no DNS server in this test")
	}}
	d := &net.Dialer{Resolver: r}
	client := &http.Client{Transport: &http.Transport{DialContext: d.DialContext}}
	_, err := client.Get("http://model.example.invalid/")
	var dns *net.DNSError
	if !errors.As(err, &dns) {
		t.Fatalf("want a *net.DNSError, got %T %v", err, err)
	}
	assertClass(t, err, true, retry.ClassConnection)
}

func TestClassifyRealTLSHandshakeTimeout(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	defer close(done)
	go func() { // accept and never speak TLS
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { <-done; c.Close() }()
		}
	}()
	client := &http.Client{Transport: &http.Transport{TLSHandshakeTimeout: 100 * time.Millisecond}}
	_, err = client.Get("https://" + ln.Addr().String() + "/")
	if err == nil || !strings.Contains(err.Error(), "TLS handshake timeout") {
		t.Fatalf("want a TLS handshake timeout, got %v", err)
	}
	assertClass(t, err, true, retry.ClassTimeout)
}

func TestClassifyRealTruncatedBody(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "100")
		_, _ = w.Write([]byte(`{"partial":`))
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // close the connection mid-body
	}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	assertClass(t, err, true, retry.ClassConnection)
}

func TestClassifyRealServerClosedWithoutResponse(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		panic(http.ErrAbortHandler) // no status line at all
	}))
	defer srv.Close()
	_, err := http.Post(srv.URL, "text/plain", strings.NewReader("x"))
	assertClass(t, err, true, retry.ClassConnection)
}

func TestClassifyRealClientTimeout(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	client := &http.Client{Timeout: 50 * time.Millisecond}
	_, err := client.Get(srv.URL)
	assertClass(t, err, true, retry.ClassTimeout)

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	_, err = http.DefaultClient.Do(req)
	assertClass(t, err, true, retry.ClassTimeout)
}

func assertClass(t *testing.T, err error, retryable bool, class retry.Class) {
	t.Helper()
	if err == nil {
		t.Fatal("want an error, got nil")
	}
	v := retry.Classify(err)
	if v.Retryable != retryable || v.Class != class {
		t.Fatalf("Classify(%T %v) = {retryable %t, class %s, %q}, want {retryable %t, class %s}",
			err, err, v.Retryable, v.Class, v.Reason, retryable, class)
	}
}

func TestIsQuotaRecognisesQuotaCodesNotRateLimits(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"insufficient_quota", "INSUFFICIENT_QUOTA", "billing_hard_limit_reached", "contract_spend_limit_reached", "daily_quota_exceeded", "billing_error"} {
		if !retry.IsQuota("", s) || !retry.IsQuota(s, "") {
			t.Errorf("IsQuota(%q) = false", s)
		}
	}
	for _, s := range []string{"", "rate_limit_exceeded", "requests", "tokens", "rate_limit_error", "ramp_limit_exceeded"} {
		if retry.IsQuota(s, s) {
			t.Errorf("IsQuota(%q) = true", s)
		}
	}
}

// An exhausted quota and an unavailable dependency are not retried in-process, are
// transient for the queue, and are outages: the job did not fail, the provider did.
// Other failures are not outages.
func TestQuotaAndUnavailableAreOutages(t *testing.T) {
	t.Parallel()
	quota := &apiErr{status: 429, typ: "insufficient_quota", code: "insufficient_quota"}
	unavailable := fmt.Errorf("model: %w", retry.ErrUnavailable)
	for _, err := range []error{quota, unavailable, &retry.ExhaustedError{Attempts: 1, Err: quota}} {
		v := retry.Classify(err)
		if v.Retryable || !retry.Transient(err) || !retry.Outage(err) {
			t.Errorf("%v: verdict %+v, transient %t, outage %t; want not retryable, transient, outage", err, v, retry.Transient(err), retry.Outage(err))
		}
	}
	if c := retry.Classify(unavailable).Class; c != retry.ClassUnavailable {
		t.Errorf("class of ErrUnavailable = %s", c)
	}
	for _, err := range []error{nil, &apiErr{status: 429}, &apiErr{status: 400}, &retry.DeadlineExceededError{}, errors.New("bug")} {
		if retry.Outage(err) {
			t.Errorf("Outage(%v) = true", err)
		}
	}
	if !slices.Contains(retry.Classes(), retry.ClassUnavailable) {
		t.Error("Classes lacks ClassUnavailable")
	}
}
