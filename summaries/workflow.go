package summaries

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// The names the workflow is known by.
const (
	// Name is the workflow's name (onceflow.Workflow.Name).
	Name = "summaries"
	// JobKind is the kind of a summary job (Request.Kind). A message enqueued before job
	// kinds existed (queue wire format version 1) has none: the summaries queue's
	// DefaultKind is JobKind, so such messages are still processed.
	JobKind = "summary"
	// QueueName is the queue the summaries route feeds: its keys are
	// <prefix>:{summaries}:stream and so on.
	QueueName = "summaries"
	// TopicSummaryReady is the outbox topic of the "summary ready" email.
	TopicSummaryReady = "email.summary_ready"
	// DefaultJobBudget is the deadline of one delivery in Options.Unledgered mode.
	DefaultJobBudget = onceflow.DefaultJobBudget
)

// JobNamespace is the UUIDv5 namespace of job ids, onceflow.JobNamespace: a job id is
// uuid.NewSHA1(JobNamespace, scope.Encode()) where scope is the request's idempotency
// scope (tenant, method, path, key). It must never change: a retried request must map
// to the job id its first attempt got.
var JobNamespace = onceflow.JobNamespace

// JobID returns the job id of a request with the given idempotency scope: onceflow.JobID,
// which the route uses.
func JobID(scope idempotency.Scope) string { return onceflow.JobID(scope) }

// DedupeKey returns the outbox dedupe key of a job's email: summary_ready:<job_id>.
func DedupeKey(jobID string) string { return "summary_ready:" + jobID }

// Kind implements onceflow.JobArgs: a Request is the arguments of a JobKind job.
func (Request) Kind() string { return JobKind }

// EnqueueOpts implements onceflow.JobArgsWithOpts: summary jobs run on QueueName.
func (Request) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: QueueName} }

// Prompt is the instruction sent to the model for a text.
func Prompt(text string) string { return "Summarise for the account team:\n\n" + text }

// Outcome says what one delivery of a summary job did (Options.OnJob, and the "outcome"
// label of onceflow_summaries_jobs_total with the error outcomes).
type Outcome string

const (
	// OutcomeDone: this delivery stored the summary and the email intent.
	OutcomeDone Outcome = "done"
	// OutcomeDuplicate: the summary existed (a redelivery, or a concurrent delivery won).
	OutcomeDuplicate Outcome = "duplicate"
)

// Options are what the host supplies to the summaries workflow. Tenant is required for
// its routes; everything else has a default.
type Options struct {
	// Tenant returns the tenant of a request from its authentication (package cli: the
	// bearer key of ONCEFLOW_API_KEYS). Its error answers 401 before anything else is
	// looked at. Required by the routes.
	Tenant func(r *http.Request) (string, error)
	// Unauthorized writes the 401 of a request Tenant refused. Default: 401
	// {"detail": "authentication required"} with WWW-Authenticate: Bearer.
	Unauthorized http.Handler
	// Sender delivers the workflow's "summary ready" emails (its Senders'
	// TopicSummaryReady; package cli: the sender ONCEFLOW_SENDER selects). Default: none:
	// the emails wait in the outbox for a process whose Client has a sender for the topic.
	Sender outbox.Sender
	// Model is the model name sent with each request (ONCEFLOW_LLM_MODEL). Default: ""
	// (the model client's default).
	Model string
	// Queue configures the summaries queue (ONCEFLOW_WORKER_CONCURRENCY,
	// ONCEFLOW_CLAIM_IDLE, ...). Its DefaultKind is always JobKind. Default: onceflow's.
	Queue onceflow.QueueConfig
	// Timeout bounds each store call of a request (ONCEFLOW_IDEMPOTENCY_TIMEOUT); past
	// it the route answers 503. Default: onceflow.DefaultRouteTimeout (2s).
	Timeout time.Duration
	// LockTTL and MaxResponseBytes configure the POST route's idempotency middleware
	// (ONCEFLOW_LOCK_TTL, ONCEFLOW_IDEMPOTENCY_RESPONSE_LIMIT). Default: idempotency's.
	LockTTL          time.Duration
	MaxResponseBytes int
	// AuditMaxAge and AuditRetention are AuditConfig's MaxAge and Retention for the
	// workflow's audit (ONCEFLOW_AUDIT_MAX_AGE, ONCEFLOW_OUTBOX_RETENTION). Default:
	// 10m and 7 days.
	AuditMaxAge, AuditRetention time.Duration
	// Batch, when set, sends each summary's model call through the batch lane
	// (onceflow.InBatch, Config.Batch; ONCEFLOW_SUMMARIES_LANE=batch) and bounds its wait:
	// a summary whose batch has not answered by then is asked in the synchronous lane.
	// Default: 0, the synchronous lane (streamed).
	Batch time.Duration
	// Unledgered, when set, is called directly for the summary, without the llm_calls
	// ledger (the reference handler of docs/architecture.md: every delivery that passes
	// the pre-check calls the model), under Retry and Budget. Default: nil: the model is
	// the Client's Config.Model, called with Job.Complete through the ledger under
	// Config.ModelRetry and Config.JobBudget.
	Unledgered llm.Client
	// Retry and Budget are the retry policy and the delivery deadline of Unledgered
	// calls. Defaults: package retry's, and DefaultJobBudget (60s).
	Retry  retry.Policy
	Budget time.Duration
	// OnJob, when set, is called after each delivery the worker ran, with its outcome
	// ("" on an error) and its error, for tests and tools. Default: none.
	OnJob func(ctx context.Context, jobID string, outcome Outcome, err error)
	// Logger receives the workflow's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer receives the workflow's metrics (onceflow_summaries_jobs_total,
	// onceflow_outbox_written_total, onceflow_queue_enqueued_total). Default: nil, not
	// exported.
	Registerer prometheus.Registerer
}

