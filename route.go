package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/strictjson"
	"github.com/onceflow/onceflow/queue"
)

// Defaults of RouteConfig.
const (
	// DefaultMaxBodyBytes bounds a route's request body; larger ones get 413.
	DefaultMaxBodyBytes = 1 << 20
	// DefaultRouteTimeout bounds the accept of one request; past it the route answers
	// 503 with Retry-After.
	DefaultRouteTimeout = 2 * time.Second
	// DefaultBodyReadTimeout bounds how long a route waits for a request's body; a
	// slower client gets 408.
	DefaultBodyReadTimeout = 10 * time.Second
)

// RouteConfig configures Route. Tenant is required.
type RouteConfig[T JobArgs] struct {
	// Tenant returns the tenant of a request, from its authentication (an API key, a
	// session), never from a header the client chooses. Returning an error matching
	// idempotency.ErrUnauthenticated answers 401; another error answers 500, or 503
	// with Retry-After when it matches ErrUnavailable (the key store does not answer),
	// and is logged, not shown. The tenant must be up to 64 characters of A-Z a-z 0-9
	// . _ - (or empty for none); another is the server's mistake: 500. Required.
	Tenant func(r *http.Request) (string, error)
	// Validate checks the decoded arguments beyond the strict JSON rules (a required
	// field, a range). Its error is a 400 whose detail is the error's text; start it with
	// the field's name ("notify: not an email address"). Default: none.
	Validate func(args *T) error
	// Args fills job arguments from the request once the body is decoded, before
	// Validate: path values (r.PathValue("order") on a route mounted at
	// "POST /v1/orders/{order}/refunds"), for instance. The body stays strict JSON; what
	// Args sets is part of the job's arguments, so the key's fingerprint covers it
	// beside the body (and the path is part of the key's scope). Its error is a 400
	// whose detail is the error's text. Default: none (the body alone).
	Args func(r *http.Request, args *T) error
	// Queue is the queue the route's jobs go to, the same for every request, so that an
	// Idempotency-Key names one job whatever the body (its record lives with the
	// queue). Default: the kind's own (JobArgsWithOpts), else DefaultQueue. The tenant
	// and the job id always come from the request (Tenant and the key), never from the
	// arguments' defaults.
	Queue string
	// Location returns the Location header of the 202 (where the job's state is read).
	// Default: the request's path, a slash and the job id.
	Location func(r *http.Request, jobID string) string
	// MaxBodyBytes bounds the body; larger ones get 413. Default: DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// BodyReadTimeout bounds the time to receive the body, from the moment the route
	// starts reading it, so that a client that trickles its body cannot hold a
	// goroutine and a connection for long: past it, 408. It only brings the
	// connection's read deadline forward (http.ResponseController), so a server's own
	// shorter deadline (http.Server.ReadTimeout) still applies first. Negative: no bound
	// of the route's own. Default: DefaultBodyReadTimeout.
	BodyReadTimeout time.Duration
	// Timeout bounds the accept, one Redis round trip; past it, 503. Default:
	// DefaultRouteTimeout.
	Timeout time.Duration
	// LockTTL, RetryAfter and MaxResponseBytes configure the route's idempotency
	// middleware (idempotency.Config). Defaults: idempotency's.
	LockTTL, RetryAfter time.Duration
	MaxResponseBytes    int
}

