package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/retry"
)

// insertSQL inserts the in_flight row of a new call, owned by this attempt, and in the
// same round trip reads the row that is there when the insert conflicts.
//
//	$1 idem_key, $2 work, $3 request_hash, $4 provider, $5 model, $6 owner,
//	$7 now (NULL: PostgreSQL's now()), $8 lease µs, $9 retention µs, $10 tenant,
//	$11 request (JSON, NULL for none)
//
// It returns one row: inserted true (the other columns NULL), or inserted false with the
// existing row's state, request_hash, attempt, owner and lease_until. When a concurrent
// insert committed after this statement's snapshot, the existing row is invisible and
// every column is NULL: the caller reads again. Invariant: at most one row per key, and
// a new row is in_flight with a live lease before any request goes out.
const insertSQL = `
WITH now AS (SELECT coalesce($7::timestamptz, now()) AS t%s),
ins AS (
	INSERT INTO llm_calls (idem_key, work, state, request_hash, provider, model, owner, lease_until, expires_at, tenant, request)
	SELECT $1, $2, 'in_flight', $3, $4, $5, $6,
		now.t + $8::bigint * interval '1 microsecond', now.t + $9::bigint * interval '1 microsecond', $10, $11
	FROM now
	ON CONFLICT (idem_key) DO NOTHING
	RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins), c.state, c.request_hash, c.attempt, c.owner, c.lease_until
FROM (SELECT 1) AS one
LEFT JOIN llm_calls c ON c.idem_key = $1 AND NOT EXISTS (SELECT 1 FROM ins)`

// relaxedCommit is spliced into insertSQL's first CTE when Config.RelaxedInsert is set:
// set_config(..., true) is SET LOCAL, so only this statement's commit skips the WAL
// flush.
const relaxedCommit = `, set_config('synchronous_commit', 'off', true) AS relaxed`

// peekSQL reads what Begin needs to decide about an existing row.
//
//	$1 idem_key
const peekSQL = `SELECT state, request_hash, attempt, owner, lease_until FROM llm_calls WHERE idem_key = $1`

// claimSQL gives an existing row to this attempt when nobody live owns it: a failed
// call, an in_flight row released after an ambiguous failure (owner NULL), or an
// in_flight row whose owner stopped renewing its lease (a dead owner: its attempt is
// counted as ambiguous and the attempt number advances). The row lock taken in `old`
// makes concurrent claims queue; only one of them finds the row claimable.
//
// A lease also counts from PostgreSQL's start (leaseLive): after a restart every
// owner gets one whole lease to renew, so that an outage longer than the lease does
// not make live owners look dead to the first request after it.
//
//	$1 idem_key, $2 request_hash, $3 owner, $4 now (NULL: now()), $5 lease µs
//
// Returns the new attempt number, the ambiguous count, whether a dead owner was taken
// over, and the partial output of an earlier attempt with its number; no row when the
// row is not claimable (succeeded, live, another hash, or gone).
var claimSQL = `
WITH now AS (` + clockSQL("$4", "$5") + `),
old AS (SELECT idem_key, owner IS NOT NULL AS dead FROM llm_calls WHERE idem_key = $1 FOR UPDATE)
UPDATE llm_calls c SET
	state = 'in_flight',
	owner = $3,
	lease_until = now.t + now.lease,
	attempt = c.attempt + CASE WHEN old.dead THEN 1 ELSE 0 END,
	ambiguous = c.ambiguous + CASE WHEN old.dead THEN 1 ELSE 0 END,
	updated_at = now()
FROM old, now
WHERE c.idem_key = old.idem_key AND c.request_hash = $2
	AND (c.state = 'failed' OR (c.state = 'in_flight' AND (c.owner IS NULL OR NOT ` + leaseLive + `)))
RETURNING c.attempt, c.ambiguous, old.dead, coalesce(c.partial, ''), coalesce(c.partial_attempt, 0)`

// clockSQL is the SELECT of the `now` relation that leaseLive reads: now.t, the
// caller's clock (the parameter named by clock; NULL: PostgreSQL's), now.real, whether
// that is PostgreSQL's own, and now.lease, the lease (the parameter named by lease, in
// µs).
func clockSQL(clock, lease string) string {
	return "SELECT coalesce(" + clock + "::timestamptz, now()) AS t, " + clock + "::timestamptz IS NULL AS real, " +
		lease + "::bigint * interval '1 microsecond' AS lease"
}

