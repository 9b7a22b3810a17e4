package ledger

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/retry"
)

// Attempt is one attempt that owns a call's row: Begin returned it, the request is this
// caller's to make. End it with exactly one of Succeed, SucceedTx or Fail; until then
// it renews its lease every Lease/3 in the background, so other attempts wait for it
// instead of taking the row over. Its methods are safe for concurrent use.
type Attempt struct {
	l      *Ledger
	call   Call
	owner  string
	number int
	// ambiguous is the row's ambiguous count when this attempt claimed it.
	ambiguous int
	// prevPartial is the streamed output an earlier attempt left (prevAttempt its
	// number), if any.
	prevPartial string
	prevAttempt int

	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}

	mu   sync.Mutex
	lost bool // a renewal found the row no longer ours
	// appended is the bytes of partial output this attempt has written to the row
	// since it started it (the first AppendPartial, or Announce).
	appended int64
}

// start returns the Attempt owning c's row and starts its lease renewal, which stops
// when the attempt ends or ctx is done.
func (l *Ledger) start(ctx context.Context, c Call, owner string, number, ambiguous int, prevPartial string, prevAttempt int) *Attempt {
	a := &Attempt{l: l, call: c, owner: owner, number: number, ambiguous: ambiguous,
		prevPartial: prevPartial, prevAttempt: prevAttempt, stop: make(chan struct{}), done: make(chan struct{})}
	l.active.Add(1) // until end
	go a.renew(ctx)
	return a
}

// renewSQL extends the lease of a row this attempt still owns.
//
//	$1 idem_key, $2 owner, $3 now (NULL: now()), $4 lease µs
//
// Zero rows affected means the row is no longer ours (taken over, or ended).
const renewSQL = `UPDATE llm_calls SET lease_until = coalesce($3::timestamptz, now()) + $4::bigint * interval '1 microsecond'
WHERE idem_key = $1 AND owner = $2 AND state = 'in_flight'`

func (a *Attempt) renew(ctx context.Context) {
	defer close(a.done)
	t := time.NewTicker(max(a.l.cfg.Lease/3, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.l.cfg.WriteTimeout)
		tag, err := a.l.db.Exec(wctx, renewSQL, a.call.Key, a.owner, a.l.now(), micros(a.l.cfg.Lease))
		cancel()
		switch {
		case err != nil:
			a.l.log.WarnContext(ctx, "ledger: lease renewal failed; retrying at the next tick", "key", a.call.Key, "err", err)
		case tag.RowsAffected() == 0:
			a.mu.Lock()
			a.lost = true
			a.mu.Unlock()
			a.l.log.WarnContext(ctx, "ledger: lost the lease of a call (another attempt took it over); the first response recorded wins",
				"key", a.call.Key, "attempt", a.number)
			return
		}
	}
}

// end stops the lease renewal and waits for it.
func (a *Attempt) end() {
	a.stopOnce.Do(func() {
		close(a.stop)
		a.l.active.Add(-1)
	})
	<-a.done
}

// Key returns the row's key.
func (a *Attempt) Key() string { return a.call.Key }

// Number returns this attempt's number: 1 for the first, more after failures and
// take-overs.
func (a *Attempt) Number() int { return a.number }

// Ambiguous returns how many earlier attempts ended without knowing whether the
// provider did the work (each may have been billed).
func (a *Attempt) Ambiguous() int { return a.ambiguous }

// PreviousPartial returns the output an earlier attempt streamed before it failed (its
// attempt number, and the text persisted so far), or "", 0. Streams cannot resume, so
// this attempt makes a new generation; the partial is there for the task to decide
// what to show, log or discard.
func (a *Attempt) PreviousPartial() (text string, attempt int) { return a.prevPartial, a.prevAttempt }

// Lost reports whether a lease renewal found the row taken over by another attempt
// (this one stalled past the lease). Succeed still works: the first response recorded
// wins and every attempt returns it.
func (a *Attempt) Lost() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.lost
}

