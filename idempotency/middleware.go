package idempotency

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/retry"
)

// Defaults of Config.
const (
	DefaultLockTTL          = 30 * time.Second
	DefaultResultTTL        = 24 * time.Hour
	DefaultRetryAfter       = time.Second
	DefaultStoreTimeout     = 500 * time.Millisecond
	DefaultMaxBodyBytes     = 1 << 20
	DefaultMaxResponseBytes = 64 << 10
)

// ErrUnauthenticated is what the middleware answers 401 for: Config.Tenant returned it
// (wrapped or not: the request carries no credential, or one no tenant has). The error
// itself is logged at debug level, not shown.
var ErrUnauthenticated = errors.New("authentication required")

// ErrTenantLookup is matched by Scope's error when Config.Tenant failed with any other
// error: the request may be fine, but telling its tenant failed (a key store that does
// not answer, a bug). It answers 503 with Retry-After when the error matches
// retry.ErrUnavailable (mark it with retry.Unavailable or onceflow.Unavailable), else 500;
// either way the error is logged, never shown, and the client is not told its
// credential is wrong.
var ErrTenantLookup = errors.New("tenant lookup failed")

// RequestError is a problem with the request the client can fix (400). Its Err's text is
// shown to the client as the detail.
type RequestError struct{ Err error }

// Error implements error.
func (e *RequestError) Error() string { return e.Err.Error() }

// Unwrap returns Err.
func (e *RequestError) Unwrap() error { return e.Err }

// LockLost describes a request whose lock ran out before it finished (see
// Config.OnLockLost). It names the key only by hash.
type LockLost struct {
	Tenant, Method, Path string
	// KeyHash is Scope.Hash(): the suffix of the record's key, never the raw key.
	KeyHash string
}

// Config configures a Middleware. Store and Tenant are required; every other field has a
// default applied by New.
type Config struct {
	// Store keeps the records. Required.
	Store Store
	// Tenant returns the authenticated principal of a request; the key's scope includes
	// it, so tenants never share keys. It must not trust request headers a client can
	// set freely: read what the caller's authentication established (usually from the
	// request's context, with authentication running before the middleware) or verify a
	// credential itself. An error matching ErrUnauthenticated answers 401 {"detail":
	// "authentication required"} and is logged at debug level; any other error is a
	// failure to tell the tenant (ErrTenantLookup): 503 + Retry-After when it matches
	// retry.ErrUnavailable, else 500, logged. Required.
	Tenant func(*http.Request) (string, error)
	// Canonical returns the canonical form the fingerprint is computed from.
	// Default: DefaultCanonical (CanonicalJSON for JSON bodies, the raw bytes otherwise).
	Canonical CanonicalFunc
	// LockTTL is the lifetime of the in-progress marker: the longest a handler may run and
	// still store its result, and the time after which a crashed request's key is free
	// again. Default: 30s.
	LockTTL time.Duration
	// ResultTTL is how long a stored response is replayed: the clients' retry horizon.
	// Default: 24h.
	ResultTTL time.Duration
	// RetryAfter is the Retry-After of 409 (in progress) and 503 (store unavailable)
	// answers, rounded up to whole seconds. Default: 1s.
	RetryAfter time.Duration
	// StoreTimeout bounds each store call (claim, complete, release). A claim that runs
	// out answers 503 without running the handler. Default: 500ms.
	StoreTimeout time.Duration
	// MaxBodyBytes limits the request body the middleware reads to fingerprint it; a
	// longer body is answered 413. Default: 1 MiB.
	MaxBodyBytes int64
	// MaxResponseBytes limits the stored response body. A response body over it is still
	// sent to the client in full, but stored without its body (Response.Truncated): a
	// replay sends the status and stored headers with an empty body. Default: 64 KiB.
	MaxResponseBytes int
	// StoredHeaders are the response headers a stored response keeps.
	// Default: DefaultStoredHeaders.
	StoredHeaders []string
	// Logger receives idempotency_lock_lost and store errors. Default: slog.Default().
	Logger *slog.Logger
	// Registerer receives onceflow_idempotency_requests_total{outcome}. Default: nil,
	// metrics are kept but not exported.
	Registerer prometheus.Registerer
	// OnLockLost, when set, is called (synchronously, after the log line) for every
	// request whose lock ran out before it finished.
	OnLockLost func(context.Context, LockLost)
}