// leaseLive is the SQL condition that row c's lease still holds at now.t (clockSQL):
// its lease_until is not past, or, on PostgreSQL's own clock, the server started less
// than a lease ago. An owner cannot renew while PostgreSQL is down; counting the lease
// from the start as well gives a live owner one whole lease after an outage of any
// length to renew (it renews every Lease/3), instead of letting the first retry after
// the outage take over a call that is still running and make it a second time. A dead
// owner's row is taken over at most one lease after the restart. A test clock is left
// alone. Begin's claim and Progress judge liveness by it alike.
const leaseLive = `(c.lease_until >= now.t OR (now.real AND pg_postmaster_start_time() + now.lease >= now.t))`

// recordSQL reads a succeeded row for replay.
//
//	$1 idem_key
const recordSQL = `SELECT response, response_raw, response_meta, attempt, ambiguous FROM llm_calls
WHERE idem_key = $1 AND state = 'succeeded'`

// peeked is the part of a row Begin decides on.
type peeked struct {
	state, hash string
	attempt     int
	owner       *string
	leaseUntil  *time.Time
}

// Begin claims the call c for one attempt. Exactly one of its results is set:
//
//   - an *Attempt when this caller now owns the row: the row was inserted in_flight
//     (the first attempt), or taken from a failed attempt, from an attempt that ended
//     ambiguously, or from a dead owner whose lease ran out (that attempt is counted
//     as ambiguous). Make the request, then end the attempt with Succeed, SucceedTx
//     or Fail. The Attempt renews its lease every Lease/3 until then.
//   - a *Record when the call already succeeded: use the recorded response and do not
//     call again.
//   - an error: an *InFlightError (matching ErrInFlight, retryable) when a live
//     attempt still owns the call after waiting Config.Wait (bounded by ctx) with
//     backoff; an error matching ErrKeyReused (permanent) when the key is recorded
//     for another request; ctx's error; or a database error.
//
// The first round trip both inserts and, on conflict, reads the row, so a new call
// costs one round trip and one commit. Begin is safe for concurrent use; concurrent
// Begins of one key give the row to exactly one of them at a time.
func (l *Ledger) Begin(ctx context.Context, c Call) (*Attempt, *Record, error) {
	if c.Key == "" || c.RequestHash == "" {
		return nil, nil, retry.Permanent(errors.New("ledger: Call needs Key and RequestHash"))
	}
	owner := l.newOwner()
	clock := l.clock()
	waitUntil := clock.Now().Add(l.cfg.Wait)
	sql := l.sql.insert

	var inserted bool
	var state, hash *string
	var attempt *int
	var p peeked
	args := []any{c.Key, c.Work, c.RequestHash, c.Provider, c.Model, owner,
		l.now(), micros(l.cfg.Lease), micros(l.cfg.Retention), c.Tenant, c.Request}
	scan := func(row pgx.Row) error {
		return row.Scan(&inserted, &state, &hash, &attempt, &p.owner, &p.leaseUntil)
	}
	if err := ctx.Err(); err != nil { // the caller went away: write nothing
		return nil, nil, err
	}
	l.active.Add(1) // a call in progress (start counts its attempt)
	defer l.active.Add(-1)
	qctx, cancel := context.WithTimeout(ctx, l.cfg.WriteTimeout)
	var err error
	if l.inserts != nil {
		// A write its caller abandoned (ctx ended while its group ran) that committed
		// after all is released at once: no request went out.
		undo := func() {
			if inserted || (p.owner != nil && *p.owner == owner) {
				l.release(c, owner)
			}
		}
		_, err = l.inserts.write(qctx, c.Key, args, scan, undo)
	} else {
		err = scan(l.db.QueryRow(qctx, sql, args...))
	}
	cancel()
	if err != nil {
		if cerr := ctx.Err(); cerr != nil && errors.Is(err, cerr) {
			return nil, nil, err // the caller's own deadline or cancellation
		}
		return nil, nil, dbError("insert "+c.Key, err)
	}
	if state != nil && hash != nil && attempt != nil {
		p.state, p.hash, p.attempt = *state, *hash, *attempt
	}
	if inserted || (p.owner != nil && *p.owner == owner && p.state == StateInFlight) {
		// Inserted; or inserted by an earlier write of this very Begin whose outcome
		// was lost (a group transaction that committed as its connection dropped,
		// written again alone): the owner is this attempt's own random token.
		l.metrics.begin(c, outcomeNew)
		return l.start(ctx, c, owner, max(p.attempt, 1), 0, "", 0), nil, nil
	}

	for polls := 0; ; polls++ {
		if p.state == "" { // invisible to the insert's snapshot: look again
			if err := l.peek(ctx, c.Key, &p); err != nil {
				return nil, nil, err
			}
			if p.state == "" { // purged meanwhile: insert again
				return l.Begin(ctx, c)
			}
		}
		if p.hash != c.RequestHash {
			l.metrics.begin(c, outcomeKeyReused)
			return nil, nil, retry.Permanent(fmt.Errorf("%w: %s", ErrKeyReused, c.Key))
		}
		if p.state == StateSucceeded {
			rec, err := l.record(ctx, c.Key)
			if err != nil {
				return nil, nil, err
			}
			if rec != nil {
				l.metrics.begin(c, outcomeReplayed)
				return nil, rec, nil
			}
		} else if p.state == StateFailed || p.owner == nil || p.leaseUntil == nil || !p.leaseUntil.After(clock.Now()) {
			// Claimable as far as this process's clock can tell; PostgreSQL decides.
			att, err := l.claim(ctx, c, owner)
			if err != nil {
				return nil, nil, err
			}
			if att != nil {
				return att, nil, nil
			}
		}
		// A live owner (or a race just lost): wait for it, polling with backoff.
		left := waitUntil.Sub(clock.Now())
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < left {
			left = time.Until(dl)
		}
		if l.cfg.Wait < 0 || left <= 0 {
			l.metrics.begin(c, outcomeInFlight)
			e := &InFlightError{Key: c.Key, Attempt: p.attempt}
			if p.leaseUntil != nil {
				e.LeaseUntil = *p.leaseUntil
			}
			return nil, nil, e
		}
		d := retry.FullJitter(l.cfg.Rand, waitBase, waitCap, min(polls, 10))
		if err := clock.Sleep(ctx, max(min(d, left), time.Millisecond)); err != nil {
			return nil, nil, err
		}
		p = peeked{}
		if err := l.peek(ctx, c.Key, &p); err != nil {
			return nil, nil, err
		}
	}
}

