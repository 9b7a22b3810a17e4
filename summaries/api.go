package summaries

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"mime"
	"net/http"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/queue"
)

// JobNamespace is the UUIDv5 namespace of job ids: a job id is
// uuid.NewSHA1(JobNamespace, scope.Encode()) where scope is the request's idempotency
// scope (tenant, method, path, key; see idempotency.Scope.Encode). It is itself the
// UUIDv5 of the URL "https://github.com/onceflow/onceflow/jobs" in the URL namespace,
// and must never change: a retried request must map to the job id its first attempt got.
var JobNamespace = uuid.MustParse("82d05cc3-eef7-5704-933f-413aa8eeee8c")

// QueueName is the queue the summaries route feeds: its keys are
// <prefix>:{summaries}:stream and so on.
const QueueName = "summaries"

// JobID returns the job id of a request with the given idempotency scope.
func JobID(scope idempotency.Scope) string {
	return uuid.NewSHA1(JobNamespace, scope.Encode()).String()
}

// Row is the reader GET needs from PostgreSQL: *pgxpool.Pool has it.
type Row interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// APIConfig configures the summaries routes.
type APIConfig struct {
	// Redis holds the queue and the idempotency records. Required.
	Redis *redis.Client
	// DB answers GET for finished jobs. Required.
	DB Row
	// Keys names the queue; Keys.Queue should be QueueName. Required.
	Keys queue.Keys
	// Idempotency is the middleware whose Respond maps outcomes to statuses and counts
	// them; its Tenant function must read httpapi.TenantFrom. Required.
	Idempotency *idempotency.Middleware
	// Store accepts a job in one round trip (AcceptWrite with the queue's enqueue). Its
	// ResultTTL is how long a key's response is replayed. Required.
	Store *redisstore.Store
	// Timeout bounds each store call of a request (Redis or PostgreSQL); past it the
	// route answers 503. Default: 2s.
	Timeout time.Duration
	// Logger receives errors. Default: slog.Default().
	Logger *slog.Logger
	// TraceParent returns the W3C traceparent to carry in the job, or "". Default: none.
	TraceParent func(ctx context.Context) string
	// Registerer receives the route's metrics (onceflow_queue_enqueued_total). Default:
	// nil, not exported.
	Registerer prometheus.Registerer
}

// API serves POST /v1/summaries and GET /v1/summaries/{job_id}.
type API struct {
	cfg APIConfig
	log *slog.Logger
	m   *apiMetrics
}

// LoadScripts loads the accept script into Redis's script cache, so that the first
// accept costs one round trip rather than two. It is optional.
func (a *API) LoadScripts(ctx context.Context) error {
	return a.cfg.Store.LoadScripts(ctx, queue.EnqueueLua)
}

