package ledger

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/jackc/pgx/v5"
)

// announceSQL marks the start of this attempt's streamed answer: the status and headers
// (response_meta) that a follower needs before the first byte, and an empty partial of
// this attempt's own, in the write that also renews the lease. It commits without
// waiting for the WAL flush (followerWrite).
//
//	$1 idem_key, $2 owner, $3 attempt, $4 meta, $5 now (NULL: now()), $6 lease µs
const announceSQL = `UPDATE llm_calls SET response_meta = $4, partial = '', partial_attempt = $3,
	lease_until = coalesce($5::timestamptz, now()) + $6::bigint * interval '1 microsecond',
	updated_at = now()
%s
WHERE idem_key = $1 AND owner = $2 AND state = 'in_flight'`

// followerWrite, joined into the UPDATEs of Announce and AppendPartial, commits them
// with synchronous_commit off (set_config(..., true) is SET LOCAL: this statement's
// transaction only). What they write serves followers of a stream in progress and the
// attempt after a crash; a crash of PostgreSQL can lose the last fraction of a second
// of it (until the WAL writer or any durable commit flushes it), which leaves the row
// as an earlier flush did: less partial output, an earlier lease, never a lost or
// doubled answer, since the answer itself (Succeed) is committed durably and its flush
// covers everything written before it. On a row that matches nothing, the setting may
// not be evaluated: nothing is written then. On a ledger over a pgx.Tx the setting would
// last until the caller's commit, so it is left out there (the writes are then durable).
const followerWrite = `FROM (SELECT set_config('synchronous_commit', 'off', true)) AS relaxed`

// Announce records, before the first partial output of a streamed answer, what a follower on
// another process needs to pass the stream on while it is still live (Progress): meta
// (for onceflow gateway, the status and headers) and the start of this attempt's
// partial output, which AppendPartial then extends. It reports false when the row is
// no longer this attempt's. One round trip, committed without waiting for the WAL
// flush (a PostgreSQL crash may lose it: followers then wait for the end), within
// Config.WriteTimeout; the lease is renewed with it.
func (a *Attempt) Announce(ctx context.Context, meta json.RawMessage) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, a.l.cfg.WriteTimeout)
	defer cancel()
	tag, err := a.l.db.Exec(ctx, a.l.sql.announce, a.call.Key, a.owner, a.number, JSONBSafe(meta), a.l.now(), micros(a.l.cfg.Lease))
	if err != nil {
		return false, dbError("announce the stream of "+a.call.Key, err)
	}
	a.mu.Lock()
	a.appended = 0 // the row's partial is this attempt's, empty
	a.mu.Unlock()
	return tag.RowsAffected() == 1, nil
}

// progressSQL reads what a follower of a call needs, in one round trip: the row's
// state, whether a live attempt owns it, the streamed output of the current attempt
// from byte `from` on (when that attempt announced its stream), and the recorded
// answer once there is one.
//
// A row is live as Begin's claim judges it (leaseLive), so that a follower never tries
// to claim a row Begin would not give it.
//
//	$1 idem_key, $2 from (bytes), $3 now (NULL: now()), $4 lease µs
var progressSQL = `WITH now AS (` + clockSQL("$3", "$4") + `)
SELECT state, request_hash, attempt,
	state = 'in_flight' AND owner IS NOT NULL AND ` + leaseLive + `,
	state = 'in_flight' AND partial_attempt = attempt AND response_meta IS NOT NULL,
	CASE WHEN state = 'in_flight' AND partial_attempt = attempt THEN
		substring(convert_to(coalesce(partial, ''), 'UTF8') FROM ($2::bigint + 1)::int) END,
	response_meta,
	CASE WHEN state = 'succeeded' THEN response END,
	CASE WHEN state = 'succeeded' THEN response_raw END,
	ambiguous
FROM llm_calls c, now WHERE c.idem_key = $1`

// Progress is what a follower of a call sees of it (Ledger.Progress).
type Progress struct {
	// State is the row's state; RequestHash the hash it was recorded with; Attempt the
	// current attempt's number.
	State       string
	RequestHash string
	Attempt     int
	// Live is true while an attempt owns the row and renews its lease: wait for it.
	// An in_flight row that is not Live (its attempt failed or died) is for the next
	// Begin to claim.
	Live bool
	// Streaming is true when the current attempt announced a streamed answer
	// (Attempt.Announce): Meta holds its status and headers and Partial its output
	// from the requested offset on, exactly as received.
	Streaming bool
	Partial   []byte
	// Meta is the announced or recorded meta.
	Meta json.RawMessage
	// Record is the recorded answer once State is succeeded.
	Record *Record
}

// Progress reads the call key for a follower that already has `from` bytes of its
// streamed output: onceflow gateway's requests that join a call in flight on another
// process poll it. It returns nil (and no error) when the key has no row.
func (l *Ledger) Progress(ctx context.Context, key string, from int) (*Progress, error) {
	var p Progress
	var partial, response, raw []byte
	var ambiguous int
	err := l.db.QueryRow(ctx, progressSQL, key, int64(from), l.now(), micros(l.cfg.Lease)).
		Scan(&p.State, &p.RequestHash, &p.Attempt, &p.Live, &p.Streaming, &partial, &p.Meta, &response, &raw, &ambiguous)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError("read the progress of "+key, err)
	}
	p.Partial = partial
	if p.State == StateSucceeded {
		p.Record = &Record{Key: key, Response: response, Raw: raw, Meta: p.Meta, Attempt: p.Attempt, Ambiguous: ambiguous}
	}
	return &p, nil
}
