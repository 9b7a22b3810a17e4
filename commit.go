package onceflow

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

// Commit collects what one job commits: its own statements (Exec), its effects (Emit)
// and its result (Result). Job.Commit and Job.CommitTx write all of it, with the job's
// completion record, in one transaction that only the first delivery of the job to
// commit can win. A Commit is valid only inside the func it was passed to, and is not
// safe for concurrent use.
//
// Its methods record their mistakes (an invalid topic or dedupe key, a payload that
// does not encode) instead of returning them: the first one makes the commit fail
// permanently, with nothing written.
type Commit struct {
	stmts     []statement
	effects   []outbox.Message
	result    []byte
	hasResult bool
	err       error
}

// statement is one Exec.
type statement struct {
	sql  string
	args []any
}

// ReservedTopicPrefix starts the topics of onceflow's own effects (TopicEnqueue): Emit
// refuses them and Config.Senders may not name them.
const ReservedTopicPrefix = "onceflow."

// Exec adds one of the job's own statements (an INSERT of its result row, an UPDATE of
// a ticket), run in order after the completion record and before the effects, with
// pgx's argument rules. A statement must not control the transaction (BEGIN, COMMIT,
// SAVEPOINT): the commit's atomicity rests on running them all in one. Its error, if it
// fails, is the commit's.
func (c *Commit) Exec(sql string, args ...any) {
	if strings.TrimSpace(sql) == "" {
		c.fail(errors.New("Exec: empty statement"))
		return
	}
	c.stmts = append(c.stmts, statement{sql: sql, args: args})
}

// Emit adds an effect: an outbox row of topic with dedupeKey and payload, which the
// relay hands to the topic's sender (Config.Senders) once the commit is in, with
// dedupeKey as the provider's idempotency key. topic is 1 to outbox.MaxTopicLen bytes
// of printable ASCII without spaces or "*", not starting with ReservedTopicPrefix;
// dedupeKey is 1 to MaxKeyLen printable ASCII characters, unique to the effect (derive
// it from the job id: "refund:"+job.ID), and unique within the commit. payload is
// encoded with encoding/json (a json.RawMessage is taken as it is, and must be valid).
func (c *Commit) Emit(topic, dedupeKey string, payload any) {
	switch {
	case !outbox.ValidTopic(topic):
		c.fail(fmt.Errorf("Emit: topic %q is not 1-%d printable ASCII characters without spaces or *", clipText(topic), outbox.MaxTopicLen))
		return
	case strings.HasPrefix(topic, ReservedTopicPrefix):
		c.fail(fmt.Errorf("Emit: topic %q: the prefix %q is onceflow's", topic, ReservedTopicPrefix))
		return
	case !validKey(dedupeKey):
		c.fail(fmt.Errorf("Emit %s: dedupe key %q is not 1-%d printable ASCII characters", topic, clipText(dedupeKey), MaxKeyLen))
		return
	}
	for _, e := range c.effects {
		if e.DedupeKey == dedupeKey {
			c.fail(fmt.Errorf("Emit %s: dedupe key %q emitted twice in one commit", topic, dedupeKey))
			return
		}
	}
	b, err := encodeJSON(payload)
	if err != nil {
		c.fail(fmt.Errorf("Emit %s %s: encode payload: %w", topic, dedupeKey, err))
		return
	}
	c.effects = append(c.effects, outbox.Message{Topic: topic, DedupeKey: dedupeKey, Payload: b})
}

// Result sets the job's result, stored (JSON-encoded, a json.RawMessage as it is) in its
// completion record and returned by Client.JobState as JobState.Result. The last call
// wins; without one the result is null.
func (c *Commit) Result(v any) {
	b, err := encodeJSON(v)
	if err != nil {
		c.fail(fmt.Errorf("Result: encode: %w", err))
		return
	}
	c.result, c.hasResult = b, true
}

func (c *Commit) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

// resultArg is the completion's result parameter: the JSON text, or NULL.
func (c *Commit) resultArg() any {
	if !c.hasResult {
		return nil
	}
	return string(c.result)
}