// succeedSQL records a response. It is an upsert so that a response is recorded even if
// the row vanished (a relaxed in-flight insert lost in a PostgreSQL crash), and it never
// overwrites a recorded response: the first response recorded wins. It moves expires_at
// to now + retention (never earlier than it was): a row that succeeds late in its
// window is kept a full retention after the success, so the redeliveries it serves
// replay it instead of calling the model again.
//
//	$1 idem_key, $2 work, $3 request_hash, $4 provider, $5 model, $6 response jsonb,
//	$7 response_raw, $8 response_meta, $9 attempt, $10 now (NULL: now()), $11 retention µs,
//	$12 tenant, $13 request (JSON, NULL for none)
//
// Returns the row's attempt and ambiguous counts when this call recorded the response;
// no row when a response was already recorded (or the hash differs). %s is where
// followerWrite goes in the answer that DeferFlush lets commit without waiting for the
// WAL flush.
const succeedSQL = `
INSERT INTO llm_calls AS c (idem_key, work, state, request_hash, provider, model, response, response_raw, response_meta, attempt, expires_at, tenant, request)
SELECT $1, $2, 'succeeded', $3, $4, $5, $6, $7, $8, $9, coalesce($10::timestamptz, now()) + $11::bigint * interval '1 microsecond', $12, $13
%s
ON CONFLICT (idem_key) DO UPDATE SET
	state = 'succeeded', response = EXCLUDED.response, response_raw = EXCLUDED.response_raw,
	response_meta = EXCLUDED.response_meta, owner = NULL, lease_until = NULL, partial = NULL,
	partial_attempt = NULL, error = NULL, updated_at = now(),
	expires_at = greatest(c.expires_at, EXCLUDED.expires_at)
WHERE c.state <> 'succeeded' AND c.request_hash = EXCLUDED.request_hash
RETURNING c.attempt, c.ambiguous`

// Succeed records res as the call's response in a commit of its own, and returns the
// recorded Record with ours true; or, when another attempt recorded a response first
// (possible only after this one lost its lease), that attempt's Record with ours false:
// use it, so every attempt's effects agree on one response. It runs under
// context.WithoutCancel(ctx) bounded by Config.WriteTimeout, since a response that
// arrived is worth recording even when the caller gave up. It ends the attempt; its
// errors are database errors, or ErrKeyReused (permanent).
func (a *Attempt) Succeed(ctx context.Context, res Result) (rec *Record, ours bool, err error) {
	a.end()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.l.cfg.WriteTimeout)
	defer cancel()
	return a.succeed(ctx, a.l.db, res)
}

// SucceedTx is Succeed inside the caller's transaction tx, so that the response and the
// downstream write it causes commit together or not at all (docs/providers.md, "Tool calls"). Call it
// first in tx and derive the write from the returned Record: when ours is false,
// another attempt's response is the recorded one. It uses ctx as is. If tx rolls back,
// call Fail (or the row stays owned until its lease runs out, and is then counted as
// ambiguous).
func (a *Attempt) SucceedTx(ctx context.Context, tx DB, res Result) (rec *Record, ours bool, err error) {
	a.end()
	return a.succeed(ctx, tx, res)
}

// succeedArgs are succeedSQL's arguments recording res as this attempt's answer.
func (a *Attempt) succeedArgs(res Result) []any {
	c := a.call
	var response any // nil Response: SQL NULL, not the JSON text "null"
	if len(res.Response) > 0 {
		response = string(JSONBSafe(res.Response))
	}
	var meta any
	if len(res.Meta) > 0 {
		meta = string(res.Meta)
	}
	return []any{c.Key, c.Work, c.RequestHash, c.Provider, c.Model, response, res.Raw, meta,
		a.number, a.l.now(), micros(a.l.cfg.Retention), c.Tenant, c.Request}
}

// sameAnswer reports whether rec, the recorded answer, is res as this attempt
// recorded it: a write of this attempt's that committed although its writer did not
// learn so (or an identical answer: the same either way).
func (a *Attempt) sameAnswer(rec *Record, res Result) bool {
	return rec.Attempt == a.number && bytes.Equal(rec.Raw, res.Raw) && sameJSON(rec.Response, JSONBSafe(res.Response))
}

