// Package pgoutbox is the PostgreSQL side of package outbox, on pgx v5: Insert writes a
// row inside the caller's transaction, and Store is the relay's outbox.Store plus the
// operator queries behind `onceflow outbox` and `onceflow audit`.
//
// It works on the outbox table of migrations/00001_schema.sql in the schema the
// connection's search_path selects. Every method is one statement, so one round trip;
// QueueInsert adds the insert to the caller's batch instead.
package pgoutbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/outbox"
)

// ErrDuplicate is returned by Insert when a row with the same dedupe key exists. The
// UNIQUE dedupe_key is the backstop of the outbox: a caller that believed it was the
// only writer of this effect was wrong.
var ErrDuplicate = errors.New("outbox row with this dedupe key exists")

// ErrNotExhausted is returned by Retry for a row that exists but is not exhausted.
var ErrNotExhausted = errors.New("outbox row is not exhausted")

// ErrNotFound is returned by Retry for an id with no row.
var ErrNotFound = errors.New("no such outbox row")

// DB is what Store needs from a connection: *pgxpool.Pool, *pgx.Conn and pgx.Tx have it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// insertSQL adds one row. ON CONFLICT DO NOTHING keeps the caller's transaction usable
// when the dedupe key exists (no unique violation aborts it); no row returned means a
// duplicate. $1 topic, $2 dedupe_key, $3 payload, $4 traceparent (NULL when empty).
const insertSQL = `
INSERT INTO outbox (topic, dedupe_key, payload, traceparent)
VALUES ($1, $2, $3, NULLIF($4, ''))
ON CONFLICT (dedupe_key) DO NOTHING
RETURNING id`

// Insert writes m (Topic, DedupeKey, Payload and Traceparent; other fields are ignored)
// as an outbox row inside tx, the caller's transaction, so that the row commits if and
// only if the caller's own writes do. It returns the new row's id, or ErrDuplicate
// (checkable with errors.Is) when the dedupe key exists; tx stays usable either way
// and the caller decides whether to commit. Payload must be valid JSON.
func Insert(ctx context.Context, tx pgx.Tx, m outbox.Message) (int64, error) {
	if err := check(m); err != nil {
		return 0, fmt.Errorf("insert outbox row: %w", err)
	}
	var id int64
	err := tx.QueryRow(ctx, insertSQL, m.Topic, m.DedupeKey, string(m.Payload), m.Traceparent).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("insert outbox row %q: %w", m.DedupeKey, ErrDuplicate)
	}
	if err != nil {
		return 0, fmt.Errorf("insert outbox row: %w", err)
	}
	return id, nil
}

// check reports what makes m unfit for a row.
func check(m outbox.Message) error {
	switch {
	case m.Topic == "":
		return errors.New("empty topic")
	case m.DedupeKey == "":
		return errors.New("empty dedupe key")
	case !json.Valid(m.Payload):
		return errors.New("payload is not valid JSON")
	}
	return nil
}

// insertStrictSQL adds one row with no ON CONFLICT: an existing dedupe key is a unique
// violation that aborts the transaction, which IsDuplicate recognises. It is for writers
// whose own first-writer-wins guard ran earlier in the same transaction (onceflow's
// Job.Commit inserts the job's completion record first): a duplicate key there means an
// effect exists without its writer's record, which must stop the commit, not pass.
// $1 topic, $2 dedupe_key, $3 payload, $4 traceparent (NULL when empty).
const insertStrictSQL = `
INSERT INTO outbox (topic, dedupe_key, payload, traceparent)
VALUES ($1, $2, $3, NULLIF($4, ''))`

// QueueInsert queues on b the insert of m (Topic, DedupeKey, Payload and Traceparent)
// as an outbox row, for a batch that commits it with the caller's own statements in one
// round trip (a batch sent outside a transaction runs as one implicit transaction).
// Unlike Insert it has no ON CONFLICT: when the dedupe key exists, the statement fails
// with the error IsDuplicate recognises and the batch's transaction is rolled back. It
// returns an error, and queues nothing, when m has an empty topic or dedupe key or a
// payload that is not valid JSON.
func QueueInsert(b *pgx.Batch, m outbox.Message) error {
	if err := check(m); err != nil {
		return fmt.Errorf("queue outbox row: %w", err)
	}
	b.Queue(insertStrictSQL, m.Topic, m.DedupeKey, string(m.Payload), m.Traceparent)
	return nil
}

// dedupeConstraint is the name PostgreSQL gave the UNIQUE constraint of
// outbox.dedupe_key (migrations/00001_schema.sql).
const dedupeConstraint = "outbox_dedupe_key_key"

// IsDuplicate reports whether err is, or wraps, the unique violation of the outbox's
// dedupe key: what a QueueInsert of an existing key fails with.
func IsDuplicate(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == dedupeConstraint
}