// encodeJSON encodes v, taking a json.RawMessage as it is once checked.
func encodeJSON(v any) ([]byte, error) {
	if raw, ok := v.(json.RawMessage); ok {
		if !json.Valid(raw) {
			return nil, errors.New("json.RawMessage is not valid JSON")
		}
		return raw, nil
	}
	return json.Marshal(v)
}

// clipText shortens text quoted in an error.
func clipText(s string) string { return clipRunes(s, 64) }

// clipRunes cuts s to at most n bytes on a rune boundary, marking a cut with "...".
func clipRunes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

// completeSQL inserts the job's completion record: the FIRST statement of Job.Commit's
// batch. It has no ON CONFLICT. When an earlier delivery of the job committed, it fails
// with a unique violation of job_completions_pkey, which aborts the batch's implicit
// transaction before any of the user's statements or effects ran; when a concurrent
// delivery holds the row uncommitted, it waits for that one's outcome first. So exactly
// one delivery's statements and effects are ever written.
//
//	$1 job_id, $2 kind, $3 tenant, $4 result (JSON text, or NULL), $5 queue
const completeSQL = `INSERT INTO job_completions (job_id, kind, tenant, result, queue) VALUES ($1, $2, $3, $4, $5)`

// claimCompletionSQL is the first statement of Job.CommitTx's transaction, sent with
// its BEGIN: the same guard as completeSQL, but ON CONFLICT DO NOTHING so that losing
// leaves the transaction usable for its rollback; no row affected means another
// delivery committed first. $1 job_id, $2 kind, $3 tenant, $4 queue.
const claimCompletionSQL = `INSERT INTO job_completions (job_id, kind, tenant, queue) VALUES ($1, $2, $3, $4) ON CONFLICT (job_id) DO NOTHING`

// setResultSQL stores CommitTx's result on the completion record it inserted.
// $1 job_id, $2 result (JSON text).
const setResultSQL = `UPDATE job_completions SET result = $2 WHERE job_id = $1`

// completionConstraint is the primary key of job_completions
// (migrations/00003_job_completions.sql).
const completionConstraint = "job_completions_pkey"

// isCompletionConflict reports whether err is the unique violation of a job's
// completion record: another delivery of the job committed first.
func isCompletionConflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == completionConstraint
}

// completionOwnerSQL reads who completed a job. $1 job_id.
const completionOwnerSQL = `SELECT tenant, kind FROM job_completions WHERE job_id = $1`

// checkCompletionOwner runs when rec's completion record exists already: it returns nil
// when that record is rec's job's (the same tenant and kind: another delivery of the
// job committed), and a permanent error matching ErrJobIDTaken when it is another job's
// that had the same id (a caller-chosen EnqueueOpts.JobID reused by another tenant or
// kind), so that job is dead-lettered with the reason instead of being taken as done.
// It costs one round trip, on this path only (and pgx deallocates the failed batch's
// statements before it, one more): a losing delivery's Commit takes three.
func (cl *Client) checkCompletionOwner(ctx context.Context, rec completion) error {
	var tenant, kind string
	// QueryExecModeExec: one round trip, no statement prepared on the connection.
	if err := cl.cfg.DB.QueryRow(ctx, completionOwnerSQL, pgx.QueryExecModeExec, rec.id).Scan(&tenant, &kind); err != nil {
		return PostgresError(fmt.Errorf("onceflow: commit job %s: read its completion record: %w", rec.id, err))
	}
	if tenant != rec.tenant || kind != rec.kind {
		// The reason reaches the job's tenant (JobState): it names neither the other
		// tenant nor its kind; the log, for the operator, does.
		cl.log.WarnContext(ctx, "onceflow: a job's id was completed by another job; it is dead-lettered",
			"job_id", rec.id, "kind", rec.kind, "tenant", rec.tenant, "completed_kind", kind, "completed_tenant", tenant)
		return Permanent(fmt.Errorf("onceflow: commit job %s: %w: the id was completed by another job (another tenant's or kind's)",
			rec.id, ErrJobIDTaken))
	}
	return nil
}

