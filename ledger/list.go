package ledger

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/llm/toolkey"
)

// StateAmbiguous, as ListOptions.State, selects the rows with at least one attempt that
// ended without knowing whether the provider did the work.
const StateAmbiguous = "ambiguous"

// ListOptions selects the rows List returns. Zero fields select everything.
type ListOptions struct {
	// State is StateInFlight, StateSucceeded, StateFailed or StateAmbiguous.
	State string
	// Model selects one model's rows.
	Model string
	// Tenant selects one tenant's rows (Call.Tenant).
	Tenant string
	// Job selects the rows of one job: those whose work is Work(Job, step) for any
	// step.
	Job string
	// Before selects the rows created before it, for the next page (the listing is
	// newest first).
	Before time.Time
	// Limit caps the rows returned. Default: 100.
	Limit int
}

// Summary is a row of llm_calls without its recorded bodies, as operators list them.
type Summary struct {
	Key, Work, State, Provider, Model, Tenant string
	Attempt, Ambiguous                        int
	Owner                                     string
	LeaseUntil                                time.Time
	Error                                     string
	// InputTokens and OutputTokens are the recorded answer's usage (0 when unknown):
	// input_tokens/output_tokens of an llm.Response, prompt_tokens/completion_tokens
	// of an OpenAI answer recorded by onceflow gateway.
	InputTokens, OutputTokens int64
	CreatedAt, UpdatedAt      time.Time
}

// usageInSQL and usageOutSQL read a recorded answer's usage: an llm.Response's
// input_tokens/output_tokens, or an OpenAI answer's prompt_tokens/completion_tokens
// (recorded by onceflow gateway); 0 when there is none.
const (
	usageInSQL  = `coalesce(response->'usage'->>'input_tokens', response->'usage'->>'prompt_tokens', '0')::bigint`
	usageOutSQL = `coalesce(response->'usage'->>'output_tokens', response->'usage'->>'completion_tokens', '0')::bigint`
)

const listSQL = `
SELECT idem_key, work, state, provider, model, tenant, attempt, ambiguous, coalesce(owner, ''),
	coalesce(lease_until, 'epoch'), coalesce(error, ''),
	` + usageInSQL + `, ` + usageOutSQL + `, created_at, updated_at
FROM llm_calls
WHERE ($1 = '' OR ($1 = 'ambiguous' AND ambiguous > 0) OR state = $1)
	AND ($2 = '' OR model = $2)
	AND ($3 = '' OR right(work, length($3) + 1) = '/' || $3)
	AND ($4::timestamptz IS NULL OR created_at < $4)
	AND ($6 = '' OR tenant = $6)
ORDER BY created_at DESC
LIMIT $5`

// List returns the rows opts selects, newest first, in one round trip. Safe for
// concurrent use.
func (l *Ledger) List(ctx context.Context, opts ListOptions) ([]Summary, error) {
	switch opts.State {
	case "", StateInFlight, StateSucceeded, StateFailed, StateAmbiguous:
	default:
		return nil, fmt.Errorf("ledger: list: unknown state %q", opts.State)
	}
	limit := opts.Limit
	if limit <= 0 {
		limit = 100
	}
	var before *time.Time
	if !opts.Before.IsZero() {
		before = &opts.Before
	}
	rows, err := l.db.Query(ctx, listSQL, opts.State, opts.Model, opts.Job, before, limit, opts.Tenant)
	if err != nil {
		return nil, dbError("list calls", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Summary, error) {
		var s Summary
		err := r.Scan(&s.Key, &s.Work, &s.State, &s.Provider, &s.Model, &s.Tenant, &s.Attempt, &s.Ambiguous, &s.Owner,
			&s.LeaseUntil, &s.Error, &s.InputTokens, &s.OutputTokens, &s.CreatedAt, &s.UpdatedAt)
		return s, err
	})
	if err != nil {
		return nil, dbError("list calls", err)
	}
	return out, nil
}

// RecordedToolCall is a tool call recorded for a model request (ToolKeys): its tool,
// the provider's id first seen for it and the downstream key derived from that id.
type RecordedToolCall struct {
	RequestKey, Tool, FirstID, Key string
	CreatedAt                      time.Time
}

// ToolCallsOf returns the tool calls recorded for the model requests requestKeys (those
// that came with a provider id: a call without one is keyed by its arguments alone and
// needs no record), with the downstream key ToolKeys gave each (toolkey.IDKey of the
// first id), in one round trip, oldest first.
func (l *Ledger) ToolCallsOf(ctx context.Context, requestKeys []string) ([]RecordedToolCall, error) {
	if len(requestKeys) == 0 {
		return nil, nil
	}
	rows, err := l.db.Query(ctx, `SELECT request_key, tool, call_id, args_key, created_at FROM llm_tool_calls
WHERE request_key = ANY($1) ORDER BY created_at, request_key, args_key`, requestKeys)
	if err != nil {
		return nil, dbError("list tool calls", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (RecordedToolCall, error) {
		var t RecordedToolCall
		var argsKey string
		err := r.Scan(&t.RequestKey, &t.Tool, &t.FirstID, &argsKey, &t.CreatedAt)
		t.Key = argsKey // replaced below when the call has an id
		return t, err
	})
	if err != nil {
		return nil, dbError("list tool calls", err)
	}
	for i := range out {
		if out[i].FirstID != "" {
			out[i].Key = toolkey.IDKey(out[i].RequestKey, out[i].FirstID)
		}
	}
	return out, nil
}

// HourStats counts the calls begun in one hour.
type HourStats struct {
	Hour time.Time
	// Calls is the calls begun; Ambiguous those with at least one attempt that ended
	// without knowing whether the provider did the work; Attempts their attempts.
	Calls, Ambiguous, Attempts int64
	// InputTokens and OutputTokens are their recorded answers' usage.
	InputTokens, OutputTokens int64
}

// AmbiguousPercent is the share of the hour's calls with an ambiguous attempt.
func (h HourStats) AmbiguousPercent() float64 {
	if h.Calls == 0 {
		return 0
	}
	return 100 * float64(h.Ambiguous) / float64(h.Calls)
}

const hourlySQL = `
SELECT date_trunc('hour', created_at), count(*), count(*) FILTER (WHERE ambiguous > 0), sum(attempt),
	sum(` + usageInSQL + `), sum(` + usageOutSQL + `)
FROM llm_calls WHERE created_at >= $1
GROUP BY 1 ORDER BY 1`

// Hourly counts the calls begun since since, per hour, oldest first: the rate of
// ambiguous failures over time, and the tokens. One round trip (a scan of the rows
// kept: llm_calls holds Config.Retention of them).
func (l *Ledger) Hourly(ctx context.Context, since time.Time) ([]HourStats, error) {
	rows, err := l.db.Query(ctx, hourlySQL, since)
	if err != nil {
		return nil, dbError("count calls per hour", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (HourStats, error) {
		var h HourStats
		err := r.Scan(&h.Hour, &h.Calls, &h.Ambiguous, &h.Attempts, &h.InputTokens, &h.OutputTokens)
		return h, err
	})
	if err != nil {
		return nil, dbError("count calls per hour", err)
	}
	return out, nil
}