func (a *Attempt) succeed(ctx context.Context, db DB, res Result) (*Record, bool, error) {
	c := a.call
	rec := &Record{Key: c.Key, Response: res.Response, Raw: res.Raw, Meta: res.Meta}
	args := a.succeedArgs(res)
	scan := func(row pgx.Row) error { return row.Scan(&rec.Attempt, &rec.Ambiguous) }
	// The statement and its group: durable; without waiting for the flush under
	// DeferFlush (pending is then told of the answer); alone in the caller's transaction.
	sql, g := a.l.sql.succeed, a.l.answers
	var pending *Deferred
	switch d := deferredFrom(ctx); {
	case db != a.l.db: // the caller's transaction: its commit decides
		g = nil
	case d != nil:
		sql, g = a.l.sql.relaxedSucceed, a.l.relaxedAnswers
		if sql != a.l.sql.succeed { // not a ledger over a pgx.Tx
			pending = d
		}
	}
	var err error
	var again bool // written again alone after its group failed
	if g != nil {
		again, err = g.write(ctx, c.Key, args, scan, nil)
	} else {
		err = scan(db.QueryRow(ctx, sql, args...))
	}
	if err == nil {
		pending.add(c.Key)
		a.l.metrics.attempt(c, resultSucceeded)
		return rec, true, nil
	}
	if !isNoRows(err) {
		return nil, false, dbError("record response of "+c.Key, err)
	}
	// Not recorded: another response was, or the key holds another request.
	other, err := a.l.recordIn(ctx, db, c.Key)
	if err != nil {
		return nil, false, err
	}
	if other == nil {
		return nil, false, retry.Permanent(fmt.Errorf("%w: %s", ErrKeyReused, c.Key))
	}
	if again && a.sameAnswer(other, res) {
		// This attempt's own answer, recorded by its group transaction, which committed
		// as its connection dropped (or an identical one: the same either way).
		pending.add(c.Key)
		a.l.metrics.attempt(c, resultSucceeded)
		return other, true, nil
	}
	a.l.metrics.attempt(c, resultSuperseded)
	return other, false, nil
}

// sameJSON reports whether a and b are the same JSON value (jsonb reorders keys and
// drops whitespace); two empty documents are the same.
func sameJSON(a, b []byte) bool {
	if len(a) == 0 || len(b) == 0 {
		return len(a) == len(b)
	}
	var va, vb any
	if json.Unmarshal(a, &va) != nil || json.Unmarshal(b, &vb) != nil {
		return false
	}
	return reflect.DeepEqual(va, vb)
}

// isNoRows reports whether err says a statement returned no row.
func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }

// JSONBSafe returns b, a JSON document, in a form PostgreSQL's jsonb accepts: jsonb has
// no room for U+0000 (a "\u0000" escape is refused, SQLSTATE 22P05), which a model's
// answer may hold, so every U+0000 inside a string becomes U+FFFD. The raw bytes
// (Result.Raw, bytea) keep the answer as it was, and replays that need it byte for byte
// (the gateway's) use them. A document without the escape is returned as it is.
func JSONBSafe(b []byte) []byte {
	if !bytes.Contains(b, []byte(`\u0000`)) {
		return b
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if dec.Decode(&v) != nil {
		return b // not JSON: let PostgreSQL say so
	}
	out, err := json.Marshal(replaceNUL(v))
	if err != nil {
		return b
	}
	return out
}

// replaceNUL replaces U+0000 with U+FFFD in every string of v, keys included.
func replaceNUL(v any) any {
	switch x := v.(type) {
	case string:
		return strings.ReplaceAll(x, "\x00", "\uFFFD")
	case []any:
		for i := range x {
			x[i] = replaceNUL(x[i])
		}
		return x
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[strings.ReplaceAll(k, "\x00", "\uFFFD")] = replaceNUL(e)
		}
		return out
	}
	return v
}

func (l *Ledger) recordIn(ctx context.Context, db DB, key string) (*Record, error) {
	rec := &Record{Key: key}
	err := db.QueryRow(ctx, recordSQL, key).Scan(&rec.Response, &rec.Raw, &rec.Meta, &rec.Attempt, &rec.Ambiguous)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError("read recorded response of "+key, err)
	}
	return rec, nil
}

