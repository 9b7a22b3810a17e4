package summaries

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// AuditConfig says where to look and what counts as too old.
type AuditConfig struct {
	// DB is the PostgreSQL database with summaries and outbox. Required.
	DB interface {
		pgoutbox.DB
	}
	// Redis holds the queue. Required.
	Redis redis.Cmdable
	// Keys names the queue; Group its consumer group. Required; Group defaults to
	// queue.DefaultGroup.
	Keys  queue.Keys
	Group string
	// Partitions are the queue's partitions (onceflow.Inspector.QueuePartitions). Default:
	// Keys alone.
	Partitions []queue.Keys
	// ClaimIdle is the workers' ONCEFLOW_CLAIM_IDLE: an entry pending for twice that is a
	// violation. Default: 2m.
	ClaimIdle time.Duration
	// MaxAge is ONCEFLOW_AUDIT_MAX_AGE: an outbox row unsent or exhausted for longer is a
	// violation. Default: 10m.
	MaxAge time.Duration
	// Retention is ONCEFLOW_OUTBOX_RETENTION: sent outbox rows are purged after it, so
	// only summaries younger than it must still have their outbox row. Default: 7 days.
	Retention time.Duration
	// MaxListed bounds how many offending ids each violation lists. Default: 10.
	MaxListed int
}

// Report is the result of Audit, the object `onceflow audit --json` prints.
type Report struct {
	Summaries       int64    `json:"summaries"`
	OutboxTotal     int64    `json:"outbox_total"`
	OutboxSent      int64    `json:"outbox_sent"`
	OutboxUnsent    int64    `json:"outbox_unsent"`
	OutboxExhausted int64    `json:"outbox_exhausted"`
	DLQ             int64    `json:"dlq"`
	StreamLength    int64    `json:"stream_length"`
	StreamPending   int64    `json:"stream_pending"`
	Violations      []string `json:"violations"`
	// LLMCalls counts the llm_calls ledger per provider and model: calls by state,
	// attempts, and the ambiguous attempts (each possibly billed twice by a provider
	// that ignores Idempotency-Key). Accounting, not an invariant: it adds no violation.
	LLMCalls []ledger.Stats `json:"llm_calls"`
}

