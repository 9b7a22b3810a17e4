package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// MaxStepNameLen bounds the name of a recorded step (Do).
const MaxStepNameLen = 200

// toolStepPrefix starts the job_steps name of a tool call's record ("tool:" and its
// key); Do refuses names that start with it.
const toolStepPrefix = "tool:"

// The states of a job_steps row.
const (
	stepDone   = "done"
	stepIntent = "intent"
)

// stepRecord is one job_steps row as a delivery knows it.
type stepRecord struct {
	state  string
	result []byte
}

// jobSteps is what one delivery knows of its job's recorded steps: every row, read once
// at the first recorded step of the delivery, plus what the delivery recorded since; and
// the tool calls it keyed (ToolCalls), so their occurrences count once.
type jobSteps struct {
	mu      sync.Mutex
	loaded  bool
	records map[string]stepRecord
	// seen counts the tool calls keyed so far in this delivery by their content (tool
	// name and canonical arguments): the occurrence of the next identical call.
	seen map[string]int
	// calls are the keyed calls of each model step (by Step.Key), so that asking twice
	// for one step's calls does not count them twice.
	calls map[string][]ToolCall
}

// stepStore is the job_steps table of a Client with Config.DB.
type stepStore struct {
	db        *pgxpool.Pool
	retention time.Duration
	// intentRetention keeps an intent (Job.ToolAtMostOnce) as long as its job's dead
	// letter, should the job go in doubt.
	intentRetention time.Duration
	log             interface {
		WarnContext(ctx context.Context, msg string, args ...any)
		InfoContext(ctx context.Context, msg string, args ...any)
	}
}

// setupSteps prepares the recorded steps of Config.DB: their retention, checked against
// the queues' retry horizon as the ledger's is, and their purge in Run and RunWorkers.
func (c *Client) setupSteps() error {
	if c.cfg.DB == nil {
		return nil
	}
	if c.cfg.StepRetention < 0 {
		return fmt.Errorf("onceflow: Config.StepRetention %v must not be negative", c.cfg.StepRetention)
	}
	retention := cmp.Or(c.cfg.StepRetention, DefaultStepRetention)
	for _, name := range c.queueNames() {
		qc := c.queues[name]
		deliveries := cmp.Or(qc.MaxDeliveries, queue.DefaultMaxDeliveries)
		wait := max(cmp.Or(qc.ClaimIdle, queue.DefaultClaimIdle), cmp.Or(qc.RetryMax, queue.DefaultRetryMax))
		if horizon := time.Duration(deliveries) * (wait + c.cfg.JobBudget); retention < horizon {
			return fmt.Errorf("onceflow: Config.StepRetention %v must cover queue %q's retry horizon, MaxDeliveries × (max(ClaimIdle, RetryMax) + JobBudget) = %v", retention, name, horizon)
		}
	}
	// An intent whose call never recorded its result leaves its job in doubt, dead-lettered
	// until an operator resolves it: the intent is kept as long as a dead letter is, or a
	// replay of the dead letter would find no intent and call again.
	intents := retention
	for _, qc := range c.queues {
		intents = max(intents, cmp.Or(qc.DeadLetterRetention, queue.DefaultDeadLetterRetention))
	}
	intents = max(intents, cmp.Or(c.cfg.QueueDefaults.DeadLetterRetention, queue.DefaultDeadLetterRetention))
	c.steps = &stepStore{db: c.cfg.DB, retention: retention, intentRetention: intents, log: c.log}
	return nil
}

// DefaultStepRetention is how long a recorded step is kept after it was recorded
// (Config.StepRetention): as long as the ledger keeps a model call.
const DefaultStepRetention = ledger.DefaultRetention