// failAmbiguousSQL ends an attempt that does not know whether the provider did the
// work: the row stays in_flight (the record that the work may have happened), the
// attempt number advances and the failure is counted; the owner is released so the
// next attempt claims the row at once instead of waiting for the lease.
//
//	$1 idem_key, $2 owner, $3 error
const failAmbiguousSQL = `UPDATE llm_calls SET attempt = attempt + 1, ambiguous = ambiguous + 1, owner = NULL,
	lease_until = NULL, error = $3, updated_at = now()
WHERE idem_key = $1 AND owner = $2 AND state = 'in_flight'`

// failClearSQL ends an attempt the provider answered with an error: the work was not
// done, so the row is failed (with the error) and the next attempt may claim it.
//
//	$1 idem_key, $2 owner, $3 error
const failClearSQL = `UPDATE llm_calls SET state = 'failed', attempt = attempt + 1, owner = NULL,
	lease_until = NULL, error = $3, updated_at = now()
WHERE idem_key = $1 AND owner = $2 AND state = 'in_flight'`

// Fail ends the attempt with cause. ambiguous says whether the provider may have done
// the work anyway (a timeout or a reset after the request was sent: see IsAmbiguous):
// the row then stays in_flight with the attempt counted as ambiguous; otherwise the
// row becomes failed with the error. Either way the next attempt claims the row at
// once. If the row was taken over meanwhile, Fail changes nothing (the take-over
// counted this attempt). It runs under context.WithoutCancel(ctx) bounded by
// Config.WriteTimeout, and returns only database errors.
func (a *Attempt) Fail(ctx context.Context, cause error, ambiguous bool) error {
	a.end()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.l.cfg.WriteTimeout)
	defer cancel()
	msg := "unknown error"
	if cause != nil {
		msg = truncate(cause.Error(), 1024)
	}
	sql, result := failClearSQL, resultFailed
	if ambiguous {
		sql, result = failAmbiguousSQL, resultAmbiguous
	}
	tag, err := a.l.db.Exec(ctx, sql, a.call.Key, a.owner, msg)
	if err != nil {
		return dbError("record failure of "+a.call.Key, err)
	}
	if tag.RowsAffected() == 1 {
		a.l.metrics.attempt(a.call, result)
		if ambiguous {
			a.l.metrics.ambiguousFailure(a.call)
		}
	}
	return nil
}

// appendPartialSQL appends streamed output to the row this attempt owns, and renews the
// lease while at it. A row whose partial belongs to an earlier attempt is overwritten:
// a new generation starts its own. It commits without waiting for the WAL flush
// (followerWrite), so a PostgreSQL crash can lose an append that was acknowledged: $7,
// the bytes this attempt believes it wrote, must be what the row holds, or nothing is
// appended (a later append after a lost one would leave a hole, and a follower would
// read the stream torn). Invariant: the row's partial is always a prefix of the
// attempt's output.
//
//	$1 idem_key, $2 owner, $3 attempt, $4 text, $5 now (NULL: now()), $6 lease µs,
//	$7 bytes written before (0: start this attempt's partial afresh)
const appendPartialSQL = `UPDATE llm_calls SET
	partial = CASE WHEN $7::bigint > 0 THEN partial || $4 ELSE $4 END,
	partial_attempt = $3,
	lease_until = coalesce($5::timestamptz, now()) + $6::bigint * interval '1 microsecond',
	updated_at = now()
%s
WHERE idem_key = $1 AND owner = $2 AND state = 'in_flight'
	AND ($7::bigint = 0 OR (partial_attempt = $3 AND octet_length(coalesce(partial, '')) = $7::bigint))`

