package onceflow

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// DefaultAuditMaxAge is how long an outbox row may stay unsent or exhausted before
// Client.Audit reports it.
const DefaultAuditMaxAge = 10 * time.Minute

// auditMaxListed bounds the ids one violation lists.
const auditMaxListed = 10

// Audit checks onceflow's own invariants, those that hold for every kind, on live data
// and counts what it read; the report's Checked lists exactly that. A Workflow's Audit
// adds the checks of its own tables (for instance that every one of its rows has its
// effect: effects are tied to a job only by the dedupe keys the workflow chose).
//
// With Config.DB it reads job_completions (Counts "job_completions" and
// "job_completions <kind>" per kind) and the outbox ("outbox", "outbox sent",
// "outbox unsent", "outbox exhausted"); for each of the client's queues it reads the
// stream and its dead letters ("queue <name>", "queue <name> pending", "queue <name>
// dead"). The invariants:
//
//  1. no dead letter is of a job that has a completion record (a completed job that
//     was dead-lettered anyway: its redelivery outlived MaxDeliveries after its commit);
//  2. no stream entry has been pending for longer than twice its queue's ClaimIdle
//     (nothing reclaims it), nor is held by a run that started longer ago than its
//     queue's MaxRunTime plus twice its ClaimIdle (a run longer than any run may take,
//     which lease renewals keep from looking idle: queue.LongRuns);
//  3. no outbox row has been unsent, or exhausted, for longer than Config.AuditMaxAge
//     (its sender fails, or no process has a sender for its topic).
//
// Audit reads a moving system: a job finishing during the audit can show up in one count
// and not another, never as a violation. It returns an error only when a store cannot
// be read. Without Config.DB, only the queues are read (and invariant 1 is not checked).
func (c *Client) Audit(ctx context.Context) (*AuditReport, error) {
	r := &AuditReport{Counts: map[string]int64{}, Violations: []string{}}
	violate := func(format string, args ...any) { r.Violations = append(r.Violations, fmt.Sprintf(format, args...)) }
	// Redis first: a completion written after this read cannot be of a dead letter we
	// failed to see.
	dead := map[string][]string{} // queue -> dead-lettered job ids
	for _, name := range c.queueNames() {
		qc := c.queues[name]
		parts, err := c.QueuePartitions(ctx, name)
		if err != nil {
			return nil, fmt.Errorf("onceflow: audit queue %q: %w", name, err)
		}
		st, err := queue.ReadStatsOf(ctx, c.rdb, parts, queue.DefaultGroup)
		if err != nil {
			return nil, fmt.Errorf("onceflow: audit queue %q: %w", name, err)
		}
		q := "queue " + name
		r.Checked = append(r.Checked, q)
		r.Counts[q], r.Counts[q+" pending"], r.Counts[q+" dead"] = st.Length, st.Pending, st.Dead
		for _, keys := range parts {
			if err := c.auditPartition(ctx, keys, qc, dead, violate); err != nil {
				return nil, err
			}
		}
	}
	db := c.cfg.DB
	if db == nil {
		return r, nil
	}

	rows, err := db.Query(ctx, `SELECT kind, count(*) FROM job_completions GROUP BY kind ORDER BY kind`)
	if err != nil {
		return nil, fmt.Errorf("onceflow: audit job_completions: %w", err)
	}
	var kind string
	var n int64
	total := int64(0)
	_, err = pgx.ForEachRow(rows, []any{&kind, &n}, func() error {
		r.Counts["job_completions "+kind] = n
		total += n
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("onceflow: audit job_completions: %w", err)
	}
	r.Checked = append(r.Checked, "job_completions")
	r.Counts["job_completions"] = total
	for _, name := range c.queueNames() {
		if len(dead[name]) == 0 {
			continue
		}
		both, err := auditIDs(ctx, db, `SELECT job_id FROM job_completions WHERE job_id = ANY($1::text[]) ORDER BY job_id LIMIT $2`,
			dead[name], auditMaxListed)
		if err != nil {
			return nil, err
		}
		if len(both) > 0 {
			violate("queue %s: dead letters of completed jobs (job_completions has them): %v", name, both)
		}
	}

	st, err := pgoutbox.New(db).Stats(ctx)
	if err != nil {
		return nil, fmt.Errorf("onceflow: audit: %w", err)
	}
	r.Checked = append(r.Checked, "outbox")
	r.Counts["outbox"], r.Counts["outbox sent"], r.Counts["outbox unsent"], r.Counts["outbox exhausted"] = st.Total, st.Sent, st.Unsent, st.Exhausted
	maxAge := cmp.Or(c.cfg.AuditMaxAge, DefaultAuditMaxAge)
	old, err := auditIDs(ctx, db, `
		SELECT topic || ' ' || dedupe_key || CASE WHEN exhausted_at IS NOT NULL THEN ' (exhausted)' ELSE ' (unsent)' END FROM outbox
		WHERE sent_at IS NULL AND coalesce(exhausted_at, created_at) < now() - $1::bigint * interval '1 microsecond'
		ORDER BY id LIMIT $2`, maxAge.Microseconds(), auditMaxListed)
	if err != nil {
		return nil, err
	}
	if len(old) > 0 {
		violate("outbox rows unsent or exhausted for longer than %s: %v", maxAge, old)
	}
	return r, nil
}

// auditIDs runs a query returning one text column.
func auditIDs(ctx context.Context, db *pgxpool.Pool, sql string, args ...any) ([]string, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("onceflow: audit: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("onceflow: audit: %w", err)
	}
	return out, nil
}

// auditPartition checks the partition keys of a queue: its dead letters' job ids go to
// dead (by queue), its entries pending or running for too long to violate.
func (c *Client) auditPartition(ctx context.Context, keys queue.Keys, qc QueueConfig, dead map[string][]string, violate func(string, ...any)) error {
	for start := "-"; start != ""; {
		page, next, err := queue.ListDead(ctx, c.rdb, keys, start, 1000)
		if err != nil {
			return fmt.Errorf("onceflow: audit queue %q: %w", keys.Name(), err)
		}
		for _, d := range page {
			if d.JobID != "" {
				dead[keys.Queue] = append(dead[keys.Queue], d.JobID)
			}
		}
		start = next
	}
	idle := 2 * cmp.Or(qc.ClaimIdle, queue.DefaultClaimIdle)
	stale, err := queue.StalePending(ctx, c.rdb, keys, queue.DefaultGroup, idle, auditMaxListed)
	if err != nil {
		return fmt.Errorf("onceflow: audit queue %q: %w", keys.Name(), err)
	}
	if len(stale) > 0 {
		ids := make([]string, len(stale))
		for i, p := range stale {
			ids[i] = fmt.Sprintf("%s (consumer %s, idle %s)", p.ID, p.Consumer, p.Idle.Round(time.Second))
		}
		violate("queue %s: stream entries pending for longer than 2 x ClaimIdle (%s): %v", keys.Name(), idle, ids)
	}
	if run := cmp.Or(qc.MaxRunTime, queue.DefaultMaxRunTime); run > 0 {
		age := run + idle
		old, err := queue.LongRuns(ctx, c.rdb, keys, queue.DefaultGroup, time.Now().Add(-age), auditMaxListed)
		if err != nil {
			return fmt.Errorf("onceflow: audit queue %q: %w", keys.Name(), err)
		}
		if len(old) > 0 {
			ids := make([]string, len(old))
			for i, p := range old {
				ids[i] = fmt.Sprintf("%s (consumer %s, started %s)", p.ID, p.Consumer, p.Started.Format(time.RFC3339))
			}
			violate("queue %s: runs still holding their entry although they started longer ago than MaxRunTime + 2 x ClaimIdle (%s): %v", keys.Name(), age, ids)
		}
	}
	return nil
}