// steps returns the delivery's view of its job's recorded steps, reading them from
// PostgreSQL at the first call of the delivery (one round trip).
func (rt *runtime) steps(ctx context.Context) (*jobSteps, error) {
	if rt == nil || rt.client == nil || rt.client.steps == nil {
		return nil, retry.Permanent(errors.New("onceflow: recorded steps need Config.DB (the job_steps table is in PostgreSQL)"))
	}
	// What the steps record may carry a held model answer: it is recorded first.
	if err := rt.releaseHeld(ctx, false); err != nil {
		return nil, err
	}
	js := &rt.recorded
	js.mu.Lock()
	defer js.mu.Unlock()
	if js.loaded {
		return js, nil
	}
	rows, err := rt.client.steps.db.Query(ctx, `SELECT name, state, result FROM job_steps WHERE tenant = $1 AND job_id = $2`,
		rt.delivery.Tenant, rt.delivery.JobID)
	if err != nil {
		return nil, PostgresError(fmt.Errorf("onceflow: read the job's recorded steps: %w", err))
	}
	records := map[string]stepRecord{}
	for rows.Next() {
		var name string
		var r stepRecord
		if err := rows.Scan(&name, &r.state, &r.result); err != nil {
			rows.Close()
			return nil, PostgresError(fmt.Errorf("onceflow: read the job's recorded steps: %w", err))
		}
		records[name] = r
	}
	if err := rows.Err(); err != nil {
		return nil, PostgresError(fmt.Errorf("onceflow: read the job's recorded steps: %w", err))
	}
	js.records, js.loaded = records, true
	return js, nil
}

// lookup returns the record of name, if the delivery knows one.
func (js *jobSteps) lookup(name string) (stepRecord, bool) {
	js.mu.Lock()
	defer js.mu.Unlock()
	r, ok := js.records[name]
	return r, ok
}

// remember notes a record the delivery wrote or found.
func (js *jobSteps) remember(name string, r stepRecord) {
	js.mu.Lock()
	defer js.mu.Unlock()
	js.records[name] = r
}

// forget drops what the delivery knew of name.
func (js *jobSteps) forget(name string) {
	js.mu.Lock()
	defer js.mu.Unlock()
	delete(js.records, name)
}

// recordDoneSQL records a step's result unless the step already has a record, and says
// whether it did. The transaction commits without waiting for its WAL flush
// (synchronous_commit off, for this statement only): a record lost in a crash of
// PostgreSQL within the WAL writer's delay makes the step run again, which its contract
// allows between fn's return and the record anyway; and every later durable commit (the
// ledger's row of the next model call, the job's Commit) flushes the WAL up to it first,
// so nothing that depends on the record outlives it.
//
//	$1 tenant, $2 job id, $3 name, $4 result, $5 tool, $6 arguments, $7 retention in microseconds
const recordDoneSQL = `
INSERT INTO job_steps (tenant, job_id, name, state, result, tool, arguments, expires_at)
SELECT $1, $2, $3, 'done', $4, $5, $6, now() + $7::bigint * interval '1 microsecond'
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
ON CONFLICT (tenant, job_id, name) DO NOTHING
RETURNING true`

// recordIntentSQL records that a tool call is about to run (Job.ToolAtMostOnce),
// durably (the session's synchronous_commit), unless the call has a record.
//
//	$1 tenant, $2 job id, $3 name, $4 tool, $5 arguments, $6 retention in microseconds
const recordIntentSQL = `
INSERT INTO job_steps (tenant, job_id, name, state, tool, arguments, expires_at)
VALUES ($1, $2, $3, 'intent', $4, $5, now() + $6::bigint * interval '1 microsecond')
ON CONFLICT (tenant, job_id, name) DO NOTHING
RETURNING true`

// fulfilIntentSQL records the result of a call whose intent this delivery recorded.
// Asynchronous as recordDoneSQL: a lost result leaves the intent, and the job in doubt.
// created_at becomes the time of the result, as a done record's is (the order of the
// job's events).
//
//	$1 tenant, $2 job id, $3 name, $4 result, $5 retention in microseconds
const fulfilIntentSQL = `
UPDATE job_steps SET state = 'done', result = $4, expires_at = now() + $5::bigint * interval '1 microsecond', created_at = now()
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'intent'`

// readStepSQL reads one record.
//
//	$1 tenant, $2 job id, $3 name
const readStepSQL = `SELECT state, result FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3`

