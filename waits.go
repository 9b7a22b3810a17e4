package onceflow

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// The job_steps name prefixes of waits and of what ends them.
const (
	waitPrefix     = "wait:"
	signalPrefix   = "signal:"
	approvalPrefix = "approval:"
	// sleepPrefix names a Sleep's wait: no signal can carry it (checkStepName refuses
	// the prefix), so a sleep is ended by its time only.
	sleepPrefix = "sleep:"
)

// MaxWaitTimeout bounds the timeout of a wait (WaitSignal, Sleep, an approval).
const MaxWaitTimeout = 366 * 24 * time.Hour

// DefaultApprovalTimeout is how long a tool call waits for an operator's decision
// (AgentTool.ApprovalTimeout, ApprovalConfig.Timeout) before its timeout's outcome.
const DefaultApprovalTimeout = 24 * time.Hour

// waitRecord is what a wait's row holds: its deadline and, for an approval, what the
// operator decides on.
type waitRecord struct {
	Deadline  time.Time     `json:"deadline"`
	Tool      string        `json:"tool,omitempty"`
	Arguments string        `json:"arguments,omitempty"`
	Messages  []llm.Message `json:"messages,omitempty"`
}

// waitOutcome is what a wait found.
type waitOutcome struct {
	signal   []byte // the signal's payload, when it came
	came     bool
	timedOut bool
	deadline time.Time
}

// wait looks for the signal name of the job; without it, it records the wait (once:
// its deadline is the first delivery's) and returns the *retry.WaitError that parks the
// job in its queue's scheduled set until the deadline, unless a signal wakes it first
// (Client.Signal). Past the deadline it reports a timeout.
func (rt *runtime) wait(ctx context.Context, name string, timeout time.Duration, rec waitRecord) (waitOutcome, error) {
	var out waitOutcome
	if timeout <= 0 || timeout > MaxWaitTimeout {
		return out, retry.Permanent(fmt.Errorf("onceflow: wait %q: timeout %v is not between 0 and %v", clipText(name), timeout, MaxWaitTimeout))
	}
	js, err := rt.steps(ctx)
	if err != nil {
		return out, err
	}
	if r, ok := js.lookup(signalPrefix + name); ok && r.state == stepDone {
		out.signal, out.came = r.result, true
		return out, nil
	}
	s := rt.client.steps
	w, ok := js.lookup(waitPrefix + name)
	if !ok {
		rec.Deadline = time.Now().Add(timeout).UTC()
		enc, err := json.Marshal(rec)
		if err != nil {
			return out, retry.Permanent(fmt.Errorf("onceflow: wait %q: %w", clipText(name), err))
		}
		rt.writeMu.Lock()
		err = s.db.QueryRow(ctx, `INSERT INTO job_steps (tenant, job_id, name, state, result, tool, arguments, expires_at)
VALUES ($1, $2, $3, 'waiting', $4, $5, $6, $7::timestamptz + $8::bigint * interval '1 microsecond')
ON CONFLICT (tenant, job_id, name) DO NOTHING RETURNING true`,
			rt.delivery.Tenant, rt.delivery.JobID, waitPrefix+name, enc, rec.Tool, rec.Arguments, rec.Deadline, s.retention.Microseconds()).Scan(new(bool))
		rt.writeMu.Unlock()
		switch {
		case err == nil:
			w = stepRecord{state: "waiting", result: enc}
		case isNoRows(err):
			if w, err = rt.readStep(ctx, waitPrefix+name); err != nil {
				return out, err
			}
		default:
			return out, PostgresError(fmt.Errorf("onceflow: record wait %q: %w", clipText(name), err))
		}
		js.remember(waitPrefix+name, w)
	}
	var have waitRecord
	if err := json.Unmarshal(w.result, &have); err != nil {
		return out, retry.Permanent(fmt.Errorf("onceflow: wait %q: its record does not decode: %w", clipText(name), err))
	}
	out.deadline = have.Deadline
	left := time.Until(have.Deadline)
	if left <= 0 {
		out.timedOut = true
		return out, nil
	}
	// The job's records and its model turns' ledger rows must outlive the wait: a
	// resumed job replays them. One round trip for both tables.
	if _, err := s.db.Exec(ctx, `WITH steps AS (
	UPDATE job_steps SET expires_at = greatest(expires_at, $3::timestamptz + $4::bigint * interval '1 microsecond')
	WHERE tenant = $1 AND job_id = $2)
UPDATE llm_calls SET expires_at = greatest(expires_at, $3::timestamptz + $5::bigint * interval '1 microsecond')
WHERE split_part(work, '/', 2) = $2 AND tenant = $1`, rt.delivery.Tenant, rt.delivery.JobID, have.Deadline, s.retention.Microseconds(),
		rt.client.ledgerRetention().Microseconds()); err != nil {
		return out, PostgresError(fmt.Errorf("onceflow: wait %q: %w", clipText(name), err))
	}
	return out, &retry.WaitError{Delay: left, Reason: waitingFor(name)}
}

