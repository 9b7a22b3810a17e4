package pgoutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/outbox"
)

// Row is an outbox row with its relay bookkeeping, as `onceflow outbox list` shows it.
type Row struct {
	outbox.Message
	// State is "sent", "exhausted", "claimed" (leased by a live relay) or "pending".
	State         string     `json:"state"`
	LastError     string     `json:"last_error,omitempty"`
	SentAt        *time.Time `json:"sent_at,omitempty"`
	NextAttemptAt time.Time  `json:"next_attempt_at"`
	ClaimedBy     string     `json:"claimed_by,omitempty"`
	ClaimedUntil  *time.Time `json:"claimed_until,omitempty"`
	ExhaustedAt   *time.Time `json:"exhausted_at,omitempty"`
}

// Row states ListOptions.State selects.
const (
	StateUnsent    = "unsent"    // neither sent nor exhausted: due, waiting for a retry, or claimed
	StateFailing   = "failing"   // unsent, and at least one attempt failed (last_error is set)
	StateExhausted = "exhausted" // the relay gave up: Retry makes it due again
	StateSent      = "sent"
)

// ListOptions selects the rows List returns.
type ListOptions struct {
	// Failed selects only exhausted rows (`onceflow outbox list --failed`), as State
	// StateExhausted does.
	Failed bool
	// State selects the rows in one state (State*). Default: "", every row.
	State string
	// Before selects the rows whose id is below it, for the next page of a listing
	// (ids only grow). Default: 0, from the newest.
	Before int64
	// DedupeKeyContains selects the rows whose dedupe key contains it: the effects of
	// a job, whose keys are derived from its id ("refund:"+job.ID, see
	// onceflow.Commit.Emit). Default: "", every row.
	DedupeKeyContains string
	// Limit caps the rows returned, newest first. Default: 100.
	Limit int
	// Topic selects the rows of one topic, or of a prefix when it ends in "." or "*"
	// ("email." or "email.*"), as outbox.Router's keys. Default: "", every topic.
	Topic string
}

const listSQL = `
SELECT id, topic, dedupe_key, payload, attempts, coalesce(traceparent, ''), created_at,
	CASE WHEN sent_at IS NOT NULL THEN 'sent'
	     WHEN exhausted_at IS NOT NULL THEN 'exhausted'
	     WHEN claimed_until >= now() THEN 'claimed'
	     ELSE 'pending' END,
	coalesce(last_error, ''), sent_at, next_attempt_at, coalesce(claimed_by, ''), claimed_until, exhausted_at
FROM outbox
WHERE (NOT $1 OR exhausted_at IS NOT NULL)
	AND ($3 = '' OR topic = $3 OR (right($3, 1) IN ('.', '*') AND starts_with(topic, rtrim($3, '*'))))
	AND ($4 = '' OR ($4 = 'sent' AND sent_at IS NOT NULL)
		OR ($4 IN ('unsent', 'failing') AND sent_at IS NULL AND exhausted_at IS NULL AND ($4 = 'unsent' OR last_error IS NOT NULL))
		OR ($4 = 'exhausted' AND exhausted_at IS NOT NULL AND sent_at IS NULL))
	AND ($5 = 0 OR id < $5)
	AND ($6 = '' OR strpos(dedupe_key, $6) > 0)
ORDER BY id DESC
LIMIT $2`

// List returns outbox rows, newest first.
func (s *Store) List(ctx context.Context, opts ListOptions) ([]Row, error) {
	limit := opts.Limit
	if limit <= 0 {
		limit = 100
	}
	switch opts.State {
	case "", StateUnsent, StateFailing, StateExhausted, StateSent:
	default:
		return nil, fmt.Errorf("list outbox: unknown state %q", opts.State)
	}
	rows, err := s.db.Query(ctx, listSQL, opts.Failed, limit, opts.Topic, opts.State, opts.Before, opts.DedupeKeyContains)
	if err != nil {
		return nil, fmt.Errorf("list outbox: %w", err)
	}
	defer rows.Close()
	var out []Row
	for rows.Next() {
		var r Row
		var payload []byte
		if err := rows.Scan(&r.ID, &r.Topic, &r.DedupeKey, &payload, &r.Attempts, &r.Traceparent,
			&r.CreatedAt, &r.State, &r.LastError, &r.SentAt, &r.NextAttemptAt, &r.ClaimedBy,
			&r.ClaimedUntil, &r.ExhaustedAt); err != nil {
			return nil, fmt.Errorf("list outbox: %w", err)
		}
		r.Payload = payload
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list outbox: %w", err)
	}
	return out, nil
}

