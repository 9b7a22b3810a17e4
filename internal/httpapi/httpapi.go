// Package httpapi is the HTTP side of `onceflow serve`: routing, the health and
// readiness endpoints, /metrics, request metrics, JSON errors and the server lifecycle.
// Feature packages add their routes with Handle.
package httpapi

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/internal/metrics"
)

// DefaultReadyTimeout bounds each dependency check of /readyz.
const DefaultReadyTimeout = time.Second

// Check reports whether a dependency answers; a nil error means ready, and an error
// wrapped with Degraded is reported without failing readiness.
type Check func(ctx context.Context) error

// ErrDegraded is matched by the errors Degraded returns.
var ErrDegraded = errors.New("degraded")

// Degraded marks a Check's error as one /readyz reports but does not fail on: the
// process still does its main work (the API accepts jobs) while the dependency is
// unusable, as when the model provider's quota is exhausted and workers hold their
// jobs. Degraded(nil) is nil.
func Degraded(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrDegraded, err)
}

// Config configures a Server.
type Config struct {
	// Logger receives request errors. Default: slog.Default().
	Logger *slog.Logger
	// Registry is both where the server registers its metrics and what /metrics serves.
	// Default: a new registry.
	Registry *prometheus.Registry
	// Checks are the dependencies /readyz reports, by name ("redis", "postgres").
	Checks map[string]Check
	// ReadyTimeout bounds each check. Default: DefaultReadyTimeout.
	ReadyTimeout time.Duration
}

// Server routes onceflow's HTTP API. It is an http.Handler; use Handle to add routes
// before serving.
type Server struct {
	cfg     Config
	log     *slog.Logger
	mux     *http.ServeMux
	metrics *httpMetrics
	// routes are the routes Mount added, consulted after mux; nil before.
	routes *http.ServeMux
}

// New returns a Server with /healthz, /readyz and /metrics routed.
func New(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = DefaultReadyTimeout
	}
	s := &Server{cfg: cfg, log: cfg.Logger, mux: http.NewServeMux(), metrics: newHTTPMetrics(cfg.Registry)}
	s.Handle("GET /healthz", "/healthz", http.HandlerFunc(s.healthz))
	s.Handle("GET /readyz", "/readyz", http.HandlerFunc(s.readyz), http.StatusOK, http.StatusServiceUnavailable)
	s.Handle("GET /metrics", "/metrics", promhttp.HandlerFor(cfg.Registry, promhttp.HandlerOpts{Registry: cfg.Registry}))
	return s
}

// Handle routes pattern (net/http syntax, "POST /v1/summaries") to h and counts its
// requests under the label route, which must be a fixed string such as
// "/v1/summaries/{job_id}" so label values stay bounded. codes are the statuses the
// route answers; their series are created at zero now, so they are visible before the
// first request (none given: 200). Other codes are counted all the same.
func (s *Server) Handle(pattern, route string, h http.Handler, codes ...int) {
	if len(codes) == 0 {
		codes = []int{http.StatusOK}
	}
	for _, c := range codes {
		s.metrics.requests.WithLabelValues(route, strconv.Itoa(c))
	}
	s.mux.Handle(pattern, s.metrics.instrument(route, h))
}

// Mount serves the routes of mux (a program's workflows', which register on a mux of
// their own) beside the server's: each request is counted under the path of the pattern
// it matched ("GET /v1/summaries/{job_id}" under the route "/v1/summaries/{job_id}"), so
// label values stay bounded. The routes of Handle win. Call it at most once, before
// serving.
func (s *Server) Mount(mux *http.ServeMux) { s.routes = mux }

// Statuses creates at zero the series of the statuses a mounted route answers (pattern
// as it was registered on Mount's mux, "POST /v1/summaries"), as Handle does for its
// codes, so they are visible before the first request.
func (s *Server) Statuses(pattern string, codes ...int) {
	for _, c := range codes {
		s.metrics.requests.WithLabelValues(routeLabel(pattern), strconv.Itoa(c))
	}
}