// waitingFor is what the job's index says a job waiting on the wait name waits for (its
// WaitError's Reason, JobState.Waiting): "sleep <name>" for a Sleep, else "signal <name>",
// which only that signal (or decision) wakes.
func waitingFor(name string) string {
	if rest, ok := strings.CutPrefix(name, sleepPrefix); ok {
		return "sleep " + rest
	}
	return "signal " + name
}

// WaitSignal waits for the signal name of job (Client.Signal) and returns its payload.
// The job does not hold a worker while it waits: without the signal, WaitSignal returns
// an error (a *retry.WaitError, ErrWaiting) that the Worker returns as it is, and the job
// waits in its queue's scheduled set (no worker slot, no lease, no attempt spent;
// JobState says queued, Waiting "signal <name>") until the signal wakes it or timeout
// passes. The job then runs again from the start, its recorded steps and model turns
// replayed, and WaitSignal returns the payload, or ErrWaitTimedOut (permanent) after the
// timeout, counted from the first delivery that waited. A signal that came before the
// job waited for it is returned at once.
func WaitSignal[T JobArgs](ctx context.Context, job *Job[T], name string, timeout time.Duration) (json.RawMessage, error) {
	if err := checkStepName(name); err != nil {
		return nil, err
	}
	out, err := job.run.wait(ctx, name, timeout, waitRecord{})
	switch {
	case err != nil:
		return nil, err
	case out.came:
		return json.RawMessage(out.signal), nil
	}
	return nil, retry.Permanent(fmt.Errorf("%w: signal %q did not come by %s", ErrWaitTimedOut, name, out.deadline.Format(time.RFC3339)))
}

// Sleep suspends job for d, durably: the job waits in its queue's scheduled set (no
// worker slot, no lease, no attempt spent), and a redelivery does not start the sleep
// again. name identifies the sleep in the job, as a step's name does. Sleep returns the
// error to return as it is while the job must sleep, and nil once d has passed.
func Sleep[T JobArgs](ctx context.Context, job *Job[T], name string, d time.Duration) error {
	if err := checkStepName(name); err != nil {
		return err
	}
	_, err := job.run.wait(ctx, sleepPrefix+name, d, waitRecord{})
	return err
}

// Signal sends the signal name, with payload (encoded with encoding/json), to tenant's
// job id: it is recorded (the first signal of a name stands: another payload is
// ErrAlreadySignalled; the same payload again, a retry, returns nil and wakes the job
// again, in case a failed wake left it parked), and a job waiting for it (WaitSignal) is
// made due at once; a job waiting for something else, or sleeping, is left alone and
// finds the signal when it asks for it. An unknown id or another tenant's job is
// ErrJobNotFound. It needs Config.DB.
func (c *Client) Signal(ctx context.Context, tenant, id, name string, payload any) error {
	if err := answersBeforeLeaving(ctx); err != nil {
		return err
	}
	_, err := c.signal(ctx, tenant, id, name, payload)
	return err
}

