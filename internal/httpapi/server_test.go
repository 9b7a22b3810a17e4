package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// serveOn runs h on a loopback listener through ServeListener with lim until the test
// ends, and returns the address.
func serveOn(t *testing.T, lim Limits, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- ServeListener(ctx, ln, h, ServeConfig{Limits: lim, ShutdownTimeout: time.Second, Logger: slog.New(slog.DiscardHandler)})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeListener: %v", err)
		}
	})
	return ln.Addr().String()
}

// sendPartial sends a POST announcing a body of 1000 bytes and sends 10 of them; it
// returns the answer and whether the connection was closed after it.
func sendPartial(t *testing.T, addr, path string) (*http.Response, string, bool) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789", path)
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("%s: no answer: %v", path, err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	_, err = br.ReadByte()
	return resp, string(b), errors.Is(err, io.EOF)
}

// A body that misses the read deadline is answered 408 with a JSON detail naming it,
// whatever the handler does about its failed read (a handler's own 408 is kept), and
// the connection is closed. The handler's read fails with os.ErrDeadlineExceeded.
func TestLateBodyIs408WhateverTheHandlerAnswers(t *testing.T) {
	t.Parallel()
	var deadlineErrs atomic.Int32
	read := func(r *http.Request) {
		if _, err := io.ReadAll(r.Body); errors.Is(err, os.ErrDeadlineExceeded) {
			deadlineErrs.Add(1)
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/ignores", func(w http.ResponseWriter, r *http.Request) {
		read(r)
		w.Header().Set("Location", "/somewhere")
		WriteJSON(w, http.StatusCreated, map[string]string{"status": "created"})
	})
	mux.HandleFunc("/silent", func(w http.ResponseWriter, r *http.Request) { read(r) })
	mux.HandleFunc("/own408", func(w http.ResponseWriter, r *http.Request) {
		read(r)
		WriteJSON(w, http.StatusRequestTimeout, map[string]string{"detail": "request body not received within 300ms", "by": "handler"})
	})
	mux.HandleFunc("/flushes", func(w http.ResponseWriter, r *http.Request) {
		read(r)
		_ = http.NewResponseController(w).Flush()
		_, _ = io.WriteString(w, "partial")
	})
	addr := serveOn(t, Limits{ReadTimeout: 300 * time.Millisecond}, mux)
	for _, path := range []string{"/ignores", "/silent", "/flushes", "/own408"} {
		resp, body, closed := sendPartial(t, addr, path)
		var got map[string]string
		if resp.StatusCode != http.StatusRequestTimeout || json.Unmarshal([]byte(body), &got) != nil || got["detail"] != "request body not received within 300ms" {
			t.Errorf("%s: %d %q, want 408 with the detail", path, resp.StatusCode, body)
		}
		if own := got["by"] == "handler"; own != (path == "/own408") {
			t.Errorf("%s: %q: a handler's own 408 is kept, any other answer replaced", path, body)
		}
		if resp.Header.Get("Location") != "" || resp.Header.Get("Content-Type") != "application/json" || !resp.Close || !closed {
			t.Errorf("%s: headers %v, closed %v: want the 408's own headers and the connection closed", path, resp.Header, closed)
		}
	}
	if n := deadlineErrs.Load(); n != 4 {
		t.Errorf("%d handlers saw os.ErrDeadlineExceeded, want 4", n)
	}
}

// The read deadline bounds receiving the body only: a slow handler, an answer streamed
// for longer than the timeout, a handler that ignores a body sent in full, a request
// without a body and the next request on the same connection are not affected.
func TestReadTimeoutDoesNotCutAnswers(t *testing.T) {
	t.Parallel()
	const timeout = 200 * time.Millisecond
	mux := http.NewServeMux()
	mux.HandleFunc("POST /stream", func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err != nil {
			t.Errorf("read the body: %v", err)
		}
		rc := http.NewResponseController(w)
		for i := range 4 {
			time.Sleep(timeout)
			fmt.Fprintf(w, "chunk %d\n", i)
			if err := rc.Flush(); err != nil {
				t.Errorf("flush: %v", err)
			}
		}
	})
	mux.HandleFunc("POST /ignores", func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(3 * timeout)
		_, _ = io.WriteString(w, "done")
	})
	mux.HandleFunc("GET /slow", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(3 * timeout):
			_, _ = io.WriteString(w, "done")
		case <-r.Context().Done():
			t.Errorf("GET /slow: context cancelled: %v", r.Context().Err())
		}
	})
	addr := serveOn(t, Limits{ReadTimeout: timeout}, mux)
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	var reused atomic.Int32
	trace := &httptrace.ClientTrace{GotConn: func(c httptrace.GotConnInfo) {
		if c.Reused {
			reused.Add(1)
		}
	}}
	do := func(method, path string) string {
		t.Helper()
		var body io.Reader
		if method == http.MethodPost {
			body = strings.NewReader(`{"some":"body"}`)
		}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), method, "http://"+addr+path, body)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("%s %s: %d %q %v", method, path, resp.StatusCode, b, err)
		}
		return string(b)
	}
	if got := do("POST", "/stream"); got != "chunk 0\nchunk 1\nchunk 2\nchunk 3\n" {
		t.Errorf("stream: %q", got)
	}
	time.Sleep(2 * timeout) // idle on the kept-alive connection, past the last deadline
	if got := do("POST", "/ignores"); got != "done" {
		t.Errorf("ignores: %q", got)
	}
	if got := do("GET", "/slow"); got != "done" {
		t.Errorf("slow: %q", got)
	}
	if reused.Load() == 0 {
		t.Error("no request reused the kept-alive connection")
	}
}

// Headers: one larger than MaxHeaderBytes gets 431; one slower than ReadHeaderTimeout
// is disconnected without an answer.
func TestHeaderLimits(t *testing.T) {
	t.Parallel()
	addr := serveOn(t, Limits{ReadHeaderTimeout: 300 * time.Millisecond, MaxHeaderBytes: 8 << 10}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	go fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", strings.Repeat("a", 20<<10))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("a 20 KiB header: %v %v, want 431", resp, err)
	}

	slow, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	start := time.Now()
	fmt.Fprintf(slow, "GET / HTTP/1.1\r\nHost: x\r\n")
	_ = slow.SetReadDeadline(start.Add(10 * time.Second))
	got, err := io.ReadAll(slow) // nothing more is sent: the headers never end
	if err != nil || len(got) != 0 || time.Since(start) > 5*time.Second {
		t.Fatalf("slow headers: read %q, %v after %v, want the connection closed without an answer", got, err, time.Since(start))
	}
}