// Store is the relay's outbox.Store on PostgreSQL, plus the listing, retry and
// statistics queries of the CLI and the audit. It is safe for concurrent use.
type Store struct {
	db DB
}

var (
	_ outbox.Store             = (*Store)(nil)
	_ outbox.TopicStore        = (*Store)(nil)
	_ outbox.OldestUnsentStore = (*Store)(nil)
)

// New returns a Store on db, normally a *pgxpool.Pool.
func New(db DB) *Store { return &Store{db: db} }

// claimSQL leases up to $3 due rows to relay $1 for $2 microseconds, in one statement
// that commits before any send, so no row lock is held across a network call.
//
// Due: unsent, not exhausted, next attempt due, and no live lease. FOR UPDATE SKIP
// LOCKED lets concurrent claims pass each other instead of waiting, and PostgreSQL
// re-checks the WHERE clause on a row whose lease another claim committed meanwhile,
// so two claims never lease the same row. The order follows the outbox_due index;
// rows are never selected by "id greater than the last one seen", because ids commit
// out of order. The CTE keeps the LIMIT applied once, before the UPDATE.
const claimSQL = claimHead + claimTail

// claimTopicsSQL is claimSQL restricted to the rows whose topic is one of $4 or starts
// with one of $5 (outbox.TopicSet): a relay leaves the rows of topics it does not send
// to the relays that do, without claiming or counting an attempt on them. Rows of other
// topics are skipped in the same outbox_due scan.
const claimTopicsSQL = claimHead + `
	  AND (topic = ANY($4::text[]) OR EXISTS (SELECT 1 FROM unnest($5::text[]) AS p(prefix) WHERE starts_with(topic, p.prefix)))` + claimTail

const claimHead = `
WITH due AS (
	SELECT id FROM outbox
	WHERE sent_at IS NULL AND exhausted_at IS NULL AND next_attempt_at <= now()
	  AND (claimed_until IS NULL OR claimed_until < now())`

const claimTail = `
	ORDER BY next_attempt_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED
)
UPDATE outbox o SET claimed_by = $1, claimed_until = now() + $2::bigint * interval '1 microsecond'
FROM due WHERE o.id = due.id
RETURNING o.id, o.topic, o.dedupe_key, o.payload, o.attempts, coalesce(o.traceparent, ''), o.created_at, o.next_attempt_at`

// Claim implements outbox.Store.
func (s *Store) Claim(ctx context.Context, relay string, limit int, lease time.Duration) ([]outbox.Message, error) {
	return s.claim(ctx, claimSQL, relay, lease.Microseconds(), limit)
}

// ClaimTopics implements outbox.TopicStore: Claim of the rows whose topic is in topics.
// A set that selects no topic claims nothing, without a round trip.
func (s *Store) ClaimTopics(ctx context.Context, relay string, topics outbox.TopicSet, limit int, lease time.Duration) ([]outbox.Message, error) {
	if topics.All() {
		return s.Claim(ctx, relay, limit, lease)
	}
	if len(topics.Topics) == 0 && len(topics.Prefixes) == 0 {
		return nil, nil
	}
	exact, prefixes := topics.Topics, topics.Prefixes
	if exact == nil {
		exact = []string{}
	}
	if prefixes == nil {
		prefixes = []string{}
	}
	return s.claim(ctx, claimTopicsSQL, relay, lease.Microseconds(), limit, exact, prefixes)
}