// Middleware makes the handlers it wraps idempotent under the Idempotency-Key header
// (draft-ietf-httpapi-idempotency-key-header): the first request with a key runs the
// handler and its response is stored; a retry with the same key and fingerprint gets
// the stored response with Idempotent-Replayed: true; a retry while the first is running
// gets 409 with Retry-After; the same key with a different request gets 422. See
// docs/idempotency.md for the full status table. A Middleware is safe for concurrent use.
type Middleware struct {
	cfg     Config
	log     *slog.Logger
	metrics *idemMetrics
	stored  map[string]bool // canonical header names kept in stored responses
	retry   string          // Retry-After value
}

// New validates cfg, applies its defaults and returns the Middleware. It returns an
// error when Store or Tenant is missing or a value is out of range.
func New(cfg Config) (*Middleware, error) {
	if cfg.Store == nil {
		return nil, errors.New("idempotency: Config.Store is required")
	}
	if cfg.Tenant == nil {
		return nil, errors.New("idempotency: Config.Tenant is required")
	}
	if cfg.LockTTL < 0 || cfg.ResultTTL < 0 || cfg.RetryAfter < 0 || cfg.StoreTimeout < 0 || cfg.MaxBodyBytes < 0 || cfg.MaxResponseBytes < 0 {
		return nil, errors.New("idempotency: durations and limits must not be negative")
	}
	if cfg.Canonical == nil {
		cfg.Canonical = DefaultCanonical
	}
	cfg.LockTTL = cmp.Or(cfg.LockTTL, DefaultLockTTL)
	cfg.ResultTTL = cmp.Or(cfg.ResultTTL, DefaultResultTTL)
	cfg.RetryAfter = cmp.Or(cfg.RetryAfter, DefaultRetryAfter)
	cfg.StoreTimeout = cmp.Or(cfg.StoreTimeout, DefaultStoreTimeout)
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.MaxResponseBytes = cmp.Or(cfg.MaxResponseBytes, DefaultMaxResponseBytes)
	if cfg.StoredHeaders == nil {
		cfg.StoredHeaders = DefaultStoredHeaders
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m := &Middleware{
		cfg: cfg, log: cfg.Logger, metrics: newIdemMetrics(cfg.Registerer),
		stored: make(map[string]bool, len(cfg.StoredHeaders)),
		retry:  strconv.FormatInt(int64((cfg.RetryAfter+time.Second-1)/time.Second), 10),
	}
	for _, h := range cfg.StoredHeaders {
		m.stored[http.CanonicalHeaderKey(h)] = true
	}
	return m, nil
}

// Wrap returns h made idempotent. A response with status below 500 is stored; a 5xx or
// a panic releases the key (the panic then propagates to the server's recoverer), so a
// retry runs h again.
func (m *Middleware) Wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, func(w http.ResponseWriter, r *http.Request) error {
			h.ServeHTTP(w, r)
			return nil
		})
	})
}

// WrapFunc is Wrap for a handler that can fail: a non-nil error releases the key like a
// 5xx, discards what the handler wrote (unless it was already streamed past
// MaxResponseBytes) and answers 500 {"detail": "internal error"}; the error is logged.
func (m *Middleware) WrapFunc(h func(http.ResponseWriter, *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, h) })
}

// ReadBody reads r's body up to limit bytes. A longer body (or a Content-Length over the
// limit) returns an error matching ErrBodyTooLarge without reading further; a body that
// did not arrive before the connection's read deadline, one matching ErrBodyTimeout.
func ReadBody(r *http.Request, limit int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	tooLarge := fmt.Errorf("%w: the limit is %d bytes", ErrBodyTooLarge, limit)
	if r.ContentLength > limit {
		return nil, tooLarge
	}
	n := r.ContentLength
	if n < 0 || n > 64<<10 {
		n = 512
	}
	buf := bytes.NewBuffer(make([]byte, 0, n+1))
	if _, err := buf.ReadFrom(io.LimitReader(r.Body, limit+1)); errors.Is(err, os.ErrDeadlineExceeded) {
		return nil, fmt.Errorf("%w: %w", ErrBodyTimeout, err)
	} else if err != nil {
		return nil, &RequestError{Err: fmt.Errorf("read request body: %w", err)}
	}
	if int64(buf.Len()) > limit {
		return nil, tooLarge
	}
	return buf.Bytes(), nil
}