// signal is Signal, reporting whether the signal was a retry of one recorded with the
// same payload (answered as the first: the job is woken again, in case the first wake
// failed).
func (c *Client) signal(ctx context.Context, tenant, id, name string, payload any) (replayed bool, err error) {
	return c.signalIn(ctx, "", tenant, id, name, payload)
}

// signalIn is signal of a job on queue in ("": any the Client knows): a caller that
// knows the job's queue has its index read there alone.
func (c *Client) signalIn(ctx context.Context, in, tenant, id, name string, payload any) (replayed bool, err error) {
	if err := checkStepName(name); err != nil {
		return false, err
	}
	enc, err := json.Marshal(payload)
	if err != nil {
		return false, fmt.Errorf("onceflow: signal %q: encode the payload: %w", clipText(name), err)
	}
	keys, err := c.locate(ctx, tenant, id, in)
	if err != nil {
		return false, err
	}
	err = c.recordSignal(ctx, nil, tenant, id, name, enc)
	if errors.Is(err, ErrAlreadySignalled) {
		have, rerr := c.recorded(ctx, tenant, id, signalPrefix+name)
		if rerr != nil {
			return false, rerr
		}
		if !jsonEqual(have, enc) {
			return false, err
		}
		replayed = true
	} else if err != nil {
		return false, err
	}
	return replayed, c.wake(ctx, keys, tenant, id, waitingFor(name))
}

// jsonEqual reports whether a and b are the same JSON (compacted).
func jsonEqual(a, b []byte) bool {
	var ca, cb bytes.Buffer
	if json.Compact(&ca, a) != nil || json.Compact(&cb, b) != nil {
		return bytes.Equal(a, b)
	}
	return bytes.Equal(ca.Bytes(), cb.Bytes())
}

// locate returns the queue keys of tenant's job id, from its index: in queue in, or
// ("") in each queue the Client knows until found.
func (c *Client) locate(ctx context.Context, tenant, id, in string) (queue.Keys, error) {
	if c.steps == nil {
		return queue.Keys{}, errors.New("onceflow: signals need Config.DB (the job_steps table is in PostgreSQL)")
	}
	if !queue.ValidJobID(id) {
		return queue.Keys{}, ErrJobNotFound
	}
	queues := []string{in}
	if in == "" {
		queues = c.stateQueues()
	}
	for _, name := range queues {
		keys, _, err := c.findIndex(ctx, name, tenant, id)
		if err == nil {
			return keys, nil
		}
		if !errors.Is(err, ErrJobNotFound) {
			return queue.Keys{}, err
		}
	}
	return queue.Keys{}, ErrJobNotFound
}

// recordSignal records a signal (in tx when given), unless the job has it.
func (c *Client) recordSignal(ctx context.Context, tx pgx.Tx, tenant, id, name string, payload []byte) error {
	const sql = `INSERT INTO job_steps (tenant, job_id, name, state, result, expires_at)
VALUES ($1, $2, $3, 'done', $4, now() + $5::bigint * interval '1 microsecond')
ON CONFLICT (tenant, job_id, name) DO NOTHING RETURNING true`
	args := []any{tenant, id, signalPrefix + name, payload, c.steps.retention.Microseconds()}
	var row pgx.Row
	if tx != nil {
		row = tx.QueryRow(ctx, sql, args...)
	} else {
		row = c.steps.db.QueryRow(ctx, sql, args...)
	}
	err := row.Scan(new(bool))
	switch {
	case isNoRows(err):
		return fmt.Errorf("%w: job %s, signal %q", ErrAlreadySignalled, id, clipText(name))
	case err != nil:
		return PostgresError(fmt.Errorf("onceflow: record signal %q of job %s: %w", clipText(name), id, err))
	}
	return nil
}