// ServeHTTP implements http.Handler. A request no route matches is answered like every
// other error, {"detail": ...} in JSON (404, or 405 with Allow), not with net/http's
// text/plain.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, pattern := s.mux.Handler(r); pattern != "" {
		s.mux.ServeHTTP(w, r)
		return
	}
	if s.routes != nil {
		if _, pattern := s.routes.Handler(r); pattern != "" {
			// ServeHTTP, not the handler Handler returned: it sets the path values.
			s.metrics.instrument(routeLabel(pattern), s.routes).ServeHTTP(w, r)
			return
		}
	}
	// Only to learn the status and Allow net/http would send: a method another route
	// of the path has is 405.
	rec := &unrouted{header: http.Header{}}
	s.mux.ServeHTTP(rec, r)
	if s.routes != nil && cmp.Or(rec.status, http.StatusNotFound) == http.StatusNotFound {
		rec = &unrouted{header: http.Header{}}
		s.routes.ServeHTTP(rec, r)
	}
	if allow := rec.header.Get("Allow"); allow != "" {
		w.Header().Set("Allow", allow)
	}
	code := cmp.Or(rec.status, http.StatusNotFound)
	WriteError(w, code, strings.ToLower(http.StatusText(code)))
}

// routeLabel returns the route label of a ServeMux pattern, "[METHOD ][HOST]/PATH": its
// path.
func routeLabel(pattern string) string {
	if method, rest, ok := strings.Cut(pattern, " "); ok && !strings.Contains(method, "/") {
		pattern = strings.TrimLeft(rest, " \t")
	}
	if i := strings.IndexByte(pattern, '/'); i > 0 {
		pattern = pattern[i:]
	}
	return pattern
}

// unrouted records the status and headers of net/http's answer to an unmatched request.
type unrouted struct {
	header http.Header
	status int
}

func (u *unrouted) Header() http.Header         { return u.header }
func (u *unrouted) Write(b []byte) (int, error) { return len(b), nil }
func (u *unrouted) WriteHeader(code int) {
	if u.status == 0 {
		u.status = code
	}
}

// healthz answers 200 while the process lives; it touches no dependency.
func (s *Server) healthz(w http.ResponseWriter, _ *http.Request) {
	WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// readyz checks every dependency in parallel, each within ReadyTimeout, and answers 200
// when all answer, else 503 naming the ones that did not. A degraded check (Degraded)
// is named, with status "degraded", and keeps the answer 200. An open circuit breaker
// (a *breaker.OpenError, see BreakerCheck) is reported as "unavailable since <RFC 3339
// time>: <why>".
func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	type result struct {
		name string
		err  error
	}
	results := make(chan result, len(s.cfg.Checks))
	var wg sync.WaitGroup
	for name, check := range s.cfg.Checks {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(r.Context(), s.cfg.ReadyTimeout)
			defer cancel()
			results <- result{name, check(ctx)}
		})
	}
	wg.Wait()
	close(results)
	checks := map[string]string{}
	status, code := "ok", http.StatusOK
	for res := range results {
		var open *breaker.OpenError
		switch {
		case errors.As(res.err, &open) && errors.Is(res.err, ErrDegraded):
			checks[res.name] = "degraded: " + openText(open)
			if code == http.StatusOK {
				status = "degraded"
			}
		case errors.As(res.err, &open):
			checks[res.name] = openText(open)
			status, code = "unavailable", http.StatusServiceUnavailable
		case errors.Is(res.err, ErrDegraded):
			checks[res.name] = res.err.Error()
			if code == http.StatusOK {
				status = "degraded"
			}
		case res.err != nil:
			checks[res.name] = "unavailable: " + res.err.Error()
			status, code = "unavailable", http.StatusServiceUnavailable
		default:
			checks[res.name] = "ok"
		}
	}
	WriteJSON(w, code, map[string]any{"status": status, "checks": checks})
}