// Scope returns the scope of r under key: r's tenant (Config.Tenant), method and path.
// The error, if any, matches ErrUnauthenticated (Config.Tenant said so) or
// ErrTenantLookup (Config.Tenant failed otherwise); Respond answers it.
func (m *Middleware) Scope(r *http.Request, key string) (Scope, error) {
	tenant, err := m.cfg.Tenant(r)
	if err != nil {
		if errors.Is(err, ErrUnauthenticated) {
			m.log.DebugContext(r.Context(), "idempotency tenant rejected", "error", err)
			return Scope{}, err
		}
		return Scope{}, fmt.Errorf("%w: %w", ErrTenantLookup, err)
	}
	return Scope{Tenant: tenant, Method: r.Method, Path: r.URL.Path, Key: key}, nil
}

// serve is the generic two-round-trip path: claim, run, complete or release.
func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, h func(http.ResponseWriter, *http.Request) error) {
	key, err := KeyFromRequest(r.Header)
	if err != nil {
		m.Respond(w, r, nil, false, err)
		return
	}
	scope, err := m.Scope(r, key)
	if err != nil {
		m.Respond(w, r, nil, false, err)
		return
	}
	body, err := ReadBody(r, m.cfg.MaxBodyBytes)
	if err != nil {
		m.Respond(w, r, nil, false, err)
		return
	}
	canonical, err := m.cfg.Canonical(r, body)
	if err != nil {
		m.Respond(w, r, nil, false, &RequestError{Err: err})
		return
	}
	fp := Fingerprint(canonical)

	ctx, cancel := context.WithTimeout(r.Context(), m.cfg.StoreTimeout)
	lock, stored, err := m.cfg.Store.Claim(ctx, scope, fp, m.cfg.LockTTL)
	cancel()
	if err != nil || stored != nil {
		m.Respond(w, r, stored, stored != nil, err)
		return
	}

	r.Body = io.NopCloser(bytes.NewReader(body))
	rec := newRecorder(w, m.cfg.MaxResponseBytes)
	defer rec.free()
	finished := false
	defer func() {
		if finished {
			return
		}
		// The handler panicked (or called runtime.Goexit): release, then let it go on.
		p := recover()
		m.finish(r, lock, outcomeReleased, m.release(r, lock))
		if p != nil {
			panic(p)
		}
	}()
	herr := h(rec, r)
	finished = true

	switch {
	case herr != nil:
		m.log.ErrorContext(r.Context(), "idempotent handler failed", "error", herr,
			"tenant", scope.Tenant, "method", scope.Method, "path", scope.Path, "key_hash", scope.Hash())
		m.finish(r, lock, outcomeReleased, m.release(r, lock))
		if !rec.streamed {
			writeDetail(w, http.StatusInternalServerError, "internal error")
		}
	case rec.status() >= 500:
		m.finish(r, lock, outcomeReleased, m.release(r, lock))
		rec.flush()
	default:
		resp := rec.response(m.stored)
		o := outcomeNew
		if resp.Truncated {
			o = outcomeNewTruncated
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.StoreTimeout)
		err := m.cfg.Store.Complete(ctx, lock, resp, m.cfg.ResultTTL)
		cancel()
		m.finish(r, lock, o, err)
		rec.flush()
	}
}

// release releases lock within StoreTimeout, even when the client has gone.
func (m *Middleware) release(r *http.Request, lock *Lock) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.StoreTimeout)
	defer cancel()
	return m.cfg.Store.Release(ctx, lock)
}

// finish counts the outcome of a request whose handler ran, given the error of the
// store call that ended it.
func (m *Middleware) finish(r *http.Request, lock *Lock, o outcome, err error) {
	s := lock.Scope
	switch {
	case err == nil:
		m.metrics.count(o)
	case errors.Is(err, ErrLockLost):
		m.metrics.count(outcomeLockLost)
		ev := LockLost{Tenant: s.Tenant, Method: s.Method, Path: s.Path, KeyHash: s.Hash()}
		m.log.WarnContext(r.Context(), "idempotency_lock_lost",
			"tenant", ev.Tenant, "method", ev.Method, "path", ev.Path, "key_hash", ev.KeyHash,
			"lock_ttl", m.cfg.LockTTL)
		if m.cfg.OnLockLost != nil {
			m.cfg.OnLockLost(r.Context(), ev)
		}
	default:
		m.metrics.count(outcomeStoreFailed)
		m.log.ErrorContext(r.Context(), "idempotency store failed after the handler ran",
			"error", err, "tenant", s.Tenant, "method", s.Method, "path", s.Path, "key_hash", s.Hash())
	}
}

