// Package h2fault runs HTTP/2 servers over TLS that fail the way provider edges do: a
// stream reset (RST_STREAM) before the response headers or halfway through the body, a
// GOAWAY before or after the server took the request, and a server that goes silent
// until the client's ping times out. Tests drive the real provider adapters (llm/openai,
// llm/anthropic) and the job handlers against them, so the errors they classify are the
// ones net/http really returns, not hand-built look-alikes.
//
// Reset faults are served by net/http's own HTTP/2 server (httptest with EnableHTTP2):
// a handler that panics with http.ErrAbortHandler makes it reset the stream with
// INTERNAL_ERROR. GOAWAY and silence need frames net/http's server never sends on
// purpose, so those are served by a minimal server built on golang.org/x/net/http2's
// Framer. Every server counts the requests it received (Requests), as the tests assert
// effect counts.
package h2fault

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/net/http2"
)

// Fault is how a server fails one request.
type Fault int

const (
	// ResetBeforeHeaders: the handler reads the whole request, then aborts before
	// writing anything; the server resets the stream with RST_STREAM INTERNAL_ERROR.
	// The request was received: whether it was processed, the client cannot tell.
	ResetBeforeHeaders Fault = iota + 1
	// ResetMidBody: the handler runs the next handler into a buffer, sends its status,
	// headers and the first half of its body, flushes, then aborts: RST_STREAM
	// INTERNAL_ERROR while the client reads the body.
	ResetMidBody
)

// GoAway is how a GoAway server answers every request.
type GoAway int

const (
	// GoAwayUnprocessed: once the request has arrived, GOAWAY with last-stream-id 0
	// (below the request's stream) and INTERNAL_ERROR, then the connection closes. By
	// RFC 9113 section 6.8 the server did not process the request.
	GoAwayUnprocessed GoAway = iota + 1
	// GoAwayProcessed: once the request has arrived, GOAWAY NO_ERROR with the request's
	// stream as last-stream-id, then the connection closes without an answer. The
	// server may have processed the request.
	GoAwayProcessed
	// Silent: once the request has arrived, nothing more: no answer, no PING
	// acknowledgement. A client whose transport sends health-check pings
	// (http.HTTP2Config.SendPingTimeout) closes the connection with "http2: client
	// connection lost".
	Silent
)

// Server is a failing HTTP/2 server. Its methods are safe for concurrent use.
type Server struct {
	// URL is https://127.0.0.1:port, without a trailing slash.
	URL string

	ts       *httptest.Server
	requests atomic.Int64
}

// Client returns an HTTP client that trusts the server's certificate and speaks HTTP/2
// to it (a new client with its own transport on every call, so a test may change its
// settings, such as Transport.HTTP2, before the first request).
func (s *Server) Client() *http.Client {
	tr := s.ts.Client().Transport.(*http.Transport).Clone()
	tr.ForceAttemptHTTP2 = true
	return &http.Client{Transport: tr}
}

// Requests returns how many requests reached the server, failed or not.
func (s *Server) Requests() int { return int(s.requests.Load()) }

// Start serves next over HTTP/2 with TLS. Request i (counting from 0) fails with
// faults[i] while i < len(faults); later requests reach next unchanged. The server is
// closed when the test ends.
func Start(t testing.TB, next http.Handler, faults ...Fault) *Server {
	t.Helper()
	s := &Server{}
	s.ts = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.requests.Add(1) - 1
		if n >= int64(len(faults)) {
			next.ServeHTTP(w, r)
			return
		}
		switch faults[n] {
		case ResetBeforeHeaders:
			_, _ = io.Copy(io.Discard, r.Body) // the whole request arrived
			panic(http.ErrAbortHandler)
		case ResetMidBody:
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.Header().Del("Content-Length")
			w.WriteHeader(rec.Code)
			body := rec.Body.Bytes()
			_, _ = w.Write(body[:len(body)/2])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		panic("h2fault: unknown fault")
	}))
	s.ts.EnableHTTP2 = true
	s.ts.StartTLS()
	t.Cleanup(s.ts.Close)
	s.URL = s.ts.URL
	return s
}

// StartGoAway serves HTTP/2 with TLS on a minimal server that answers every request the
// way g says. The server is closed when the test ends.
func StartGoAway(t testing.TB, g GoAway) *Server {
	t.Helper()
	// The httptest server only lends its certificate and a client that trusts it.
	s := &Server{ts: httptest.NewUnstartedServer(http.NotFoundHandler())}
	s.ts.EnableHTTP2 = true
	s.ts.StartTLS()
	t.Cleanup(s.ts.Close)
	cfg := s.ts.TLS.Clone()
	cfg.NextProtos = []string{http2.NextProtoTLS}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.URL = "https://" + ln.Addr().String()

	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				s.serveRaw(c.(*tls.Conn), g)
			}()
		}
	}()
	return s
}

// serveRaw speaks just enough HTTP/2 to receive requests on c, then fails them as g
// says. It returns when the connection is done.
func (s *Server) serveRaw(c *tls.Conn, g GoAway) {
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(c, preface); err != nil || !bytes.Equal(preface, []byte(http2.ClientPreface)) {
		return
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		return
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		var ended bool
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if fr.WriteSettingsAck() != nil {
					return
				}
			}
		case *http2.HeadersFrame:
			ended = f.StreamEnded()
		case *http2.DataFrame:
			ended = f.StreamEnded()
		}
		if !ended {
			continue
		}
		s.requests.Add(1) // a whole request arrived on stream f.Header().StreamID
		switch g {
		case GoAwayUnprocessed:
			_ = fr.WriteGoAway(0, http2.ErrCodeInternal, []byte("h2fault: not processed"))
		case GoAwayProcessed:
			_ = fr.WriteGoAway(f.Header().StreamID, http2.ErrCodeNo, nil)
		case Silent:
			drain(c) // read (PINGs included) and answer nothing until the client gives up
			return
		}
		// Close our side cleanly (close_notify, FIN), so the client reads the GOAWAY
		// before the end of the connection, then wait for the client to hang up.
		_ = c.CloseWrite()
		drain(c)
		return
	}
}

// drain reads c until the peer closes it or the server is shut down.
func drain(c net.Conn) {
	buf := make([]byte, 4096)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}