// Route returns an http.Handler that enqueues a job of kind T from a POST, with the
// full Idempotency-Key semantics (docs/api.md):
//
//   - the Idempotency-Key header is required (16 to 128 printable ASCII characters,
//     the quoted form is the same key): missing or malformed, 400;
//   - the body must be application/json (else 415), at most MaxBodyBytes (else 413),
//     and decode strictly into T (case-sensitive names, no unknown or repeated fields:
//     else 400 naming the field), take what RouteConfig.Args fills from the request
//     (path values), then pass Validate (else 400);
//   - a new key: the job is enqueued, its tenant recorded and the answer stored, in
//     ONE Redis round trip (one script), and the answer is 202
//     {"job_id": "<id>", "status": "queued"} with Location; the job id is JobID of the
//     request's scope (tenant, method, path, key), so a duplicate collapses downstream;
//   - the same key and body again: the stored answer, byte for byte, with
//     Idempotent-Replayed: true; the same key with another body: 422;
//   - Redis unavailable or slower than Timeout: 503 with Retry-After, nothing stored;
//   - the same key from two tenants: two jobs.
//
// Mount it on the path of your choice (mux.Handle("POST /v1/tickets", h)); the path is
// part of the scope. Its metrics are the idempotency middleware's and
// onceflow_queue_enqueued_total, on Config.Registerer.
func Route[T JobArgs](c *Client, cfg RouteConfig[T]) (http.Handler, error) {
	if cfg.Tenant == nil {
		return nil, errors.New("onceflow: RouteConfig.Tenant is required")
	}
	var zero T
	kind := zero.Kind()
	if !queue.ValidKind(kind) {
		return nil, fmt.Errorf("%w: Route: kind %q of %T is not valid", ErrUnknownKind, kind, zero)
	}
	if cfg.Queue == "" {
		if o, ok := any(zero).(JobArgsWithOpts); ok {
			cfg.Queue = o.EnqueueOpts().Queue
		}
		cfg.Queue = cmp.Or(cfg.Queue, DefaultQueue)
	}
	if err := c.keys(cfg.Queue).Validate(); err != nil {
		return nil, fmt.Errorf("onceflow: Route: queue %q: %w", cfg.Queue, err)
	}
	c.noteQueue(cfg.Queue)
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.Timeout = cmp.Or(cfg.Timeout, DefaultRouteTimeout)
	cfg.BodyReadTimeout = cmp.Or(cfg.BodyReadTimeout, DefaultBodyReadTimeout)
	if cfg.Location == nil {
		cfg.Location = func(r *http.Request, id string) string { return strings.TrimSuffix(r.URL.Path, "/") + "/" + id }
	}
	mw, err := idempotency.New(idempotency.Config{
		Store: c.store, Tenant: usableTenant(cfg.Tenant), LockTTL: cfg.LockTTL, ResultTTL: c.cfg.ResultTTL,
		RetryAfter: cfg.RetryAfter, StoreTimeout: cfg.Timeout, MaxBodyBytes: cfg.MaxBodyBytes,
		MaxResponseBytes: cfg.MaxResponseBytes, Logger: c.log, Registerer: c.cfg.Registerer,
	})
	if err != nil {
		return nil, fmt.Errorf("onceflow: Route: %w", err)
	}
	return &route[T]{c: c, cfg: cfg, mw: mw, kind: kind}, nil
}

type route[T JobArgs] struct {
	c    *Client
	cfg  RouteConfig[T]
	mw   *idempotency.Middleware
	kind string
}

func (rt *route[T]) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	mw := rt.mw
	key, err := idempotency.KeyFromRequest(r.Header)
	if err != nil {
		mw.Respond(w, r, nil, false, err)
		return
	}
	scope, err := mw.Scope(r, key)
	if err != nil {
		mw.Respond(w, r, nil, false, err)
		return
	}
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		writeDetail(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
		return
	}
	body, err := rt.readBody(w, r)
	if err != nil {
		mw.Respond(w, r, nil, false, err)
		return
	}
	args := new(T)
	if err := strictjson.Decode(body, args); err != nil {
		mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: fieldError(err)})
		return
	}
	if rt.cfg.Args != nil {
		if err := rt.cfg.Args(r, args); err != nil {
			mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: err})
			return
		}
	}
	if rt.cfg.Validate != nil {
		if err := rt.cfg.Validate(args); err != nil {
			mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: err})
			return
		}
	}
	opts := EnqueueOpts{Queue: rt.cfg.Queue, Tenant: scope.Tenant, JobID: JobID(scope)}
	// The accept must not depend on the client staying connected: once Redis has the job
	// the answer is stored with it, atomically.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), rt.cfg.Timeout)
	defer cancel()
	m, o, err := rt.c.messageFor(r.Context(), *args, opts, true)
	if err != nil {
		mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: err})
		return
	}
	location := rt.cfg.Location(r, m.JobID)
	resp := &idempotency.Response{
		Status: http.StatusAccepted,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {location}},
		Body:   []byte(`{"job_id":` + quoteJSON(m.JobID) + `,"status":"queued"}`),
	}
	// The fingerprint is of the arguments as re-encoded (m.Payload), so whitespace and
	// key order in the body do not matter.
	keys, err := rt.c.enqueueKeys(ctx, o.Queue, m.JobID)
	if err != nil {
		mw.Respond(w, r, nil, false, err)
		return
	}
	stored, replayed, err := rt.c.accept(ctx, scope, idempotency.Fingerprint(m.Payload), resp, m, keys, time.Time{})
	mw.Respond(w, r, stored, replayed, err)
}