// Workflow returns the summaries workflow for onceflow.Config.Workflows: the queue
// QueueName, the worker of JobKind, the routes POST /v1/summaries,
// GET /v1/summaries/{job_id} and GET /v1/summaries/{job_id}/events (the summary's text
// as it is generated, Server-Sent Events: onceflow.EventsHandler) (Client.Mount), the sender of its emails (o.Sender), and
// its audit. Its table, summaries, is
// created by onceflow's migrations. The Client needs Config.DB, and Config.Model unless
// o.Unledgered is set.
func Workflow(o Options) onceflow.Workflow {
	o.Logger = cmp.Or(o.Logger, slog.Default())
	o.Budget = cmp.Or(o.Budget, DefaultJobBudget)
	q := o.Queue
	q.DefaultKind = JobKind
	m := newMetrics(o.Registerer)
	w := &worker{o: o, m: m}
	var senders map[string]outbox.Sender
	if o.Sender != nil {
		senders = map[string]outbox.Sender{TopicSummaryReady: o.Sender}
	}
	return onceflow.Workflow{
		Name:    Name,
		Queues:  map[string]onceflow.QueueConfig{QueueName: q},
		Senders: senders,
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely[Request](ws, w)
		},
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			post, get, err := routes(c, o, m)
			if err != nil {
				return err
			}
			mux.Handle("POST /v1/summaries", post)
			mux.Handle("GET /v1/summaries/{job_id}", get)
			mux.Handle("GET /v1/summaries/{job_id}/events", onceflow.EventsHandler(c, o.Tenant, onceflow.EventsConfig{}))
			return nil
		},
		Audit: func(ctx context.Context, c *onceflow.Client) (*onceflow.AuditReport, error) {
			return auditWorkflow(ctx, c, o)
		},
	}
}