// retrySQL makes exhausted rows due again: attempts 0, exhausted_at NULL, next attempt
// now. last_error is kept for the record. $1 is an id array, or NULL for every row.
const retrySQL = `
UPDATE outbox SET attempts = 0, exhausted_at = NULL, next_attempt_at = now(),
	claimed_by = NULL, claimed_until = NULL
WHERE exhausted_at IS NOT NULL AND sent_at IS NULL AND ($1::bigint[] IS NULL OR id = ANY($1))
RETURNING id`

// Retry makes the exhausted row id due again, with a fresh count of attempts. It
// returns ErrNotFound when there is no such row and ErrNotExhausted when the row is
// not exhausted (nothing changes then).
func (s *Store) Retry(ctx context.Context, id int64) error {
	var got int64
	err := s.db.QueryRow(ctx, retrySQL, []int64{id}).Scan(&got)
	if err == nil {
		return nil
	}
	var exists bool
	if qerr := s.db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM outbox WHERE id = $1)`, id).Scan(&exists); qerr != nil {
		return fmt.Errorf("retry outbox row %d: %w", id, qerr)
	}
	if exists {
		return fmt.Errorf("retry outbox row %d: %w", id, ErrNotExhausted)
	}
	return fmt.Errorf("retry outbox row %d: %w", id, ErrNotFound)
}

// RetryIDs makes the exhausted rows among ids due again, as Retry does, and returns
// how many it reset (rows that are not exhausted, or gone, are left as they are).
func (s *Store) RetryIDs(ctx context.Context, ids []int64) (int64, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	tag, err := s.db.Exec(ctx, retrySQL, ids)
	if err != nil {
		return 0, fmt.Errorf("retry outbox rows: %w", err)
	}
	return tag.RowsAffected(), nil
}

// RetryAll makes every exhausted row due again and returns how many it reset.
func (s *Store) RetryAll(ctx context.Context) (int64, error) {
	tag, err := s.db.Exec(ctx, retrySQL, nil)
	if err != nil {
		return 0, fmt.Errorf("retry exhausted outbox rows: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Stats are the outbox counts `onceflow audit` and metrics report.
type Stats struct {
	Total     int64 `json:"outbox_total"`
	Sent      int64 `json:"outbox_sent"`
	Unsent    int64 `json:"outbox_unsent"` // neither sent nor exhausted
	Exhausted int64 `json:"outbox_exhausted"`
	// OldestUnsentAge is the age of the oldest unsent, not exhausted row; zero if none.
	OldestUnsentAge time.Duration `json:"oldest_unsent_age"`
	// OldestExhaustedAge is the age of the oldest exhausted row; zero if none.
	OldestExhaustedAge time.Duration `json:"oldest_exhausted_age"`
}

const statsSQL = `
SELECT count(*),
	count(*) FILTER (WHERE sent_at IS NOT NULL),
	count(*) FILTER (WHERE sent_at IS NULL AND exhausted_at IS NULL),
	count(*) FILTER (WHERE exhausted_at IS NOT NULL AND sent_at IS NULL),
	coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE sent_at IS NULL AND exhausted_at IS NULL)), 0)::float8,
	coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE exhausted_at IS NOT NULL AND sent_at IS NULL)), 0)::float8
FROM outbox`

// Stats counts the outbox rows in one statement (a scan of the table: meant for audits
// and dashboards, not for every request).
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	var st Stats
	var unsentAge, exhaustedAge float64
	if err := s.db.QueryRow(ctx, statsSQL).Scan(&st.Total, &st.Sent, &st.Unsent, &st.Exhausted,
		&unsentAge, &exhaustedAge); err != nil {
		return Stats{}, fmt.Errorf("outbox stats: %w", err)
	}
	st.OldestUnsentAge = time.Duration(unsentAge * float64(time.Second))
	st.OldestExhaustedAge = time.Duration(exhaustedAge * float64(time.Second))
	return st, nil
}