// wake makes the job due now (queue.Wake). The signal is recorded already: a job that
// is not in the scheduled set finds it when it runs, or when it would wait.
func (c *Client) wake(ctx context.Context, keys queue.Keys, tenant, id, waiting string) error {
	if _, err := queue.WakeFor(ctx, c.rdb, keys, tenant, id, waiting); err != nil && !errors.Is(err, queue.ErrUnknownJob) {
		return fmt.Errorf("onceflow: wake job %s (its signal is recorded: the same call again wakes it; else it runs at its deadline): %w", id, err)
	}
	return nil
}

// Decision is an operator's decision on a tool call that needs approval.
type Decision struct {
	// Approved says whether the call may run.
	Approved bool `json:"approved"`
	// By and Note say who decided and why (shown to the model when rejected).
	By   string `json:"by,omitempty"`
	Note string `json:"note,omitempty"`
	// TimedOut says nobody decided before the timeout, which gave the outcome.
	TimedOut bool `json:"timed_out,omitempty"`
	// At is when it was decided.
	At time.Time `json:"at"`
}

// ApprovalConfig configures Job.Approval.
type ApprovalConfig struct {
	// Timeout is how long the call waits for a decision. Default:
	// DefaultApprovalTimeout.
	Timeout time.Duration
	// ApproveOnTimeout approves the call when nobody decided in time. Default: false
	// (rejected).
	ApproveOnTimeout bool
	// Messages is the conversation so far, shown to the operator. Default: none.
	Messages []llm.Message
}

// Approval asks an operator to decide on call before it runs, and returns the decision,
// recorded against the call's key: a resumed job gets the same decision and never asks
// twice. While nobody decided, it returns the *retry.WaitError that parks the job
// (return it as it is: the job holds no worker while it waits), and Client.Approve,
// Client.Reject, their HTTP routes or the operator UI's /ui/approvals decide; at the
// timeout, ApprovalConfig gives the outcome (rejected by default), recorded like a
// decision.
func (j *Job[T]) Approval(ctx context.Context, call ToolCall, cfg ApprovalConfig) (*Decision, error) {
	if err := checkToolCall(call); err != nil {
		return nil, err
	}
	timeout := cfg.Timeout
	if timeout == 0 {
		timeout = DefaultApprovalTimeout
	}
	name := approvalPrefix + call.Key
	out, err := j.run.wait(ctx, name, timeout, waitRecord{Tool: call.Name, Arguments: call.Arguments, Messages: cfg.Messages})
	if err != nil {
		return nil, err
	}
	return j.run.decisionOf(ctx, name, out, cfg.ApproveOnTimeout, "tool "+strconv.Quote(call.Name))
}

// decisionOf returns the decision a wait for one (name: an approval, a gate's hold)
// found; past its deadline without one, the timeout's outcome (approved says which),
// recorded unless a decision won, and the wait closed (off the operators' lists). what
// names the call or the gate in errors.
func (rt *runtime) decisionOf(ctx context.Context, name string, out waitOutcome, approved bool, what string) (*Decision, error) {
	if !out.came {
		d := Decision{Approved: approved, TimedOut: true, At: time.Now().UTC(), Note: "nobody decided in time"}
		enc, _ := json.Marshal(d)
		err := rt.client.recordSignal(ctx, nil, rt.delivery.Tenant, rt.delivery.JobID, name, enc)
		if err != nil && !errors.Is(err, ErrAlreadySignalled) {
			return nil, err
		}
		if _, err := rt.client.steps.db.Exec(ctx, `UPDATE job_steps SET state = 'done' WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'waiting'`,
			rt.delivery.Tenant, rt.delivery.JobID, waitPrefix+name); err != nil {
			return nil, PostgresError(fmt.Errorf("onceflow: close the wait of %s: %w", what, err))
		}
		r, err := rt.readStep(ctx, signalPrefix+name)
		if err != nil {
			return nil, err
		}
		out.signal = r.result
	}
	var d Decision
	if err := json.Unmarshal(out.signal, &d); err != nil {
		return nil, retry.Permanent(fmt.Errorf("onceflow: the decision on %s does not decode: %w", what, err))
	}
	return &d, nil
}