// Respond answers a request the way the middleware does, and counts it: err (from
// KeyFromRequest, ReadBody, Scope, a CanonicalFunc wrapped in *RequestError, or a
// store) is mapped to its status by the one mapping below; otherwise resp is written,
// with Idempotent-Replayed: true when replayed. Routes that accept in one atomic store
// call (redisstore.Store.Accept) use it so that they answer and count like the
// middleware.
//
//	*KeyError, *RequestError     400 {"detail": ...}
//	ErrUnauthenticated           401
//	ErrTenantLookup              503 + Retry-After (retry.ErrUnavailable) or 500 (logged)
//	ErrBodyTooLarge              413
//	ErrBodyTimeout               408
//	ErrInProgress                409 + Retry-After
//	ErrKeyReused                 422
//	any other error              503 + Retry-After (logged)
func (m *Middleware) Respond(w http.ResponseWriter, r *http.Request, resp *Response, replayed bool, err error) {
	var (
		ke *KeyError
		re *RequestError
	)
	switch {
	case err == nil && resp != nil:
		if replayed {
			m.metrics.count(outcomeReplayed)
		} else {
			m.metrics.count(outcomeNew)
		}
		WriteResponse(w, resp, replayed)
	case errors.As(err, &ke):
		m.metrics.count(outcomeInvalid)
		writeDetail(w, http.StatusBadRequest, ke.Detail)
	case errors.As(err, &re):
		m.metrics.count(outcomeInvalid)
		writeDetail(w, http.StatusBadRequest, re.Error())
	case errors.Is(err, ErrUnauthenticated):
		m.metrics.count(outcomeUnauthorized)
		w.Header().Set("WWW-Authenticate", "Bearer")
		writeDetail(w, http.StatusUnauthorized, "authentication required")
	case errors.Is(err, ErrTenantLookup):
		m.metrics.count(outcomeUnavailable)
		m.log.ErrorContext(r.Context(), "idempotency: telling the request's tenant failed", "error", err, "method", r.Method, "path", r.URL.Path)
		WriteTenantLookupError(w, err, m.retry)
	case errors.Is(err, ErrBodyTooLarge):
		m.metrics.count(outcomeTooLarge)
		writeDetail(w, http.StatusRequestEntityTooLarge, err.Error()) // names the limit ReadBody applied
	case errors.Is(err, ErrBodyTimeout):
		m.metrics.count(outcomeTimeout)
		writeDetail(w, http.StatusRequestTimeout, ErrBodyTimeout.Error())
	case errors.Is(err, ErrInProgress):
		m.metrics.count(outcomeConflict)
		w.Header().Set("Retry-After", m.retry)
		writeDetail(w, http.StatusConflict, "a request with this Idempotency-Key is in progress; retry later")
	case errors.Is(err, ErrKeyReused):
		m.metrics.count(outcomeReused)
		writeDetail(w, http.StatusUnprocessableEntity, "Idempotency-Key was already used with a different request")
	default:
		if err == nil {
			err = errors.New("no response and no error")
		}
		m.metrics.count(outcomeUnavailable)
		m.log.WarnContext(r.Context(), "idempotency store unavailable", "error", err, "method", r.Method, "path", r.URL.Path)
		w.Header().Set("Retry-After", m.retry)
		writeDetail(w, http.StatusServiceUnavailable, "idempotency store unavailable; retry later")
	}
}

// WriteResponse writes a stored or new response: its headers, Idempotent-Replayed: true
// when replayed, its status and its body.
func WriteResponse(w http.ResponseWriter, resp *Response, replayed bool) {
	h := w.Header()
	for k, vs := range resp.Header {
		h[k] = append([]string(nil), vs...)
	}
	if replayed {
		h.Set(HeaderReplayed, "true")
	}
	h.Set("Content-Length", strconv.Itoa(len(resp.Body)))
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(resp.Status)
	// #nosec G705 -- the body is the wrapped handler's own response, stored as it wrote it with its Content-Type, and never sniffed as HTML (nosniff).
	_, _ = w.Write(resp.Body)
}

