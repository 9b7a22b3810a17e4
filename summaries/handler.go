package summaries

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/ledger"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// The side effect a finished job asks for: one email, sent by the outbox relay with the
// dedupe key as the provider's idempotency key.
const (
	// TopicSummaryReady is the outbox topic of the "summary ready" email.
	TopicSummaryReady = "email.summary_ready"
	// DefaultJobBudget is the deadline of one delivery, across model attempts and sleeps.
	DefaultJobBudget = 60 * time.Second
)

// DedupeKey returns the outbox dedupe key of a job's email: summary_ready:<job_id>.
func DedupeKey(jobID string) string { return "summary_ready:" + jobID }

// DB is what the handler needs from PostgreSQL: *pgxpool.Pool has it.
type DB interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// HandlerConfig configures the job handler.
type HandlerConfig struct {
	// DB stores summaries and outbox rows. Required.
	DB DB
	// LLM is the model. Required.
	LLM llm.Client
	// Model is the model name sent with each request; empty means the client's default.
	Model string
	// Ledger, when set, sends the model call through the llm_calls ledger (seed 001): the
	// response is recorded in a commit of its own before the summary is stored, so a
	// redelivered job whose response was recorded never calls the model again, even
	// when the summary's transaction failed after the call; and a delivery that meets
	// another delivery's call in flight waits for it instead of calling too. Default:
	// nil (no ledger: every delivery that passes the pre-check calls the model).
	Ledger *ledger.Ledger
	// Breaker, when set, stops model calls while the provider is unusable as a whole
	// (an exhausted quota or spend limit trips it; llm.WithBreaker): calls fail at once
	// without reaching the provider, and the job is handed back without spending a
	// delivery. Give the same breaker to the worker as its Gate, so that it takes no
	// new work meanwhile. Default: nil (a quota error still hands the job back, but
	// every delivery calls the provider).
	Breaker llm.Breaker
	// Provider names the model provider in the ledger's rows and metrics ("openai",
	// "anthropic", "fake"). Default: "llm".
	Provider string
	// Retry is the in-process retry policy of the model call; its PerCallTimeout is
	// ONCEFLOW_LLM_TIMEOUT and MaxAttempts ONCEFLOW_LLM_MAX_ATTEMPTS. Zero fields take
	// the retry package's defaults.
	Retry retry.Policy
	// Budget is the deadline of one delivery (ONCEFLOW_JOB_BUDGET). Default: 60s.
	Budget time.Duration
	// Logger receives the handler's logs. Default: slog.Default().
	Logger *slog.Logger
}

// Handler is the summaries job handler, seed 000's handle_summary_job: it skips a job
// whose summary exists, calls the model under the retry policy and the delivery budget,
// and stores the summary together with the outbox row of its email in one transaction,
// which only the first delivery to finish can win. It implements queue.Handler and is
// safe for concurrent use.
type Handler struct {
	cfg HandlerConfig
	log *slog.Logger
	llm llm.Client // cfg.LLM, through the ledger when cfg.Ledger is set
}

var _ queue.Handler = (*Handler)(nil)