// completion identifies the job a commit completes.
type completion struct {
	id, kind, tenant string
	queue            string // the queue the job ran on
	traceparent      string // written on the outbox rows
	delivery         int
	// rt is the delivery's runtime: Commit records the model answers it holds in its
	// transaction (CommitTx before it begins), and a commit that wrote the record marks
	// it (committed).
	rt *runtime
}

// committedJob marks rt's delivery as having committed its job: the completion record is
// written, and with it the answers Queue put in the transaction; its durable commit,
// begun when rt.answers.Mark returned mark, made the answers recorded before it durable
// too.
func (rt *runtime) committedJob(mark uint64) {
	rt.committed.Store(true)
	rt.held.Committed()
	rt.answers.FlushedSince(mark)
}

// committer returns j's Client and the record of its commit, or an error when j cannot
// commit: no Config.DB, or a Job onceflow did not deliver.
func (j *Job[T]) committer(ctx context.Context) (*Client, completion, error) {
	if j.run == nil || j.run.client == nil {
		return nil, completion{}, Permanent(errors.New("onceflow: commit: the job was not delivered by a Client"))
	}
	c := j.run.client
	if c.cfg.DB == nil {
		return nil, completion{}, Permanent(fmt.Errorf("onceflow: commit job %s: Config.DB is required", j.ID))
	}
	tp := c.cfg.TraceParent(ctx) // the delivery's span when traced
	if tp == "" && j.run.delivery != nil {
		tp = j.run.delivery.TraceParent
	}
	return c, completion{id: j.ID, kind: j.Kind, tenant: j.Tenant, queue: j.Queue, traceparent: tp, delivery: j.Delivery, rt: j.run}, nil
}

// Commit writes the job's completion record, the statements, effects and result fn
// adds to its Commit, in ONE transaction sent as one pgx batch: one round trip, one
// commit. The completion record is its first statement, so the job's writes and effects
// happen once however many deliveries run it, and the user writes no ON CONFLICT.
//
// It returns nil when the job is done: this call committed it, or another delivery of
// the job had (then nothing of this call is written, it logs so, and it took two more
// round trips, one to check that the completion is this job's: see ErrJobIDTaken). A Worker may end
// with `return job.Commit(ctx, ...)`: a redelivered job is acknowledged. Otherwise:
//
//   - fn's error, as it is (nothing is sent);
//   - a mistake fn made with the Commit (see Commit), or an effect whose dedupe key
//     exists in the outbox without this job's completion: permanent (errors.Is
//     ErrPermanent; the latter also pgoutbox.ErrDuplicate), the job is dead-lettered;
//   - PostgreSQL unreachable or going away (a refused or lost connection, a server
//     shutting down or not yet accepting connections, too many connections): marked
//     Unavailable (errors.Is ErrUnavailable), wrapping pgx's error (errors.As), so the
//     job is handed back without spending a delivery and waits for the database. This
//     holds when the outcome is unknown too (the connection was lost after the COMMIT
//     was sent): the next delivery is safe, because if the commit did land its
//     completion record makes that delivery's commit a no-op that returns nil;
//   - a *ledger.SupersededError (errors.As) when another attempt recorded the answer of
//     a model step the job acted on before this delivery did: nothing is written, and
//     the next delivery replays the recorded answer (transient);
//   - any other database error, a failing statement of fn's included (a constraint, a
//     syntax error): transient, wrapping the *pgconn.PgError (errors.As), so the job is
//     delivered again and spends a delivery.
//
// Statements whose text is new to a pooled connection are first prepared by pgx (one
// more round trip, once per connection and statement), and after a failed commit the
// connection prepares the batch's statements again. Commit needs Config.DB; job_
// completions is created by the migrations package.
func (j *Job[T]) Commit(ctx context.Context, fn func(c *Commit) error) error {
	cl, rec, err := j.committer(ctx)
	if err != nil {
		return err
	}
	c := &Commit{}
	if fn != nil {
		if err := fn(c); err != nil {
			return err
		}
	}
	if c.err != nil {
		return Permanent(fmt.Errorf("onceflow: commit job %s: %w", rec.id, c.err))
	}
	err = cl.commit(ctx, rec, c, true)
	if err == nil {
		cl.postgresWorked()
	}
	return err
}