// release ends the attempt owner began on c's row without making the request (its
// caller went away before Begin returned): the row becomes failed, claimable at once,
// and not counted as ambiguous.
func (l *Ledger) release(c Call, owner string) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.WriteTimeout)
	defer cancel()
	if _, err := l.db.Exec(ctx, failClearSQL, c.Key, owner, "abandoned before the request was sent"); err != nil {
		l.log.Warn("ledger: could not release a call whose caller went away; its lease will expire", "key", c.Key, "err", err)
	}
}

func (l *Ledger) peek(ctx context.Context, key string, p *peeked) error {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.WriteTimeout)
	defer cancel()
	err := l.db.QueryRow(ctx, peekSQL, key).Scan(&p.state, &p.hash, &p.attempt, &p.owner, &p.leaseUntil)
	if errors.Is(err, pgx.ErrNoRows) {
		*p = peeked{}
		return nil
	}
	if err != nil {
		return dbError("read "+key, err)
	}
	return nil
}

// claim runs claimSQL; a nil Attempt means the row was not claimable after all.
func (l *Ledger) claim(ctx context.Context, c Call, owner string) (*Attempt, error) {
	var attempt, ambiguous, prevAttempt int
	var dead bool
	var partial string
	qctx, cancel := context.WithTimeout(ctx, l.cfg.WriteTimeout)
	err := l.db.QueryRow(qctx, claimSQL, c.Key, c.RequestHash, owner, l.now(), micros(l.cfg.Lease)).
		Scan(&attempt, &ambiguous, &dead, &partial, &prevAttempt)
	cancel()
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError("claim "+c.Key, err)
	}
	if dead {
		l.metrics.ambiguousFailure(c)
		l.metrics.begin(c, outcomeTakenOver)
		l.log.WarnContext(ctx, "ledger: took over a call whose owner stopped renewing its lease; its attempt is counted as ambiguous",
			"key", c.Key, "work", c.Work, "attempt", attempt, "ambiguous", ambiguous)
	} else {
		l.metrics.begin(c, outcomeClaimed)
	}
	if prevAttempt == attempt { // not an earlier attempt's output
		partial, prevAttempt = "", 0
	}
	return l.start(ctx, c, owner, attempt, ambiguous, partial, prevAttempt), nil
}

// record reads a succeeded row; nil when it is not (or no longer) succeeded.
func (l *Ledger) record(ctx context.Context, key string) (*Record, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.WriteTimeout)
	defer cancel()
	return l.recordIn(ctx, l.db, key)
}