// Audit checks the invariants of the summaries pipeline on live data and counts what it
// sees. The invariants:
//
//  1. every summary (younger than the outbox retention) has its outbox row, and every
//     email.summary_ready outbox row has its summary; UNIQUE(dedupe_key) makes "one"
//     exactly one;
//  2. no job id is both summarised and dead-lettered;
//  3. no stream entry has been pending for longer than twice ClaimIdle;
//  4. no outbox row has been unsent, or exhausted, for longer than MaxAge.
//
// A violation is reported as a sentence naming up to MaxListed offending ids. Audit reads
// a moving system: a job finishing during the audit can show up in one count and not
// another, never as a violation. Errors are returned only when a store cannot be read.
func Audit(ctx context.Context, cfg AuditConfig) (*Report, error) {
	if cfg.DB == nil || cfg.Redis == nil {
		return nil, errors.New("audit: DB and Redis are required")
	}
	if cfg.Group == "" {
		cfg.Group = queue.DefaultGroup
	}
	if cfg.ClaimIdle <= 0 {
		cfg.ClaimIdle = 2 * time.Minute
	}
	if cfg.MaxAge <= 0 {
		cfg.MaxAge = 10 * time.Minute
	}
	if cfg.Retention <= 0 {
		cfg.Retention = 7 * 24 * time.Hour
	}
	if cfg.MaxListed <= 0 {
		cfg.MaxListed = 10
	}
	r := &Report{Violations: []string{}}
	violate := func(format string, args ...any) { r.Violations = append(r.Violations, fmt.Sprintf(format, args...)) }

	// Redis first: a summary written after this read cannot be a dead-lettered job we
	// failed to see.
	parts := cfg.Partitions
	if len(parts) == 0 {
		parts = []queue.Keys{cfg.Keys}
	}
	qs, err := queue.ReadStatsOf(ctx, cfg.Redis, parts, cfg.Group)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	r.StreamLength, r.StreamPending, r.DLQ = qs.Length, qs.Pending, qs.Dead
	var deadJobs []string
	var stale []queue.PendingEntry
	for _, keys := range parts {
		for start := "-"; start != ""; {
			page, next, err := queue.ListDead(ctx, cfg.Redis, keys, start, 1000)
			if err != nil {
				return nil, fmt.Errorf("audit: %w", err)
			}
			for _, d := range page {
				if queue.IsUUID(d.JobID) {
					deadJobs = append(deadJobs, d.JobID)
				}
			}
			start = next
		}
		st, err := queue.StalePending(ctx, cfg.Redis, keys, cfg.Group, 2*cfg.ClaimIdle, int64(cfg.MaxListed))
		if err != nil {
			return nil, fmt.Errorf("audit: %w", err)
		}
		stale = append(stale, st...)
	}
	if len(stale) > 0 {
		ids := make([]string, len(stale))
		for i, p := range stale {
			ids[i] = fmt.Sprintf("%s (consumer %s, idle %s)", p.ID, p.Consumer, p.Idle.Round(time.Second))
		}
		violate("stream entries pending for longer than 2 x ONCEFLOW_CLAIM_IDLE (%s): %v", 2*cfg.ClaimIdle, ids)
	}

	if err := cfg.DB.QueryRow(ctx, `SELECT count(*) FROM summaries`).Scan(&r.Summaries); err != nil {
		return nil, fmt.Errorf("audit: count summaries: %w", err)
	}
	st, err := pgoutbox.New(cfg.DB).Stats(ctx)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	r.OutboxTotal, r.OutboxSent, r.OutboxUnsent, r.OutboxExhausted = st.Total, st.Sent, st.Unsent, st.Exhausted
	if r.LLMCalls, err = ledger.ReadStats(ctx, cfg.DB); err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}

	missing, err := ids(ctx, cfg.DB, `
		SELECT s.job_id::text FROM summaries s
		LEFT JOIN outbox o ON o.dedupe_key = 'summary_ready:' || s.job_id::text
		WHERE o.id IS NULL AND s.created_at > now() - $1::bigint * interval '1 microsecond'
		ORDER BY s.created_at LIMIT $2`, cfg.Retention.Microseconds(), cfg.MaxListed)
	if err != nil {
		return nil, err
	}
	if len(missing) > 0 {
		violate("summaries without their %s outbox row: %v", TopicSummaryReady, missing)
	}
	orphans, err := ids(ctx, cfg.DB, `
		SELECT o.dedupe_key FROM outbox o
		LEFT JOIN summaries s ON s.job_id::text = substr(o.dedupe_key, length('summary_ready:') + 1)
		WHERE o.topic = $1 AND s.job_id IS NULL
		ORDER BY o.id LIMIT $2`, TopicSummaryReady, cfg.MaxListed)
	if err != nil {
		return nil, err
	}
	if len(orphans) > 0 {
		violate("outbox rows without their summary: %v", orphans)
	}
	if len(deadJobs) > 0 {
		both, err := ids(ctx, cfg.DB, `SELECT job_id::text FROM summaries WHERE job_id = ANY($1::uuid[]) ORDER BY job_id LIMIT $2`, deadJobs, cfg.MaxListed)
		if err != nil {
			return nil, err
		}
		if len(both) > 0 {
			violate("jobs both summarised and dead-lettered: %v", both)
		}
	}
	old, err := ids(ctx, cfg.DB, `
		SELECT dedupe_key || CASE WHEN exhausted_at IS NOT NULL THEN ' (exhausted)' ELSE ' (unsent)' END FROM outbox
		WHERE sent_at IS NULL AND coalesce(exhausted_at, created_at) < now() - $1::bigint * interval '1 microsecond'
		ORDER BY id LIMIT $2`, cfg.MaxAge.Microseconds(), cfg.MaxListed)
	if err != nil {
		return nil, err
	}
	if len(old) > 0 {
		violate("outbox rows unsent or exhausted for longer than ONCEFLOW_AUDIT_MAX_AGE (%s): %v", cfg.MaxAge, old)
	}
	return r, nil
}

// ids runs a query returning one text column.
func ids(ctx context.Context, db pgoutbox.DB, sql string, args ...any) ([]string, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	return out, nil
}

// auditWorkflow is the workflow's Audit: Audit over the Client's stores, as an
// onceflow.AuditReport.
func auditWorkflow(ctx context.Context, c *onceflow.Client, o Options) (*onceflow.AuditReport, error) {
	if c.Inspector().DB() == nil {
		return nil, errors.New("audit: the Client needs Config.DB")
	}
	parts, err := c.Inspector().QueuePartitions(ctx, QueueName)
	if err != nil {
		return nil, err
	}
	r, err := Audit(ctx, AuditConfig{
		DB: c.Inspector().DB(), Redis: c.Inspector().Redis(), Keys: c.Inspector().QueueKeys(QueueName), Partitions: parts,
		ClaimIdle: o.Queue.ClaimIdle, MaxAge: o.AuditMaxAge, Retention: o.AuditRetention,
	})
	if err != nil {
		return nil, err
	}
	return &onceflow.AuditReport{
		Workflow: Name,
		Checked:  []string{"summaries", "outbox", "llm_calls", "queue " + QueueName},
		Counts: map[string]int64{
			"summaries": r.Summaries, "outbox": r.OutboxTotal, "outbox sent": r.OutboxSent,
			"outbox unsent": r.OutboxUnsent, "outbox exhausted": r.OutboxExhausted,
			"dlq": r.DLQ, "stream": r.StreamLength, "pending": r.StreamPending,
		},
		Violations: r.Violations,
	}, nil
}