// commit sends rec's completion record and c as one batch and classifies the outcome.
// With again, a held answer found recorded since it was queued, by the delivery itself,
// sends the batch once more, with whatever is held by then.
func (cl *Client) commit(ctx context.Context, rec completion, c *Commit, again bool) error {
	b := &pgx.Batch{}
	b.Queue(completeSQL, rec.id, rec.kind, rec.tenant, c.resultArg(), rec.queue)
	held, err := rec.rt.held.Queue(b) // the step's answer, when the Commit follows it
	if err != nil {
		return fmt.Errorf("onceflow: commit job %s: %w", rec.id, heldError(err))
	}
	for _, s := range c.stmts {
		b.Queue(s.sql, s.args...)
	}
	firstEffect := b.Len()
	for _, m := range c.effects {
		m.Traceparent = rec.traceparent
		if err := pgoutbox.QueueInsert(b, m); err != nil {
			return Permanent(fmt.Errorf("onceflow: commit job %s: %w", rec.id, err))
		}
	}
	mark := rec.rt.answers.Mark()
	br := cl.cfg.DB.SendBatch(ctx, b)
	failed := -1
	for i := range b.Len() {
		if _, err = br.Exec(); err != nil {
			failed = i
			break
		}
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr // the commit itself failed (a deferred constraint, the connection)
	}
	switch {
	case err == nil:
		rec.rt.committedJob(mark)
		return nil
	case failed >= 1 && failed <= len(held) && ledger.IsSuperseded(err):
		// A held answer was recorded before this batch could: by another attempt (the
		// job acted on an answer that is not the recorded one: nothing committed, and
		// the next delivery replays the recorded one), or by this delivery since Queue
		// (another of its goroutines, an Enqueue beside the Commit). Recording what is
		// still held, or the error a recording found (Held.Err), tells which; in the
		// second case the batch goes again.
		rerr := rec.rt.releaseHeld(ctx, false)
		if rerr == nil && again {
			return cl.commit(ctx, rec, c, false)
		}
		if rerr == nil {
			rerr = &ledger.SupersededError{Key: held[failed-1]}
		}
		return fmt.Errorf("onceflow: commit job %s: %w", rec.id, rerr)
	case isCompletionConflict(err):
		if err := cl.checkCompletionOwner(ctx, rec); err != nil {
			return err
		}
		cl.log.InfoContext(ctx, "onceflow: job already done by another delivery; this delivery's commit is discarded",
			"job_id", rec.id, "kind", rec.kind, "delivery", rec.delivery)
		return nil
	case pgoutbox.IsDuplicate(err):
		key := "?"
		if failed >= firstEffect && failed-firstEffect < len(c.effects) {
			key = c.effects[failed-firstEffect].DedupeKey
		}
		return Permanent(fmt.Errorf("onceflow: commit job %s: effect %s exists without the job's completion: %w: %w",
			rec.id, key, pgoutbox.ErrDuplicate, err))
	}
	return PostgresError(fmt.Errorf("onceflow: commit job %s: %s: %w", rec.id, batchStep(failed, len(held), firstEffect, c), err))
}

// batchStep names the statement failed is the index of in a commit batch whose
// completion record is followed by held model answers.
func batchStep(failed, held, firstEffect int, c *Commit) string {
	switch {
	case failed < 0:
		return "commit"
	case failed == 0:
		return "completion record"
	case failed <= held:
		return "model answer"
	case failed < firstEffect:
		return fmt.Sprintf("statement %d (Exec)", failed-held)
	case failed-firstEffect < len(c.effects):
		return "effect " + c.effects[failed-firstEffect].DedupeKey
	}
	return fmt.Sprintf("statement %d", failed)
}