// Approve decides that tenant's job id may run its tool call key (ToolCall.Key), which
// waits for approval (Job.Approval, AgentTool.Approval), and wakes the job. by and note
// are recorded with it. The same decision again (a retry after a lost answer, or after
// a wake that failed because Redis did not answer) returns nil and wakes the job again;
// the other decision, a call decided by its timeout, one never asked or another tenant's
// is ErrNotWaiting. The client must know the job's queue (it works it, or enqueued or
// routes to it): a job on none of its queues is ErrNotWaiting and ErrJobNotFound, and
// nothing is recorded.
func (c *Client) Approve(ctx context.Context, tenant, id, key, by, note string) error {
	_, _, err := c.decide(ctx, tenant, id, key, Decision{Approved: true, By: by, Note: note})
	return err
}

// decide records d on the pending approval of key (decideOn).
func (c *Client) decide(ctx context.Context, tenant, id, key string, d Decision) (*Decision, bool, error) {
	return c.decideOn(ctx, tenant, id, approvalPrefix, key, d)
}

// Reject decides that tenant's job id must not run its tool call key; the model is told
// (with note). See Approve.
func (c *Client) Reject(ctx context.Context, tenant, id, key, by, note string) error {
	_, _, err := c.decide(ctx, tenant, id, key, Decision{By: by, Note: note})
	return err
}