// routes builds the POST and GET handlers.
func routes(c *onceflow.Client, o Options, m *workflowMetrics) (post, get http.Handler, err error) {
	if o.Tenant == nil {
		return nil, nil, errors.New("summaries: Options.Tenant is required")
	}
	if c.Inspector().DB() == nil {
		return nil, nil, errors.New("summaries: the Client needs Config.DB (GET reads the summaries table)")
	}
	o.Logger = cmp.Or(o.Logger, slog.Default())
	o.Timeout = cmp.Or(o.Timeout, onceflow.DefaultRouteTimeout)
	route, err := onceflow.Route(c, onceflow.RouteConfig[Request]{
		Tenant:           o.Tenant,
		Validate:         func(r *Request) error { return r.validate() },
		MaxBodyBytes:     MaxBodyBytes,
		Timeout:          o.Timeout,
		LockTTL:          o.LockTTL,
		MaxResponseBytes: o.MaxResponseBytes,
		Location:         func(_ *http.Request, id string) string { return "/v1/summaries/" + id },
	})
	if err != nil {
		return nil, nil, fmt.Errorf("summaries: %w", err)
	}
	unauthorized := o.Unauthorized
	if unauthorized == nil {
		unauthorized = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="onceflow"`)
			writeDetail(w, http.StatusUnauthorized, "authentication required")
		})
	}
	g := &getter{c: c, o: o}
	post = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := o.Tenant(r); err != nil {
			unauthorized.ServeHTTP(w, r)
			return
		}
		route.ServeHTTP(w, r) // onceflow_queue_enqueued_total is counted by the route
	})
	get = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, err := o.Tenant(r)
		if err != nil {
			unauthorized.ServeHTTP(w, r)
			return
		}
		g.serve(w, r, tenant)
	})
	return post, get, nil
}

// worker runs summary jobs (docs/workflows-summaries.md) on the public API.
type worker struct {
	o Options
	m *workflowMetrics
}

// Work skips a job whose summary exists, calls the model (Job.Complete: the ledger, the
// retry policy and the delivery's budget), and commits the summary together with the
// outbox row of its email (Job.Commit: one transaction that only the first delivery to
// finish can win). A provider outage hands the job back without spending a delivery; a
// transient failure leaves it for redelivery; anything else dead-letters it.
func (w *worker) Work(ctx context.Context, job *onceflow.Job[Request]) error {
	outcome, err := w.process(ctx, job)
	w.m.count(outcome, err)
	if w.o.OnJob != nil {
		w.o.OnJob(ctx, job.ID, outcome, err)
	}
	return err
}

func (w *worker) process(ctx context.Context, job *onceflow.Job[Request]) (Outcome, error) {
	log := w.o.Logger.With("job_id", job.ID, "tenant", job.Tenant)
	req := job.Args
	if err := req.validate(); err != nil { // what the route refuses, a producer may not
		return "", onceflow.Permanent(fmt.Errorf("invalid payload: %w", err))
	}
	db := job.Client().Inspector().DB()
	if db == nil {
		return "", onceflow.Permanent(errors.New("summaries: the Client needs Config.DB"))
	}
	// Cheap pre-check: a redelivered, already-finished job skips the model call (and a
	// job summarised before job_completions existed is not summarised again). Only an
	// optimisation; the guarantee is the job's completion record.
	var exists bool
	if err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM summaries WHERE job_id = $1)`, job.ID).Scan(&exists); err != nil {
		return "", onceflow.PostgresError(fmt.Errorf("check for an existing summary: %w", err))
	}
	if exists {
		log.InfoContext(ctx, "summary exists: duplicate delivery acknowledged", "deliveries", job.Delivery)
		return OutcomeDuplicate, nil
	}
	summary, err := w.summarise(ctx, job)
	if err != nil {
		switch {
		case errors.Is(err, onceflow.ErrUnavailable):
			log.WarnContext(ctx, "model provider unusable (its breaker is open: an exhausted quota or spend limit, or a run of failing calls); job handed back", "err", err)
		case errors.Is(err, onceflow.ErrWaiting): // counted by the limiter's metrics; a backlog puts many off
			log.DebugContext(ctx, "model call put off by the limiter; the job waits", "err", err)
		case !errors.Is(err, onceflow.ErrPermanent):
			log.WarnContext(ctx, "model call failed, left for redelivery", "deliveries", job.Delivery, "err", err)
		}
		return "", err
	}
	err = job.Commit(ctx, func(c *onceflow.Commit) error {
		c.Exec(`INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, $2, $3)`, job.ID, job.Tenant, summary)
		c.Emit(TopicSummaryReady, DedupeKey(job.ID), email{
			JobID:   job.ID,
			Tenant:  job.Tenant,
			To:      req.Notify,
			Subject: "Your summary is ready",
			Body:    "Your summary " + job.ID + " is ready: GET /v1/summaries/" + job.ID + "\n\n" + summary,
		})
		return nil
	})
	switch {
	case err != nil && !errors.Is(err, onceflow.ErrPermanent):
		return "", fmt.Errorf("store summary: %w", err)
	case err != nil: // an email intent of this job exists without its summary: a person must look
		return "", err
	case !job.Committed():
		log.InfoContext(ctx, "a concurrent delivery stored the summary first: duplicate")
		return OutcomeDuplicate, nil
	}
	log.InfoContext(ctx, "summary stored with its email intent", "deliveries", job.Delivery)
	return OutcomeDone, nil
}