// openText is how /readyz reports an open breaker: since when and why.
func openText(e *breaker.OpenError) string {
	return "unavailable since " + e.Since.UTC().Format(time.RFC3339) + ": " + e.Reason
}

// BreakerCheck returns a Check of a dependency that has a circuit breaker: while b is
// open it answers b's *breaker.OpenError at once, without calling the dependency (so a
// hung dependency does not slow /readyz down once its breaker opened), and /readyz
// reports since when and why; otherwise it answers ping's result. A nil b is ping.
func BreakerCheck(b *breaker.Breaker, ping Check) Check {
	if b == nil {
		return ping
	}
	return func(ctx context.Context) error {
		if err := b.Err(); err != nil {
			return err
		}
		return ping(ctx)
	}
}

// WriteJSON writes v as a JSON response with the given status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// WriteError writes the JSON error body every onceflow error uses: {"detail": "..."}.
func WriteError(w http.ResponseWriter, status int, detail string) {
	WriteJSON(w, status, map[string]string{"detail": detail})
}

// httpMetrics counts requests by route and status code.
type httpMetrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

func newHTTPMetrics(reg prometheus.Registerer) *httpMetrics {
	return &httpMetrics{
		requests: metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "http", Name: "requests_total",
			Help: "HTTP requests answered, by route and status code.",
		}, []string{"route", "code"})),
		duration: metrics.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "http", Name: "request_duration_seconds",
			Help:    "Time to answer an HTTP request, by route.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}, []string{"route"})),
	}
}

func (m *httpMetrics) instrument(route string, h http.Handler) http.Handler {
	duration := m.duration.WithLabelValues(route)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := &StatusWriter{ResponseWriter: w}
		defer func() {
			code := sw.Status
			p := recover()
			if code == 0 && p != nil {
				code = http.StatusInternalServerError // net/http answers a panic with 500
			} else if code == 0 {
				code = http.StatusOK // nothing written: net/http sends 200
			}
			m.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
			duration.Observe(time.Since(start).Seconds())
			if p != nil {
				panic(p)
			}
		}()
		h.ServeHTTP(sw, r)
	})
}

// StatusWriter remembers the status code a handler wrote (0 while nothing was
// written).
type StatusWriter struct {
	http.ResponseWriter
	Status int
}

// WriteHeader implements http.ResponseWriter.
func (w *StatusWriter) WriteHeader(code int) {
	if w.Status == 0 {
		w.Status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (w *StatusWriter) Write(b []byte) (int, error) {
	if w.Status == 0 {
		w.Status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the underlying writer (Flush, deadlines).
func (w *StatusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// Serve serves h on addr until ctx is cancelled, then shuts down gracefully: it stops
// accepting, lets in-flight requests finish within cfg.ShutdownTimeout and closes what
// is left. The server is NewHTTPServer's, with cfg.Limits. It returns nil once shut
// down, also when requests still running at the timeout had to be cut (they are
// logged; their clients see a closed connection and retry, which Idempotency-Keys make
// safe).
func Serve(ctx context.Context, addr string, h http.Handler, cfg ServeConfig) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	return ServeListener(ctx, ln, h, cfg)
}

// ServeListener is Serve on a listener the caller opened.
func ServeListener(ctx context.Context, ln net.Listener, h http.Handler, cfg ServeConfig) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	shutdownTimeout, ready := cmp.Or(cfg.ShutdownTimeout, DefaultShutdownTimeout), cfg.Ready
	srv := NewHTTPServer(h, cfg.Limits, log)
	srv.BaseContext = func(net.Listener) context.Context { return context.WithoutCancel(ctx) }
	if ready != nil {
		ready(ln.Addr())
	}
	log.InfoContext(ctx, "http listening", "addr", ln.Addr().String())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve http: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	log.InfoContext(ctx, "http draining", "timeout", shutdownTimeout)
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
		log.WarnContext(ctx, "http shutdown timeout: closed the connections still open", "timeout", shutdownTimeout, "err", err)
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve http: %w", err)
	}
	return nil
}
