package httpapi

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of Limits and ServeConfig.
const (
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultReadTimeout       = 30 * time.Second
	DefaultIdleTimeout       = 2 * time.Minute
	DefaultMaxHeaderBytes    = 64 << 10
	DefaultShutdownTimeout   = 30 * time.Second
)

// Limits bound what one client can hold of a server: a connection and a goroutine, for
// as long as it takes to send its request. The zero value means every default.
//
// There is deliberately no write timeout: the gateway streams answers for minutes
// (bounded by its own upstream timeout), and the other servers' answers are small
// enough to sit in the socket buffers whether the client reads them or not.
type Limits struct {
	// ReadHeaderTimeout bounds reading a request's line and headers. A client slower
	// than that is disconnected without an answer (net/http sends none).
	// Default: DefaultReadHeaderTimeout (10s).
	ReadHeaderTimeout time.Duration
	// ReadTimeout bounds reading a request's body, counted from the end of its headers,
	// so a whole request gets ReadHeaderTimeout + ReadTimeout. A body not received by
	// then fails its Read with an error matching os.ErrDeadlineExceeded, the client is
	// answered 408 (the handler's own, or {"detail": ...} in place of whatever else the
	// handler answers), and the connection is closed. Requests without a body are not affected, nor is the time a handler takes
	// to answer. Default: DefaultReadTimeout (30s).
	ReadTimeout time.Duration
	// IdleTimeout bounds how long a kept-alive connection waits for its next request.
	// Default: DefaultIdleTimeout (2m).
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds the size of a request's line and headers (net/http allows
	// 4 KiB more); larger ones get 431. Default: DefaultMaxHeaderBytes (64 KiB).
	MaxHeaderBytes int
}

func (l Limits) withDefaults() Limits {
	l.ReadHeaderTimeout = cmp.Or(l.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	l.ReadTimeout = cmp.Or(l.ReadTimeout, DefaultReadTimeout)
	l.IdleTimeout = cmp.Or(l.IdleTimeout, DefaultIdleTimeout)
	l.MaxHeaderBytes = cmp.Or(l.MaxHeaderBytes, DefaultMaxHeaderBytes)
	return l
}

// NewHTTPServer returns the http.Server every onceflow listener runs (serve, run, the
// gateway, the metrics listeners of work and relay, fake-llm and the webhook sink): h
// behind the body read deadline, with lim's timeouts and header limit and net/http's
// errors logged to log at warning level (nil: slog.Default()).
func NewHTTPServer(h http.Handler, lim Limits, log *slog.Logger) *http.Server {
	if log == nil {
		log = slog.Default()
	}
	lim = lim.withDefaults()
	return &http.Server{
		Handler:           bodyDeadline(h, lim.ReadTimeout),
		ReadHeaderTimeout: lim.ReadHeaderTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    lim.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// ServeConfig configures Serve and ServeListener. The zero value works.
type ServeConfig struct {
	// Limits bound what one client can hold. Default: every default of Limits.
	Limits Limits
	// ShutdownTimeout bounds the graceful shutdown once ctx is cancelled.
	// Default: DefaultShutdownTimeout (30s).
	ShutdownTimeout time.Duration
	// Logger receives the lifecycle lines and net/http's errors. Default: slog.Default().
	Logger *slog.Logger
	// Ready, when not nil, receives the bound address once listening (useful with
	// port 0).
	Ready func(net.Addr)
}

// errAnsweredLate is what a handler's writes return once its answer was replaced by 408.
var errAnsweredLate = errors.New("httpapi: the request body did not arrive in time; 408 was answered instead")

// bodyDeadline bounds reading each request body to timeout from now (the end of the
// headers): a read deadline on the connection, through http.ResponseController. When
// the body does not arrive in time, the client gets 408, whatever the handler answers
// (it saw its body read fail; a reverse proxy may report the cancelled request
// instead), unless the handler's answer had already started: the handler's own 408,
// or a JSON detail naming the timeout in place of any other answer.
func bodyDeadline(h http.Handler, timeout time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		deadline := time.Now().Add(timeout)
		if err := http.NewResponseController(w).SetReadDeadline(deadline); err != nil {
			h.ServeHTTP(w, r) // a writer without deadlines (a test recorder): nothing to bound
			return
		}
		body := &timedBody{ReadCloser: r.Body, ctx: r.Context(), deadline: deadline}
		r.Body = body
		tw := &lateWriter{ResponseWriter: w, body: body, timeout: timeout}
		h.ServeHTTP(tw, r)
		tw.finish()
	})
}

// timedBody is a request body under a read deadline; it notes how its reads ended. It
// may be read on another goroutine than the handler's (a reverse proxy's transport).
type timedBody struct {
	io.ReadCloser
	ctx      context.Context
	deadline time.Time
	eof      atomic.Bool
	timedOut atomic.Bool
}

func (b *timedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == io.EOF:
		b.eof.Store(true)
	case errors.Is(err, os.ErrDeadlineExceeded):
		b.timedOut.Store(true)
	}
	return n, err
}

// late reports whether the body did not arrive by its deadline: a read failed on it,
// or the deadline has passed with the body unfinished and the request's context
// cancelled (net/http cancels it when a read fails, which can be noticed by a reverse
// proxy's handler before the failed Read returns here).
func (b *timedBody) late() bool {
	return b.timedOut.Load() || !b.eof.Load() && b.ctx.Err() != nil && !time.Now().Before(b.deadline)
}

// lateWriter passes a handler's answer on, unless the request body was late when the
// answer starts: then the client gets 408 and the handler's writes are dropped.
type lateWriter struct {
	http.ResponseWriter
	body    *timedBody
	timeout time.Duration

	mu       sync.Mutex
	started  bool // the handler's answer is going out
	replaced bool // 408 went out instead
}

// begin decides, at the handler's first write (status code, 200 when implicit),
// whether its answer goes out (true) or 408 instead (false). A handler that noticed
// the timeout and answers 408 itself keeps its own body.
func (w *lateWriter) begin(code int) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.started:
		return true
	case w.replaced:
		return false
	case w.body.late() && code == http.StatusRequestTimeout:
		w.ResponseWriter.Header().Set("Connection", "close")
	case w.body.late():
		w.replaced = true
		h := w.ResponseWriter.Header()
		for k := range h {
			delete(h, k) // the handler's headers describe its answer, not this one
		}
		h.Set("Connection", "close")
		WriteError(w.ResponseWriter, http.StatusRequestTimeout, fmt.Sprintf("request body not received within %s", w.timeout))
		return false
	}
	w.started = true
	return true
}

func (w *lateWriter) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		w.ResponseWriter.WriteHeader(code) // informational: the answer has not started
		return
	}
	if w.begin(code) {
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *lateWriter) Write(b []byte) (int, error) {
	if !w.begin(http.StatusOK) {
		return 0, errAnsweredLate
	}
	return w.ResponseWriter.Write(b)
}

// FlushError lets http.ResponseController flush through the writer (a flush starts the
// answer).
func (w *lateWriter) FlushError() error {
	if !w.begin(http.StatusOK) {
		return errAnsweredLate
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap lets http.ResponseController reach the underlying writer (deadlines, Hijack).
func (w *lateWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// finish answers 408 when the handler returned without answering and the body was late
// (net/http would send an empty 200).
func (w *lateWriter) finish() {
	w.mu.Lock()
	silent := !w.started && !w.replaced
	w.mu.Unlock()
	if silent && w.body.late() {
		w.begin(http.StatusOK)
	}
}