// NewAPI checks cfg and returns the routes.
func NewAPI(cfg APIConfig) (*API, error) {
	switch {
	case cfg.Redis == nil || cfg.DB == nil || cfg.Idempotency == nil || cfg.Store == nil:
		return nil, errors.New("summaries api: Redis, DB, Idempotency and Store are required")
	}
	if err := cfg.Keys.Validate(); err != nil {
		return nil, fmt.Errorf("summaries api: %w", err)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.TraceParent == nil {
		cfg.TraceParent = func(context.Context) string { return "" }
	}
	return &API{cfg: cfg, log: cfg.Logger, m: newAPIMetrics(cfg.Registerer)}, nil
}

// Register adds the routes to s behind auth.
func (a *API) Register(s *httpapi.Server, auth *httpapi.Authenticator) {
	s.Handle("POST /v1/summaries", "/v1/summaries", auth.Require(http.HandlerFunc(a.create)), postCodes...)
	s.Handle("GET /v1/summaries/{job_id}", "/v1/summaries/{job_id}", auth.Require(http.HandlerFunc(a.get)), getCodes...)
}

// create accepts a job: one Redis round trip (redisstore.Store.AcceptWrite, running the
// queue's own enqueue, queue.EnqueueLua) checks the key and the fingerprint, enqueues the
// job, records its tenant in the job index and stores the response, or replays the
// stored one. There is no in-progress state, hence no 409 on this route. A key re-sent
// after its response expired enqueues the job again, and a job that was dead-lettered
// then runs again (its dead letter retired), as after `onceflow dlq replay`.
func (a *API) create(w http.ResponseWriter, r *http.Request) {
	mw := a.cfg.Idempotency
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
		httpapi.WriteError(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
		return
	}
	body, err := idempotency.ReadBody(r, MaxBodyBytes)
	if err != nil {
		mw.Respond(w, r, nil, false, err)
		return
	}
	req, err := DecodeRequest(body)
	if err != nil {
		mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: err})
		return
	}
	canonical := req.Canonical()
	jobID := JobID(scope)
	msg := queue.Message{
		JobID: jobID, Tenant: scope.Tenant, Payload: canonical,
		EnqueuedAt: time.Now(), TraceParent: a.cfg.TraceParent(r.Context()),
	}
	args, err := queue.EnqueueArgs(msg)
	if err != nil { // the route built msg from validated parts: a bug
		a.log.ErrorContext(r.Context(), "summaries: cannot enqueue the accepted request", "job_id", jobID, "error", err)
		httpapi.WriteError(w, http.StatusInternalServerError, "internal error")
		return
	}
	resp := &idempotency.Response{
		Status: http.StatusAccepted,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/summaries/" + jobID}},
		Body:   []byte(`{"job_id":"` + jobID + `","status":"queued"}`),
	}
	// The accept must not depend on the client staying connected: once Redis has the job
	// the response must be stored with it, which the script does atomically anyway.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), a.cfg.Timeout)
	defer cancel()
	stored, replayed, err := a.cfg.Store.AcceptWrite(ctx, scope, idempotency.Fingerprint(canonical), resp, redisstore.Write{
		Lua: queue.EnqueueLua, Keys: a.cfg.Keys.EnqueueKeys(jobID), Args: args,
	})
	if err == nil && !replayed {
		a.m.enqueued.Inc()
	}
	mw.Respond(w, r, stored, replayed, err)
}

// status is the body of GET /v1/summaries/{job_id}.
type status struct {
	JobID   string `json:"job_id"`
	Status  string `json:"status"`
	Summary string `json:"summary,omitempty"`
	Error   string `json:"error,omitempty"`
}

// get answers a job's state: done (with the summary) from PostgreSQL; failed (with the
// dead-letter reason) or queued from the job index in Redis; 404 for an unknown id or
// another tenant's job, so a tenant cannot even learn that another's job exists; 503 when
// a store it needs does not answer.
func (a *API) get(w http.ResponseWriter, r *http.Request) {
	tenant, _ := httpapi.TenantFrom(r.Context())
	id := r.PathValue("job_id")
	if !queue.IsUUID(id) {
		httpapi.WriteError(w, http.StatusNotFound, "no such job")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), a.cfg.Timeout)
	defer cancel()
	var owner, summary string
	err := a.cfg.DB.QueryRow(ctx, `SELECT tenant, summary FROM summaries WHERE job_id = $1`, id).Scan(&owner, &summary)
	switch {
	case err == nil && owner == tenant:
		httpapi.WriteJSON(w, http.StatusOK, status{JobID: id, Status: "done", Summary: summary})
		return
	case err == nil:
		httpapi.WriteError(w, http.StatusNotFound, "no such job")
		return
	case !errors.Is(err, pgx.ErrNoRows):
		a.unavailable(w, r, "postgres", err)
		return
	}
	owner, state, reason, err := queue.JobState(ctx, a.cfg.Redis, a.cfg.Keys, id)
	switch {
	case errors.Is(err, queue.ErrUnknownJob) || (err == nil && owner != tenant):
		httpapi.WriteError(w, http.StatusNotFound, "no such job")
	case err != nil:
		a.unavailable(w, r, "redis", err)
	case state == queue.StateFailed:
		httpapi.WriteJSON(w, http.StatusOK, status{JobID: id, Status: "failed", Error: reason})
	default:
		httpapi.WriteJSON(w, http.StatusOK, status{JobID: id, Status: "queued"})
	}
}

func (a *API) unavailable(w http.ResponseWriter, r *http.Request, store string, err error) {
	a.log.WarnContext(r.Context(), "summaries: store unavailable", "store", store, "error", err)
	w.Header().Set("Retry-After", "1")
	httpapi.WriteError(w, http.StatusServiceUnavailable, store+" unavailable; retry later")
}