// errUnusableTenant is the error of a tenant function that returned a tenant onceflow
// cannot use: the server's mistake, answered 500 like any failure to tell the tenant
// (idempotency.ErrTenantLookup), never a 400 that would show the client the name.
var errUnusableTenant = errors.New("onceflow: the tenant function returned a tenant onceflow cannot use (up to 64 characters of A-Z a-z 0-9 . _ -)")

// usableTenant wraps a Route's or StateHandler's tenant function so that a tenant
// onceflow cannot use is an error (errUnusableTenant), not a tenant.
func usableTenant(tenant func(*http.Request) (string, error)) func(*http.Request) (string, error) {
	return func(r *http.Request) (string, error) {
		t, err := tenant(r)
		if err == nil && !queue.ValidTenant(t) {
			return "", errUnusableTenant
		}
		return t, err
	}
}

// readBody reads the request's body (idempotency.ReadBody, up to MaxBodyBytes) within
// BodyReadTimeout: if the read is still going on then, it moves the connection's read
// deadline to that moment (http.ResponseController), so the read fails with a timeout.
// It only ever brings a deadline forward: a server's own, earlier one (http.Server's
// ReadTimeout, or a deadline a middleware set) applies as it is. After a timed-out read
// the deadline stays, so that net/http gives up reading the rest and closes the
// connection after the answer instead of waiting for it. A ResponseWriter without
// deadlines (a test recorder) leaves the server's own deadlines alone in force.
func (rt *route[T]) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	return readBodyWithin(w, r, rt.cfg.MaxBodyBytes, rt.cfg.BodyReadTimeout)
}

// readBodyWithin reads r's body, up to limit bytes, within timeout (no bound of its own
// when timeout is negative): see route.readBody.
func readBodyWithin(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) ([]byte, error) {
	if timeout <= 0 || r.Body == nil || r.Body == http.NoBody {
		return idempotency.ReadBody(r, limit)
	}
	rc := http.NewResponseController(w)
	cut := time.AfterFunc(timeout, func() { _ = rc.SetReadDeadline(time.Now()) })
	body, err := idempotency.ReadBody(r, limit)
	if !cut.Stop() && err == nil {
		_ = rc.SetReadDeadline(time.Time{}) // it fired just as the body came in
	}
	return body, err
}

// fieldError turns a strict decoding error into the 400 detail "field: what is wrong"
// (or "body: ..." for the document).
func fieldError(err error) error {
	var se *strictjson.Error
	if !errors.As(err, &se) {
		return fmt.Errorf("body: %w", err)
	}
	switch se.Kind { // a job's arguments are a JSON object: say so
	case strictjson.KindEmpty:
		return errors.New("body: empty body; want a JSON object")
	case strictjson.KindTrailingData:
		return errors.New("body: unexpected data after the JSON object")
	}
	return fmt.Errorf("%s: %s", cmp.Or(se.Field, "body"), se.Msg)
}

// quoteJSON returns s as a JSON string.
func quoteJSON(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// writeDetail writes the JSON error body every onceflow error uses: {"detail": "..."}.
func writeDetail(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"detail": detail})
}