// decideOn records d on the pending decision prefix+key (an approval of a tool call, a
// gate's hold of an answer), closing its wait, in one transaction, and wakes the job. The job is found first: another tenant's job, or one
// on none of the client's queues, records nothing (ErrNotWaiting, and ErrJobNotFound).
// The same decision again (a retry after a lost answer or a failed wake) is answered as
// the first: the job is woken again and it returns the recorded decision with replayed
// set; the other decision, or one after the timeout decided, is ErrNotWaiting with the
// recorded decision.
func (c *Client) decideOn(ctx context.Context, tenant, id, prefix, key string, d Decision) (rec *Decision, replayed bool, err error) {
	if c.steps == nil {
		return nil, false, errors.New("onceflow: decisions need Config.DB (the job_steps table is in PostgreSQL)")
	}
	validKey := strings.HasPrefix(key, "tool-")
	if prefix == gatePrefix {
		validKey = validGateKey(key)
	}
	if !queue.ValidJobID(id) || !validKey {
		return nil, false, fmt.Errorf("%w: job %s, call %s", ErrNotWaiting, id, clipText(key))
	}
	keys, err := c.locate(ctx, tenant, id, "")
	if err != nil {
		if errors.Is(err, ErrJobNotFound) { // another tenant's, or on a queue this client does not know
			return nil, false, fmt.Errorf("%w: job %s, call %s: the tenant has no such job on this client's queues (%s): %w",
				ErrNotWaiting, id, clipText(key), strings.Join(c.stateQueues(), ", "), ErrJobNotFound)
		}
		return nil, false, err
	}
	d.At = time.Now().UTC()
	enc, err := json.Marshal(d)
	if err != nil {
		return nil, false, err
	}
	name := prefix + key
	decided := false // the call had a decision, its wait left open (a crash after its timeout decided)
	err = pgx.BeginFunc(ctx, c.steps.db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE job_steps SET state = 'done' WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'waiting'`,
			tenant, id, waitPrefix+name)
		if err != nil {
			return PostgresError(err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("%w: job %s, call %s", ErrNotWaiting, id, clipText(key))
		}
		err = c.recordSignal(ctx, tx, tenant, id, name, enc)
		if errors.Is(err, ErrAlreadySignalled) {
			decided = true
			return nil // close the wait: the recorded decision stands
		}
		return err
	})
	if err == nil && decided {
		err = fmt.Errorf("%w: job %s, call %s: decided already", ErrNotWaiting, id, clipText(key))
	}
	switch {
	case errors.Is(err, ErrNotWaiting):
		have, rerr := c.decisionOn(ctx, tenant, id, name)
		switch {
		case errors.Is(rerr, ErrJobNotFound):
			return nil, false, err // never asked, or another tenant's
		case rerr != nil:
			return nil, false, rerr
		case have.Approved != d.Approved || have.TimedOut:
			return have, false, err
		}
		rec, replayed = have, true
	case err != nil:
		return nil, false, err
	default:
		rec = &d
	}
	return rec, replayed, c.wake(ctx, keys, tenant, id, waitingFor(name))
}

// Approval is a tool call waiting for an operator's decision (Inspector.Approvals).
type Approval struct {
	Tenant string `json:"tenant"`
	JobID  string `json:"job_id"`
	// Key is the call's key, which Approve and Reject take.
	Key       string        `json:"key"`
	Tool      string        `json:"tool"`
	Arguments string        `json:"arguments"`
	Messages  []llm.Message `json:"messages,omitempty"`
	AskedAt   time.Time     `json:"asked_at"`
	Deadline  time.Time     `json:"deadline"`
}

// Approvals lists up to limit tool calls waiting for a decision, oldest first: of
// tenant, or of every tenant when all is set (the operators' list).
func (in *Inspector) Approvals(ctx context.Context, tenant string, all bool, limit int) ([]Approval, error) {
	return pendingWaits(ctx, in.c.steps, approvalPrefix, tenant, all, limit, func(p pendingWait) Approval {
		return Approval{Tenant: p.tenant, JobID: p.job, Key: p.key, Tool: p.tool, Arguments: p.args, Messages: p.rec.Messages,
			AskedAt: p.at, Deadline: p.rec.Deadline}
	})
}

// pendingWait is a wait for a decision, as pendingWaits reads it.
type pendingWait struct {
	tenant, job, key, tool, args string
	rec                          waitRecord
	at                           time.Time
}

// pendingWaits lists up to limit waits for a decision named prefix (approvals, gates'
// holds), oldest first, of tenant or of every tenant when all is set, each made into a T
// by view.
func pendingWaits[T any](ctx context.Context, s *stepStore, prefix, tenant string, all bool, limit int, view func(pendingWait) T) ([]T, error) {
	what := strings.TrimSuffix(prefix, ":")
	if s == nil {
		return nil, fmt.Errorf("onceflow: list %s waits: Config.DB is required (the job_steps table is in PostgreSQL)", what)
	}
	rows, err := s.db.Query(ctx, `SELECT tenant, job_id, substr(name, $1), tool, arguments, result, created_at FROM job_steps
WHERE state = 'waiting' AND name LIKE $5 AND ($2 OR tenant = $3)
ORDER BY created_at, tenant, job_id, name LIMIT $4`, len(waitPrefix+prefix)+1, all, tenant, max(limit, 1), waitPrefix+prefix+"%")
	if err != nil {
		return nil, fmt.Errorf("onceflow: list %s waits: %w", what, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (T, error) {
		var p pendingWait
		var rec []byte
		if err := r.Scan(&p.tenant, &p.job, &p.key, &p.tool, &p.args, &rec, &p.at); err != nil {
			var zero T
			return zero, err
		}
		_ = json.Unmarshal(rec, &p.rec)
		return view(p), nil
	})
	if err != nil {
		return nil, fmt.Errorf("onceflow: list %s waits: %w", what, err)
	}
	return out, nil
}

// ledgerRetention is how long the ledger keeps a model call (Config.Ledger.Retention).
func (c *Client) ledgerRetention() time.Duration {
	return cmp.Or(c.cfg.Ledger.Retention, ledger.DefaultRetention)
}