func writeDetail(w http.ResponseWriter, status int, detail string) {
	// Details may quote client input (a field name, say): encode them as JSON, never as Go.
	q, _ := json.Marshal(detail)
	b := make([]byte, 0, len(q)+13)
	b = append(b, `{"detail":`...)
	b = append(b, q...)
	b = append(b, "}\n"...)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// NewToken returns a random token for a Lock: 128 bits, hex.
func NewToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

var bufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// recorder buffers a handler's response so it can be stored before the client sees it.
// Past limit bytes it streams to the client instead (streamed). The handler writes its
// headers into a copy of w's, which reaches w only with the response, so that a failed
// handler's headers (Location, cookies) never go out with the middleware's 500.
type recorder struct {
	w        http.ResponseWriter
	header   http.Header
	code     int
	buf      *bytes.Buffer
	limit    int
	streamed bool
}

func newRecorder(w http.ResponseWriter, limit int) *recorder {
	buf := bufPool.Get().(*bytes.Buffer)
	buf.Reset()
	h := w.Header().Clone()
	if h == nil {
		h = http.Header{}
	}
	return &recorder{w: w, header: h, buf: buf, limit: limit}
}

func (rc *recorder) free() {
	if rc.buf.Cap() <= 1<<20 {
		bufPool.Put(rc.buf)
	}
	rc.buf = nil
}

func (rc *recorder) Header() http.Header { return rc.header }

// commitHeader makes the handler's headers w's.
func (rc *recorder) commitHeader() {
	dst := rc.w.Header()
	for k := range dst {
		if _, ok := rc.header[k]; !ok {
			delete(dst, k)
		}
	}
	for k, vs := range rc.header {
		dst[k] = vs
	}
}

func (rc *recorder) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		rc.commitHeader()
		rc.w.WriteHeader(code) // informational (103 Early Hints): pass through
		return
	}
	if rc.code == 0 {
		rc.code = code
	}
}

func (rc *recorder) Write(p []byte) (int, error) {
	if rc.code == 0 {
		rc.code = http.StatusOK
	}
	if rc.streamed {
		return rc.w.Write(p)
	}
	if rc.buf.Len()+len(p) <= rc.limit {
		return rc.buf.Write(p)
	}
	rc.streamed = true
	rc.sniff()
	rc.commitHeader()
	rc.w.WriteHeader(rc.code)
	// #nosec G705 -- the wrapped handler's own response bytes, passed on unchanged.
	if _, err := rc.w.Write(rc.buf.Bytes()); err != nil {
		return 0, err
	}
	return rc.w.Write(p)
}

func (rc *recorder) status() int {
	if rc.code == 0 {
		return http.StatusOK
	}
	return rc.code
}

// sniff sets Content-Type the way net/http would, so that the stored response carries
// the same type the client saw.
func (rc *recorder) sniff() {
	h := rc.header
	if _, ok := h["Content-Type"]; !ok && rc.buf.Len() > 0 && h.Get("Content-Encoding") == "" {
		h.Set("Content-Type", http.DetectContentType(rc.buf.Bytes()))
	}
}

// response returns what to store: status, allowed headers, body (copied).
func (rc *recorder) response(allowed map[string]bool) *Response {
	if !rc.streamed {
		rc.sniff()
	}
	resp := &Response{Status: rc.status(), Header: http.Header{}, Truncated: rc.streamed}
	for k, vs := range rc.header {
		if allowed[k] {
			resp.Header[k] = append([]string(nil), vs...)
		}
	}
	if !rc.streamed {
		resp.Body = rc.buf.Bytes() // valid until free; stores do not retain it
	}
	return resp
}

// flush sends the buffered response to the client (nothing left to do when streamed).
func (rc *recorder) flush() {
	if rc.streamed {
		return
	}
	rc.sniff()
	rc.header.Set("Content-Length", strconv.Itoa(rc.buf.Len()))
	rc.commitHeader()
	rc.w.WriteHeader(rc.status())
	_, _ = rc.w.Write(rc.buf.Bytes())
}

// WriteTenantLookupError answers a request whose tenant could not be told (err matches
// ErrTenantLookup, or is any error of a tenant function other than ErrUnauthenticated):
// 503 with Retry-After retryAfter (seconds) when err matches retry.ErrUnavailable, else
// 500; the detail never shows err.
func WriteTenantLookupError(w http.ResponseWriter, err error, retryAfter string) {
	if errors.Is(err, retry.ErrUnavailable) {
		w.Header().Set("Retry-After", retryAfter)
		writeDetail(w, http.StatusServiceUnavailable, "authentication unavailable; retry later")
		return
	}
	writeDetail(w, http.StatusInternalServerError, "authentication failed on the server")
}