// record writes name's result unless another delivery recorded one first, and returns
// the result every delivery gets: the first recorded.
func (rt *runtime) record(ctx context.Context, js *jobSteps, name string, result []byte, tool, args string) ([]byte, error) {
	s := rt.client.steps
	var won bool
	rt.writeMu.Lock()
	err := s.db.QueryRow(ctx, recordDoneSQL, rt.delivery.Tenant, rt.delivery.JobID, name, result, tool, args, s.retention.Microseconds()).Scan(&won)
	rt.writeMu.Unlock()
	switch {
	case err == nil:
		js.remember(name, stepRecord{state: stepDone, result: result})
		return result, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return nil, PostgresError(fmt.Errorf("onceflow: record step %q: %w", name, err))
	}
	r, err := rt.readStep(ctx, name)
	if err != nil {
		return nil, err
	}
	js.remember(name, r)
	if r.state != stepDone {
		return nil, fmt.Errorf("onceflow: record step %q: another delivery holds its intent", name)
	}
	return r.result, nil
}

// isNoRows reports whether err says a statement returned no row.
func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }

// readStep reads name's record from PostgreSQL.
func (rt *runtime) readStep(ctx context.Context, name string) (stepRecord, error) {
	var r stepRecord
	err := rt.client.steps.db.QueryRow(ctx, readStepSQL, rt.delivery.Tenant, rt.delivery.JobID, name).Scan(&r.state, &r.result)
	if err != nil {
		return r, PostgresError(fmt.Errorf("onceflow: read step %q: %w", name, err))
	}
	return r, nil
}

// Do runs fn as the step name of job, once: the first successful result is recorded in
// PostgreSQL (the job_steps table, Config.DB) and every later delivery of the job gets
// it back from the record without running fn again. It is for the work of a job whose
// result later steps depend on and that must not change between deliveries: a read
// whose answer carries a timestamp, a call that creates something, anything a model's
// next turn will see.
//
//   - name identifies the step in the job: 1 to MaxStepNameLen printable ASCII
//     characters, not starting with "tool:", "wait:", "signal:" or "approval:", the same
//     on every delivery.
//   - The result is encoded with encoding/json; every delivery, the first included, gets
//     the value decoded from the record, so R must survive a round trip through JSON.
//   - A failure of fn is returned as it is (classified by the Worker as any error) and
//     nothing is recorded: the next delivery runs fn again.
//   - Between fn's return and its record, a crash (of the process, or of PostgreSQL
//     before the record's WAL is flushed) makes the next delivery run fn again: fn runs
//     at least once and, recorded, never again. Pass a key derived from the job to what
//     fn calls (an Idempotency-Key: Job.ID and name) so a second run changes nothing;
//     for a downstream that honours no key, Job.ToolAtMostOnce records the intent first.
//   - Two deliveries running the step at once (a job taken over from a worker thought
//     dead) both run fn; the first record wins, and both return it.
//
// Do costs one PostgreSQL statement per step, plus one per delivery to read the job's
// records (at its first step), and no WAL flush of its own (see docs/workflows-agents.md).
func Do[R any, T JobArgs](ctx context.Context, job *Job[T], name string, fn func(ctx context.Context) (R, error)) (R, error) {
	var zero R
	if err := checkStepName(name); err != nil {
		return zero, err
	}
	js, err := job.run.steps(ctx)
	if err != nil {
		return zero, err
	}
	if r, ok := js.lookup(name); ok && r.state == stepDone {
		return decodeStep[R](name, r.result)
	}
	if err := job.run.flushBeforeEffect(ctx); err != nil {
		return zero, err
	}
	out, err := fn(ctx)
	if err != nil {
		return zero, err
	}
	enc, err := json.Marshal(out)
	if err != nil {
		return zero, retry.Permanent(fmt.Errorf("onceflow: step %q: encode the result: %w", name, err))
	}
	rec, err := job.run.record(ctx, js, name, enc, "", "")
	if err != nil {
		return zero, err
	}
	return decodeStep[R](name, rec)
}

// decodeStep decodes a recorded result.
func decodeStep[R any](name string, b []byte) (R, error) {
	var out R
	if err := json.Unmarshal(b, &out); err != nil {
		return out, retry.Permanent(fmt.Errorf("onceflow: step %q: the recorded result does not decode into %T: %w", name, out, err))
	}
	return out, nil
}

