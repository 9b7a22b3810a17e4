package retry_test

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/onceflow/onceflow/internal/testenv/h2fault"
	"github.com/onceflow/onceflow/retry"
)

func TestNotProcessed(t *testing.T) {
	t.Parallel()
	peer := errors.New("received from peer")
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"RST_STREAM REFUSED_STREAM", urlErr(http2.StreamError{StreamID: 3, Code: http2.ErrCodeRefusedStream, Cause: peer}), true},
		{"GOAWAY below our stream", fmt.Errorf("openai: %w", urlErr(errors.New("http2: Transport received GOAWAY from server ErrCode:INTERNAL_ERROR"))), true},
		{"graceful GOAWAY after net/http's retries", urlErr(errors.New("http2: Transport received Server's graceful shutdown GOAWAY")), true},
		{"connection unusable", urlErr(errors.New("http2: client conn not usable")), true},
		{"RST_STREAM INTERNAL_ERROR", urlErr(http2.StreamError{StreamID: 1, Code: http2.ErrCodeInternal, Cause: peer}), false},
		{"REFUSED_STREAM detected locally is not the server's word", urlErr(http2.StreamError{StreamID: 1, Code: http2.ErrCodeRefusedStream}), false},
		{"GOAWAY that covered the request", urlErr(errors.New(`http2: server sent GOAWAY and closed the connection; LastStreamID=7, ErrCode=NO_ERROR, debug=""`)), false},
		{"client connection lost", urlErr(errors.New("http2: client connection lost")), false},
		{"server closed idle connection (not claimed)", urlErr(errors.New("http: server closed idle connection")), false},
		{"unexpected EOF", fmt.Errorf("read body: %w", io.ErrUnexpectedEOF), false},
		{"marked permanent", retry.Permanent(urlErr(errors.New("http2: client conn not usable"))), false},
		{"an HTTP answer", &apiErr{status: 503}, false},
		{"unknown", errors.New("boom"), false},
	}
	for _, tc := range cases {
		if got := retry.NotProcessed(tc.err); got != tc.want {
			t.Errorf("%s: NotProcessed(%v) = %t, want %t", tc.name, tc.err, got, tc.want)
		}
	}
}

// The errors below come from net/http's own HTTP/2 client against real TLS servers
// (internal/testenv/h2fault): the types are unexported, so only real ones prove the match.

func TestClassifyRealHTTP2Failures(t *testing.T) {
	t.Parallel()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"answer":"` + strings.Repeat("x", 512) + `"}`))
	})
	post := func(c *http.Client, url string) error {
		resp, err := c.Post(url, "application/json", strings.NewReader(`{"q":1}`))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("answered over %s, want HTTP/2", resp.Proto)
		}
		_, err = io.ReadAll(resp.Body)
		return err
	}
	for _, tc := range []struct {
		name          string
		start         func(t *testing.T) *h2fault.Server
		notProcessed  bool
		wantInMessage string
	}{
		{"RST_STREAM before headers", func(t *testing.T) *h2fault.Server { return h2fault.Start(t, ok, h2fault.ResetBeforeHeaders) }, false, "INTERNAL_ERROR; received from peer"},
		{"RST_STREAM mid-body", func(t *testing.T) *h2fault.Server { return h2fault.Start(t, ok, h2fault.ResetMidBody) }, false, "INTERNAL_ERROR; received from peer"},
		{"GOAWAY below our stream", func(t *testing.T) *h2fault.Server { return h2fault.StartGoAway(t, h2fault.GoAwayUnprocessed) }, true, "received GOAWAY"},
		{"GOAWAY covering our stream, then close", func(t *testing.T) *h2fault.Server { return h2fault.StartGoAway(t, h2fault.GoAwayProcessed) }, false, "server sent GOAWAY and closed the connection"},
		{"ping timeout", func(t *testing.T) *h2fault.Server { return h2fault.StartGoAway(t, h2fault.Silent) }, false, "client connection lost"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := tc.start(t)
			c := srv.Client()
			c.Transport.(*http.Transport).HTTP2 = &http.HTTP2Config{SendPingTimeout: 100 * time.Millisecond, PingTimeout: 100 * time.Millisecond}
			err := post(c, srv.URL+"/")
			if err == nil || !strings.Contains(err.Error(), tc.wantInMessage) {
				t.Fatalf("err %v, want one mentioning %q", err, tc.wantInMessage)
			}
			assertClass(t, err, true, retry.ClassConnection)
			if got := retry.NotProcessed(err); got != tc.notProcessed {
				t.Fatalf("NotProcessed(%v) = %t, want %t", err, got, tc.notProcessed)
			}
			if srv.Requests() != 1 {
				t.Fatalf("the server saw %d requests, want 1 (net/http must not have retried on its own)", srv.Requests())
			}
		})
	}
}

// A TLS alert after the handshake: a proxy flips one bit of the first application-data
// record the client sends, the server's MAC check fails, and it answers with a
// bad_record_mac alert, which the client reads instead of a response.
func TestClassifyRealTLSAlert(t *testing.T) {
	t.Parallel()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	srv.TLS = &tls.Config{MaxVersion: tls.VersionTLS12} // TLS 1.2: handshake records are not application data
	srv.Config.ErrorLog = nil
	srv.StartTLS()
	defer srv.Close()
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
		defer c.Close()
		b, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			return
		}
		defer b.Close()
		go func() { _, _ = io.Copy(c, b) }()
		flipped := false
		for {
			hdr := make([]byte, 5)
			if _, err := io.ReadFull(c, hdr); err != nil {
				return
			}
			body := make([]byte, binary.BigEndian.Uint16(hdr[3:]))
			if _, err := io.ReadFull(c, body); err != nil {
				return
			}
			if hdr[0] == 23 && !flipped && len(body) > 0 { // application_data
				body[len(body)-1] ^= 1
				flipped = true
			}
			if _, err := b.Write(append(hdr, body...)); err != nil {
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+ln.Addr().String()+"/", strings.NewReader("x"))
	_, err = srv.Client().Do(req)
	if err == nil || !strings.Contains(err.Error(), "remote error: tls: bad record MAC") {
		t.Fatalf("err %v, want the server's bad_record_mac alert", err)
	}
	assertClass(t, err, true, retry.ClassConnection)
	if v := retry.Classify(err); !strings.Contains(v.Reason, "TLS alert") {
		t.Fatalf("reason %q does not name the TLS alert", v.Reason)
	}
}