// summarise asks the model for the summary: through the ledger, streamed (Job.Stream,
// step "summary": its text is on the ledger's row as it arrives, for
// GET /v1/summaries/{job_id}/events), or Options.Unledgered directly.
func (w *worker) summarise(ctx context.Context, job *onceflow.Job[Request]) (string, error) {
	req := &llm.Request{
		Model:    w.o.Model,
		Messages: []llm.Message{{Role: llm.RoleUser, Content: Prompt(job.Args.Text)}},
	}
	var resp *llm.Response
	switch {
	case w.o.Unledgered == nil && w.o.Batch > 0:
		step, err := job.Complete(ctx, "summary", req, onceflow.InBatch(w.o.Batch))
		if err != nil {
			return "", err
		}
		resp = step.Response
	case w.o.Unledgered == nil:
		stream := job.Stream(ctx, "summary", req)
		for _, err := range stream.All() {
			if err != nil {
				return "", err
			}
		}
		step := stream.Step()
		if step == nil {
			return "", fmt.Errorf("model: the stream ended without an answer")
		}
		resp = step.Response
	default:
		// The Idempotency-Key derives from the job, so a provider (or onceflow gateway)
		// that honours keys replays rather than re-bills a redelivered job's call.
		req.IdempotencyKey = "summary:" + job.ID
		var err error
		resp, err = retry.Do(ctx, w.o.Retry, retry.After(w.o.Budget), func(ctx context.Context) (*llm.Response, error) {
			return w.o.Unledgered.Complete(ctx, req)
		})
		switch {
		case err == nil:
		case retry.Outage(err):
			return "", onceflow.Unavailable(fmt.Errorf("model: %w", err))
		case retry.Transient(err):
			return "", err
		default:
			return "", onceflow.Permanent(fmt.Errorf("model: %w", err))
		}
	}
	// PostgreSQL's text holds no U+0000, which a model may answer with: drop it, or the
	// summary could never be stored.
	content := strings.ReplaceAll(resp.Content, "\x00", "")
	if content == "" {
		return "", onceflow.Permanent(fmt.Errorf("model returned an empty summary (finish reason %q)", resp.FinishReason))
	}
	return content, nil
}

// email is the payload of a summary_ready outbox row, as the senders read it.
type email struct {
	JobID   string `json:"job_id"`
	Tenant  string `json:"tenant"`
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// status is the body of GET /v1/summaries/{job_id}.
type status struct {
	JobID   string `json:"job_id"`
	Status  string `json:"status"`
	Summary string `json:"summary,omitempty"`
	Error   string `json:"error,omitempty"`
	// Waiting and RunAt: a queued job the model's limiter put off says why and until when.
	Waiting string     `json:"waiting,omitempty"`
	RunAt   *time.Time `json:"run_at,omitempty"`
}

// getter answers GET /v1/summaries/{job_id}.
type getter struct {
	c *onceflow.Client
	o Options
}

// serve answers a job's state: done (with the summary) from the summaries table; failed
// (with the dead-letter reason) or queued (waiting or running) from Client.JobState;
// 404 for an unknown id or another tenant's job, so a tenant cannot even learn that
// another's job exists; 503 when a store it needs does not answer.
func (g *getter) serve(w http.ResponseWriter, r *http.Request, tenant string) {
	id := r.PathValue("job_id")
	if !queue.IsUUID(id) {
		writeDetail(w, http.StatusNotFound, "no such job")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), g.o.Timeout)
	defer cancel()
	var owner, summary string
	err := g.c.Inspector().DB().QueryRow(ctx, `SELECT tenant, summary FROM summaries WHERE job_id = $1`, id).Scan(&owner, &summary)
	switch {
	case err == nil && owner == tenant:
		writeJSON(w, http.StatusOK, status{JobID: id, Status: "done", Summary: summary})
		return
	case err == nil:
		writeDetail(w, http.StatusNotFound, "no such job")
		return
	case !errors.Is(err, pgx.ErrNoRows):
		g.unavailable(w, r, "postgres", err)
		return
	}
	st, err := g.c.JobState(ctx, tenant, id)
	switch {
	case errors.Is(err, onceflow.ErrJobNotFound):
		writeDetail(w, http.StatusNotFound, "no such job")
	case err != nil:
		g.unavailable(w, r, "redis", err)
	case st.Status == onceflow.StatusFailed:
		writeJSON(w, http.StatusOK, status{JobID: id, Status: "failed", Error: st.Error})
	case st.Status == onceflow.StatusDone: // committed between the two reads
		writeJSON(w, http.StatusOK, status{JobID: id, Status: "done", Summary: g.summary(ctx, id)})
	default:
		out := status{JobID: id, Status: "queued", Waiting: st.Waiting}
		if st.Waiting != "" && !st.RunAt.IsZero() {
			out.RunAt = &st.RunAt
		}
		writeJSON(w, http.StatusOK, out)
	}
}

// summary reads a summary known to exist.
func (g *getter) summary(ctx context.Context, id string) string {
	var s string
	_ = g.c.Inspector().DB().QueryRow(ctx, `SELECT summary FROM summaries WHERE job_id = $1`, id).Scan(&s)
	return s
}

func (g *getter) unavailable(w http.ResponseWriter, r *http.Request, store string, err error) {
	g.o.Logger.WarnContext(r.Context(), "summaries: store unavailable", "store", store, "error", err)
	w.Header().Set("Retry-After", "1")
	writeDetail(w, http.StatusServiceUnavailable, store+" unavailable; retry later")
}