// NewHandler checks cfg and returns the handler.
func NewHandler(cfg HandlerConfig) (*Handler, error) {
	if cfg.DB == nil || cfg.LLM == nil {
		return nil, errors.New("summaries handler: DB and LLM are required")
	}
	if cfg.Budget <= 0 {
		cfg.Budget = DefaultJobBudget
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Provider == "" {
		cfg.Provider = "llm"
	}
	h := &Handler{cfg: cfg, log: cfg.Logger, llm: cfg.LLM}
	if cfg.Ledger != nil {
		h.llm = cfg.Ledger.Wrap(cfg.Provider, cfg.LLM)
	}
	if cfg.Breaker != nil { // outside the ledger: a call the breaker stops writes no row
		h.llm = llm.WithBreaker(h.llm, cfg.Breaker)
	}
	return h, nil
}

// Outcome says what Process did with a job.
type Outcome string

const (
	// OutcomeDone: this delivery stored the summary and the email intent.
	OutcomeDone Outcome = "done"
	// OutcomeDuplicate: the summary existed (a redelivery, or a concurrent delivery won).
	OutcomeDuplicate Outcome = "duplicate"
)

// Handle implements queue.Handler: a nil error acknowledges the message; a provider
// outage (an exhausted quota or spend limit, an open breaker: retry.Outage) is wrapped
// with queue.Unavailable, so the job is handed back without spending a delivery; a
// transient failure (retryable model errors that outlived the attempts, the delivery
// deadline, a database error) leaves it pending for redelivery; anything else is
// wrapped with queue.Permanent and dead-lettered with its reason.
func (h *Handler) Handle(ctx context.Context, job *queue.Job) error {
	_, err := h.Process(ctx, job)
	return err
}

// Process is Handle that also reports the outcome, for tests and tools.
func (h *Handler) Process(ctx context.Context, job *queue.Job) (Outcome, error) {
	log := h.log.With("job_id", job.JobID, "tenant", job.Tenant)
	req, err := DecodeRequest(job.Payload)
	if err != nil {
		return "", queue.Permanent(fmt.Errorf("invalid payload: %w", err))
	}

	// Cheap pre-check: a redelivered, already-finished job skips the model call. Only an
	// optimisation; the guarantee is the primary key below.
	var exists bool
	if err := h.cfg.DB.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM summaries WHERE job_id = $1)`, job.JobID).Scan(&exists); err != nil {
		return "", fmt.Errorf("check for an existing summary: %w", err)
	}
	if exists {
		log.InfoContext(ctx, "summary exists: duplicate delivery acknowledged", "deliveries", job.Deliveries)
		return OutcomeDuplicate, nil
	}

	summary, err := h.summarise(ctx, job.JobID, req.Text)
	if err != nil {
		if retry.Outage(err) {
			log.WarnContext(ctx, "model provider unusable (quota or spend limit); job handed back", "err", err)
			return "", queue.Unavailable(fmt.Errorf("model: %w", err))
		}
		if retry.Transient(err) {
			log.WarnContext(ctx, "model call failed, left for redelivery", "deliveries", job.Deliveries, "err", err)
			return "", err
		}
		return "", queue.Permanent(fmt.Errorf("model: %w", err))
	}

	won, err := h.store(ctx, job, req, summary)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "outbox_dedupe_key_key":
		// The backstop fired: an email intent for this job exists without its summary.
		// Retrying cannot fix that; a person must look.
		return "", queue.Permanent(fmt.Errorf("outbox dedupe key %s exists without its summary: %w", DedupeKey(job.JobID), err))
	case err != nil:
		return "", fmt.Errorf("store summary: %w", err)
	}
	if !won {
		log.InfoContext(ctx, "a concurrent delivery stored the summary first: duplicate")
		return OutcomeDuplicate, nil
	}
	log.InfoContext(ctx, "summary stored with its email intent", "deliveries", job.Deliveries)
	return OutcomeDone, nil
}

// summarise calls the model through the retry policy under the delivery's budget. The
// request carries an Idempotency-Key derived from the job (the ledger turns it into its
// key, derived from the job and the request), so a provider (or onceflow gateway) that
// honours keys replays rather than re-bills a redelivered job's call. With the ledger,
// the answer is recorded before summarise returns.
func (h *Handler) summarise(ctx context.Context, jobID, text string) (string, error) {
	req := &llm.Request{
		Model:          h.cfg.Model,
		Messages:       []llm.Message{{Role: llm.RoleUser, Content: Prompt(text)}},
		IdempotencyKey: "summary:" + jobID,
	}
	resp, err := retry.Do(ctx, h.cfg.Retry, retry.After(h.cfg.Budget), func(ctx context.Context) (*llm.Response, error) {
		return h.llm.Complete(ctx, req)
	})
	if err != nil {
		return "", err
	}
	// PostgreSQL's text holds no U+0000, which a model may answer with: drop it, or the
	// summary could never be stored.
	content := strings.ReplaceAll(resp.Content, "\x00", "")
	if content == "" {
		return "", retry.Permanent(fmt.Errorf("model returned an empty summary (finish reason %q)", resp.FinishReason))
	}
	return content, nil
}

// Prompt is the instruction sent to the model for a text.
func Prompt(text string) string { return "Summarise for the account team:\n\n" + text }

// storeSQL writes the summary and, only when that insert wins, the outbox row of its
// email, in ONE statement: one round trip and one commit, atomic like a transaction.
//
// The summaries primary key with ON CONFLICT DO NOTHING RETURNING decides the winner
// when two deliveries race; the outbox insert reads the CTE, so a losing delivery writes
// no outbox row. The outbox insert has no ON CONFLICT: outbox.dedupe_key is UNIQUE, the
// backstop, and a violation aborts the whole statement (no summary either) and surfaces
// as an error instead of passing silently.
//
//	$1 job_id, $2 tenant, $3 summary, $4 topic, $5 dedupe_key, $6 payload, $7 traceparent
const storeSQL = `
WITH s AS (
	INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, $2, $3)
	ON CONFLICT (job_id) DO NOTHING
	RETURNING job_id
)
INSERT INTO outbox (topic, dedupe_key, payload, traceparent)
SELECT $4, $5, $6, NULLIF($7, '') FROM s`

// email is the payload of a summary_ready outbox row, as the senders read it.
type email struct {
	JobID   string `json:"job_id"`
	Tenant  string `json:"tenant"`
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// store runs storeSQL and reports whether this delivery won. The row's traceparent is
// the job's: when traced, the delivery's span (internal/tracing.Handler puts it there).
func (h *Handler) store(ctx context.Context, job *queue.Job, req Request, summary string) (bool, error) {
	payload, err := json.Marshal(email{
		JobID:   job.JobID,
		Tenant:  job.Tenant,
		To:      req.Notify,
		Subject: "Your summary is ready",
		Body:    "Your summary " + job.JobID + " is ready: GET /v1/summaries/" + job.JobID + "\n\n" + summary,
	})
	if err != nil {
		return false, err
	}
	tag, err := h.cfg.DB.Exec(ctx, storeSQL, job.JobID, job.Tenant, summary,
		TopicSummaryReady, DedupeKey(job.JobID), payload, job.TraceParent)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}