// claim runs one of the claim statements and returns the rows in due order.
func (s *Store) claim(ctx context.Context, sql string, args ...any) ([]outbox.Message, error) {
	rows, err := s.db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	type claimed struct {
		m   outbox.Message
		due time.Time
	}
	var got []claimed
	for rows.Next() {
		var c claimed
		var payload []byte
		if err := rows.Scan(&c.m.ID, &c.m.Topic, &c.m.DedupeKey, &payload, &c.m.Attempts,
			&c.m.Traceparent, &c.m.CreatedAt, &c.due); err != nil {
			rows.Close()
			return nil, fmt.Errorf("claim: %w", err)
		}
		c.m.Payload = payload
		got = append(got, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	// RETURNING follows no ORDER BY: restore the due order.
	slices.SortFunc(got, func(a, b claimed) int {
		if c := a.due.Compare(b.due); c != 0 {
			return c
		}
		return int(a.m.ID - b.m.ID)
	})
	msgs := make([]outbox.Message, len(got))
	for i, c := range got {
		msgs[i] = c.m
	}
	return msgs, nil
}

// Outcome codes of settleSQL.
const (
	settleSent     = 0
	settleFailed   = 1
	settleExhaust  = 2
	settleReleased = 3
	settleOutage   = 4
)

// settleSQL records a batch's outcome in one statement: for each ($2 id, $3 outcome,
// $4 error, $5 delay in microseconds), sent marks sent_at; failed adds an attempt,
// stores the error and schedules the next attempt after the delay; exhaust adds an
// attempt, stores the error and sets exhausted_at; outage (a dependency was down,
// outbox.Failure.Outage) stores the error and schedules the next attempt after the
// delay without adding an attempt; released only clears the lease. Every outcome
// clears the lease.
//
// Fencing: only rows still claimed by relay $1, and not yet sent or exhausted, are
// touched. A relay whose lease ran out and whose rows another relay claimed since
// changes nothing; RETURNING says which rows were touched.
const settleSQL = `
UPDATE outbox o SET
	sent_at         = CASE WHEN f.outcome = 0 THEN now() ELSE o.sent_at END,
	attempts        = CASE WHEN f.outcome IN (1, 2) THEN o.attempts + 1 ELSE o.attempts END,
	last_error      = CASE WHEN f.outcome IN (1, 2, 4) THEN f.err ELSE o.last_error END,
	next_attempt_at = CASE WHEN f.outcome IN (1, 4) THEN now() + f.delay_us * interval '1 microsecond' ELSE o.next_attempt_at END,
	exhausted_at    = CASE WHEN f.outcome = 2 THEN now() ELSE o.exhausted_at END,
	claimed_by      = NULL,
	claimed_until   = NULL
FROM unnest($2::bigint[], $3::smallint[], $4::text[], $5::bigint[]) AS f(id, outcome, err, delay_us)
WHERE o.id = f.id AND o.claimed_by = $1 AND o.sent_at IS NULL AND o.exhausted_at IS NULL
RETURNING o.id, f.outcome`

// Settle implements outbox.Store in one statement for the whole batch.
func (s *Store) Settle(ctx context.Context, relay string, st outbox.Settlement) (outbox.Settled, error) {
	n := len(st.Sent) + len(st.Failed) + len(st.Released)
	if n == 0 {
		return outbox.Settled{}, nil
	}
	ids := make([]int64, 0, n)
	outcomes := make([]int16, 0, n)
	errs := make([]string, 0, n)
	delays := make([]int64, 0, n)
	add := func(id int64, o int16, e string, d time.Duration) {
		ids, outcomes, errs, delays = append(ids, id), append(outcomes, o), append(errs, e), append(delays, d.Microseconds())
	}
	for _, id := range st.Sent {
		add(id, settleSent, "", 0)
	}
	for _, f := range st.Failed {
		o := int16(settleFailed)
		switch {
		case f.Exhaust:
			o = settleExhaust
		case f.Outage:
			o = settleOutage
		}
		add(f.ID, o, f.Error, max(f.Delay, 0))
	}
	for _, id := range st.Released {
		add(id, settleReleased, "", 0)
	}
	rows, err := s.db.Query(ctx, settleSQL, relay, ids, outcomes, errs, delays)
	if err != nil {
		return outbox.Settled{}, fmt.Errorf("settle: %w", err)
	}
	var out outbox.Settled
	for rows.Next() {
		var id int64
		var o int16
		if err := rows.Scan(&id, &o); err != nil {
			rows.Close()
			return outbox.Settled{}, fmt.Errorf("settle: %w", err)
		}
		switch o {
		case settleSent:
			out.Sent = append(out.Sent, id)
		case settleFailed, settleOutage:
			out.Retrying = append(out.Retrying, id)
		case settleExhaust:
			out.Exhausted = append(out.Exhausted, id)
		default:
			out.Released = append(out.Released, id)
		}
	}
	if err := rows.Err(); err != nil {
		return outbox.Settled{}, fmt.Errorf("settle: %w", err)
	}
	return out, nil
}

// purgeSQL deletes up to $2 rows sent more than $1 microseconds ago, oldest first, using
// the outbox_sent index; small batches keep each delete short.
const purgeSQL = `
DELETE FROM outbox WHERE id IN (
	SELECT id FROM outbox
	WHERE sent_at IS NOT NULL AND sent_at < now() - $1::bigint * interval '1 microsecond'
	ORDER BY sent_at
	LIMIT $2
)`

// PurgeSent implements outbox.Store.
func (s *Store) PurgeSent(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	tag, err := s.db.Exec(ctx, purgeSQL, olderThan.Microseconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("purge: %w", err)
	}
	return tag.RowsAffected(), nil
}

// oldestUnsentSQL reads the age of the oldest unsent, not exhausted row from the
// outbox_due partial index (only pending rows), so it stays cheap on a large table.
const oldestUnsentSQL = `
SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
FROM outbox WHERE sent_at IS NULL AND exhausted_at IS NULL`

// OldestUnsent implements outbox.OldestUnsentStore: how long the oldest unsent, not
// exhausted row has waited, zero when there is none.
func (s *Store) OldestUnsent(ctx context.Context) (time.Duration, error) {
	var secs float64
	if err := s.db.QueryRow(ctx, oldestUnsentSQL).Scan(&secs); err != nil {
		return 0, fmt.Errorf("oldest unsent: %w", err)
	}
	return time.Duration(secs * float64(time.Second)), nil
}