// AppendPartial persists text as more of this attempt's streamed output, in one round
// trip within Config.WriteTimeout (a PostgreSQL that hangs holds the stream back no
// longer; batch the text: Client.Stream writes once per Config.StreamFlushBytes or
// StreamFlushInterval). It reports false when the row is no longer this attempt's, or
// no longer holds what this attempt wrote before (a crash of PostgreSQL lost an
// append): write no more partial output then.
// It does not end the attempt. The write commits without waiting for the WAL flush: a
// PostgreSQL crash can lose the last fraction of a second of partial output, never the
// answer that Succeed records.
func (a *Attempt) AppendPartial(ctx context.Context, text string) (bool, error) {
	if text == "" {
		return true, nil
	}
	a.mu.Lock()
	before := a.appended
	a.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, a.l.cfg.WriteTimeout)
	defer cancel()
	tag, err := a.l.db.Exec(ctx, a.l.sql.appendPartial, a.call.Key, a.owner, a.number, text, a.l.now(), micros(a.l.cfg.Lease), before)
	if err != nil {
		return false, dbError("persist partial output of "+a.call.Key, err)
	}
	a.l.metrics.partialFlushes.Inc()
	if tag.RowsAffected() != 1 {
		return false, nil
	}
	a.mu.Lock()
	a.appended = before + int64(len(text))
	a.mu.Unlock()
	return true, nil
}

// PartialBuffer batches streamed output into AppendPartial writes: one write when
// Config.StreamFlushBytes are buffered or Config.StreamFlushInterval passed since the
// last one, whichever comes first, never one per token. Since PostgreSQL rewrites the
// whole partial value at every append, the size that triggers a write grows with what
// was written (at least half of it), so that a long, fast stream costs writes in
// proportion to its length, not to its square. It is not safe for concurrent use (one
// stream feeds it).
type PartialBuffer struct {
	att       *Attempt
	buf       strings.Builder
	lastFlush time.Time
	written   int  // bytes written to the row so far
	stopped   bool // an append was refused: no more are written
}

// ErrPartialStopped is returned by PartialBuffer.Add and Flush when an append was
// refused (the row is no longer the attempt's, or a PostgreSQL crash lost an earlier
// append): the buffer writes nothing more, and the row keeps a prefix of the output.
var ErrPartialStopped = errors.New("ledger: partial output no longer persisted")

// PartialBuffer returns a PartialBuffer writing to this attempt's row.
func (a *Attempt) PartialBuffer() *PartialBuffer {
	return &PartialBuffer{att: a, lastFlush: a.l.clock().Now()}
}

// Add buffers text and writes the buffer when it is big or old enough. Its errors are
// AppendPartial's, and ErrPartialStopped once (after that, Add does nothing).
func (p *PartialBuffer) Add(ctx context.Context, text string) error {
	if p.stopped {
		return nil
	}
	p.buf.WriteString(text)
	cfg := p.att.l.cfg
	if p.buf.Len() >= max(cfg.StreamFlushBytes, p.written/2) || p.att.l.clock().Now().Sub(p.lastFlush) >= cfg.StreamFlushInterval {
		return p.Flush(ctx)
	}
	return nil
}

// Flush writes what is buffered, if anything (AppendPartial, within
// Config.WriteTimeout). When the write fails (PostgreSQL unavailable), the text stays
// buffered and the next Flush (or Add) writes it with what came after, so that the row
// never misses a piece of the output: an outage delays the partial output, and does not
// end it. (A failed write that did commit makes the next one find the row longer than
// this attempt believes: that write is refused, and ErrPartialStopped returned.)
func (p *PartialBuffer) Flush(ctx context.Context) error {
	p.lastFlush = p.att.l.clock().Now()
	if p.buf.Len() == 0 || p.stopped {
		return nil
	}
	text := p.buf.String()
	ok, err := p.att.AppendPartial(ctx, text)
	if err != nil {
		return err
	}
	p.buf.Reset()
	if !ok {
		p.stopped = true
		return ErrPartialStopped
	}
	p.written += len(text)
	return nil
}

// truncate cuts s to at most n bytes on a rune boundary.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// Record records res as call c's response without an attempt of this process: an answer
// that came another way, as a batch's result (onceflow's batch lane). As with Succeed,
// the first response recorded wins (recorded is false when one was already there), and
// a key recorded for another request is ErrKeyReused (permanent). It runs in a commit of
// its own on db (the Ledger's connection when nil).
func (l *Ledger) Record(ctx context.Context, db DB, c Call, res Result) (recorded bool, err error) {
	if db == nil {
		db = l.db
	}
	a := &Attempt{l: l, call: c, number: 1}
	_, ours, err := a.succeed(ctx, db, res)
	return ours, err
}