// CommitTx is Commit for a job that must read inside its transaction: it begins a
// transaction whose first statement, sent with the BEGIN in one round trip, inserts the
// job's completion record (ON CONFLICT DO NOTHING). When another delivery committed
// first, it rolls back without calling fn and returns nil. Otherwise fn runs with the
// transaction (read with tx, write with tx or with c.Exec) and the Commit; then c's
// result, statements and effects are sent as one batch in the transaction, and it
// commits: three round trips plus fn's own. A delivery that meets a concurrent one
// waits for it at the first statement.
//
// fn must not commit or roll back tx. Errors are Commit's: fn's as it is (the
// transaction is rolled back), except that an error of fn's that says PostgreSQL is
// unreachable, when tx's connection is indeed lost, is marked Unavailable; a mistake
// with c or a duplicate effect permanent; PostgreSQL unreachable Unavailable (an
// unknown outcome included, see Commit); any other database error transient.
func (j *Job[T]) CommitTx(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx, c *Commit) error) error {
	cl, rec, err := j.committer(ctx)
	if err != nil {
		return err
	}
	if fn == nil {
		fn = func(context.Context, pgx.Tx, *Commit) error { return nil }
	}
	err = cl.commitTx(ctx, rec, fn)
	if err == nil {
		cl.postgresWorked()
	}
	return err
}

// rollbackTimeout bounds a rollback, which runs even when the job's context is done.
const rollbackTimeout = 5 * time.Second

func (cl *Client) commitTx(ctx context.Context, rec completion, fn func(context.Context, pgx.Tx, *Commit) error) error {
	if err := rec.rt.releaseHeld(ctx, false); err != nil { // fn may read them in tx; tx's commit flushes them
		return err
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(claimCompletionSQL, rec.id, rec.kind, rec.tenant, rec.queue)
	br := cl.cfg.DB.SendBatch(ctx, b)
	_, err := br.Exec() // BEGIN
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	tx := br.Tx()
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		defer cancel()
		_ = tx.Rollback(rctx) // after Commit: ErrTxClosed, ignored
	}()
	if err != nil {
		return PostgresError(fmt.Errorf("onceflow: commit job %s: completion record: %w", rec.id, err))
	}
	if tag.RowsAffected() == 0 {
		if err := cl.checkCompletionOwner(ctx, rec); err != nil {
			return err
		}
		cl.log.InfoContext(ctx, "onceflow: job already done by another delivery; this delivery's transaction is rolled back",
			"job_id", rec.id, "kind", rec.kind, "delivery", rec.delivery)
		return nil
	}
	c := &Commit{}
	if err := fn(ctx, tx, c); err != nil {
		if tx.Conn().IsClosed() { // fn's statement met the outage, not another dependency's
			return PostgresError(err)
		}
		return err
	}
	if c.err != nil {
		return Permanent(fmt.Errorf("onceflow: commit job %s: %w", rec.id, c.err))
	}
	rest := &pgx.Batch{}
	if c.hasResult {
		rest.Queue(setResultSQL, rec.id, string(c.result))
	}
	for _, s := range c.stmts {
		rest.Queue(s.sql, s.args...)
	}
	firstEffect := rest.Len()
	for _, m := range c.effects {
		m.Traceparent = rec.traceparent
		if err := pgoutbox.QueueInsert(rest, m); err != nil {
			return Permanent(fmt.Errorf("onceflow: commit job %s: %w", rec.id, err))
		}
	}
	if rest.Len() > 0 {
		rbr := tx.SendBatch(ctx, rest)
		failed := -1
		for i := range rest.Len() {
			if _, err = rbr.Exec(); err != nil {
				failed = i
				break
			}
		}
		if cerr := rbr.Close(); err == nil {
			err = cerr
		}
		if pgoutbox.IsDuplicate(err) {
			key := "?"
			if failed >= firstEffect {
				key = c.effects[failed-firstEffect].DedupeKey
			}
			return Permanent(fmt.Errorf("onceflow: commit job %s: effect %s exists without the job's completion: %w: %w",
				rec.id, key, pgoutbox.ErrDuplicate, err))
		}
		if err != nil {
			step := "statement"
			if failed >= firstEffect {
				step = "effect " + c.effects[failed-firstEffect].DedupeKey
			}
			return PostgresError(fmt.Errorf("onceflow: commit job %s: %s: %w", rec.id, step, err))
		}
	}
	mark := rec.rt.answers.Mark()
	if err := tx.Commit(ctx); err != nil {
		return PostgresError(fmt.Errorf("onceflow: commit job %s: commit: %w", rec.id, err))
	}
	rec.rt.committedJob(mark)
	return nil
}