// checkStepName refuses a name Do cannot record.
func checkStepName(name string) error {
	if name == "" || len(name) > MaxStepNameLen {
		return retry.Permanent(fmt.Errorf("onceflow: step name %q is not 1-%d characters", clipText(name), MaxStepNameLen))
	}
	for i := 0; i < len(name); i++ {
		if name[i] < 0x20 || name[i] > 0x7e {
			return retry.Permanent(fmt.Errorf("onceflow: step name %q is not printable ASCII", clipText(name)))
		}
	}
	for _, p := range []string{toolStepPrefix, waitPrefix, signalPrefix, approvalPrefix, sleepPrefix} {
		if strings.HasPrefix(name, p) {
			return retry.Permanent(fmt.Errorf("onceflow: step name %q: the prefix %q is onceflow's", clipText(name), p))
		}
	}
	return nil
}

// purgeStepsSQL deletes one batch of expired records.
//
//	$1 batch size
const purgeStepsSQL = `
WITH doomed AS (
	SELECT tenant, job_id, name FROM job_steps
	WHERE expires_at < now()
	ORDER BY expires_at
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)
DELETE FROM job_steps s USING doomed
WHERE s.tenant = doomed.tenant AND s.job_id = doomed.job_id AND s.name = doomed.name`

// stepPurgeBatch is how many records one purge statement deletes.
const stepPurgeBatch = 1000

// stepPurgeInterval is how often Run purges expired records.
const stepPurgeInterval = time.Minute

// purge deletes every expired record, a batch per statement, and returns how many.
func (s *stepStore) purge(ctx context.Context) (int64, error) {
	return purgeInBatches(ctx, s.db, "expired job steps", purgeStepsSQL)
}

// run purges expired records every stepPurgeInterval until ctx is cancelled.
func (s *stepStore) run(ctx context.Context) error {
	return purgeEvery(ctx, s.log, "expired job steps", s.purge)
}

// purgeInBatches runs sql, a DELETE of at most $1 rows (then its own args), until a
// statement deletes fewer than stepPurgeBatch rows, and returns how many it deleted.
func purgeInBatches(ctx context.Context, db *pgxpool.Pool, what, sql string, args ...any) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, sql, append([]any{stepPurgeBatch}, args...)...)
		if err != nil {
			return total, fmt.Errorf("onceflow: purge %s: %w", what, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < stepPurgeBatch {
			return total, nil
		}
	}
}

// purgeEvery runs purge every stepPurgeInterval until ctx is cancelled, logging what
// it deleted and its failures (tried again at the next tick).
func purgeEvery(ctx context.Context, log interface {
	WarnContext(ctx context.Context, msg string, args ...any)
	InfoContext(ctx context.Context, msg string, args ...any)
}, what string, purge func(context.Context) (int64, error)) error {
	t := time.NewTicker(stepPurgeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		n, err := purge(ctx)
		if err != nil && ctx.Err() == nil {
			log.WarnContext(ctx, "onceflow: "+what+" purge failed; trying again later", "err", err)
		}
		if n > 0 {
			log.InfoContext(ctx, "onceflow: purged "+what, "rows", n)
		}
	}
}

// inDoubtSQL lists a job's tool calls in doubt.
//
//	$1 tenant, $2 job id
const inDoubtSQL = `
SELECT tool, arguments, substr(name, 6), created_at FROM job_steps
WHERE tenant = $1 AND job_id = $2 AND state = 'intent' ORDER BY created_at, name`

// inDoubt returns st, a failed job's state, as in doubt when it has tool calls in doubt.
func (c *Client) inDoubt(ctx context.Context, st *JobState) (*JobState, error) {
	calls, err := c.steps.inDoubt(ctx, st.Tenant, st.ID)
	if err != nil {
		return nil, err
	}
	if len(calls) > 0 {
		st.Status, st.InDoubt = StatusInDoubt, calls
	}
	return st, nil
}

// inDoubt lists a job's tool calls in doubt.
func (s *stepStore) inDoubt(ctx context.Context, tenant, id string) ([]InDoubtCall, error) {
	rows, err := s.db.Query(ctx, inDoubtSQL, tenant, id)
	if err != nil {
		return nil, fmt.Errorf("onceflow: read job %s's tool calls in doubt: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (InDoubtCall, error) {
		var c InDoubtCall
		return c, r.Scan(&c.Tool, &c.Arguments, &c.Key, &c.StartedAt)
	})
	if err != nil {
		return nil, fmt.Errorf("onceflow: read job %s's tool calls in doubt: %w", id, err)
	}
	return out, nil
}
