package ledger

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
)

// ToolKey is the downstream idempotency key of one tool call, from ToolKeys.
type ToolKey struct {
	// Call is the tool call.
	Call llm.ToolCall
	// Key is what to send downstream as Idempotency-Key.
	Key string
	// FirstID is the provider's id of this call the first time it was seen for this
	// request key; Key is derived from it.
	FirstID string
	// Stability is what this sight proved of the provider's ids: toolkey.Unknown the
	// first time (or without an id), toolkey.Stable when the id repeated,
	// toolkey.Unstable when the same call came back with another id.
	Stability toolkey.Stability
}

// toolCallsSQL records, for one model request key, the provider id first seen for each
// call (identified by its args key: tool name and canonical arguments, with the
// occurrence number when one answer repeats a call), and returns the first id of each.
//
//	$1 request_key, $2 args_keys text[], $3 call_ids text[], $4 tools text[],
//	$5 now (NULL: now()), $6 retention µs
//
// Returns args_key, first call_id and whether this statement inserted it, per input;
// call_id is NULL for a row inserted by a
// concurrent transaction after this statement's snapshot (read it again). Invariant:
// the first id of a call never changes, so its downstream key never changes.
const toolCallsSQL = `
WITH input AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::text[]) AS i(args_key, call_id, tool)
),
ins AS (
	INSERT INTO llm_tool_calls (request_key, args_key, call_id, tool, expires_at)
	SELECT $1, args_key, call_id, tool, coalesce($5::timestamptz, now()) + $6::bigint * interval '1 microsecond' FROM input
	ON CONFLICT (request_key, args_key) DO NOTHING
	RETURNING args_key, call_id
)
SELECT i.args_key, coalesce(ins.call_id, t.call_id), ins.args_key IS NOT NULL
FROM input i
LEFT JOIN ins ON ins.args_key = i.args_key
LEFT JOIN llm_tool_calls t ON t.request_key = $1 AND t.args_key = i.args_key`

// ToolKeys returns the downstream key of every tool call in calls, the answer to the
// model request whose ledger key is requestKey, in one round trip. Each call is
// identified by toolkey.ArgsKey (tool name and canonical arguments; the n-th repeat of
// one call within an answer is its own call); the first provider id seen for it is
// recorded, and the key is toolkey.IDKey(requestKey, firstID). So:
//
//   - a provider with stable ids (or a replayed answer) gets the id's key, and two
//     identical calls in one answer stay two effects;
//   - a provider whose ids change from one generation to the next still gets the key
//     of the first sight (the one the downstream system already saw), and the change
//     is detected: Stability Unstable, a warning, onceflow_llm_tool_call_ids_total;
//   - a call without an id gets toolkey.ArgsKey.
//
// Rows expire with the ledger's Retention. Errors are database errors. Safe for
// concurrent use.
func (l *Ledger) ToolKeys(ctx context.Context, provider, requestKey string, calls []llm.ToolCall) ([]ToolKey, error) {
	out := make([]ToolKey, len(calls))
	seen := map[string]int{}
	var argsKeys, ids, tools []string
	index := map[string]int{} // args key -> position in out
	for i, c := range calls {
		out[i].Call = c
		if c.ID == "" {
			out[i].Key = toolkey.ArgsKey(requestKey, c)
			l.metrics.toolIDs.WithLabelValues(provider, "none").Inc()
			continue
		}
		ak := toolkey.ArgsKey(requestKey, c)
		seen[ak]++
		if n := seen[ak]; n > 1 {
			ak += "#" + strconv.Itoa(n)
		}
		index[ak] = i
		argsKeys, ids, tools = append(argsKeys, ak), append(ids, c.ID), append(tools, c.Name)
	}
	if len(argsKeys) == 0 {
		return out, nil
	}
	type sight struct {
		id       string
		inserted bool
	}
	first := map[string]sight{}
	for try := 0; try < 2 && len(first) < len(argsKeys); try++ {
		rows, err := l.db.Query(ctx, toolCallsSQL, requestKey, argsKeys, ids, tools, l.now(), micros(l.cfg.Retention))
		if err != nil {
			return nil, dbError("record tool calls of "+requestKey, err)
		}
		for rows.Next() {
			var ak string
			var id *string
			var inserted bool
			if err := rows.Scan(&ak, &id, &inserted); err != nil {
				rows.Close()
				return nil, dbError("record tool calls of "+requestKey, err)
			}
			if id != nil {
				first[ak] = sight{*id, inserted}
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, dbError("record tool calls of "+requestKey, err)
		}
	}
	for ak, i := range index {
		f, ok := first[ak]
		if !ok {
			return nil, fmt.Errorf("ledger: tool call %s of %s: %w", out[i].Call.Name, requestKey, pgx.ErrNoRows)
		}
		out[i].FirstID, out[i].Key = f.id, toolkey.IDKey(requestKey, f.id)
		switch {
		case f.inserted:
			out[i].Stability = toolkey.Unknown
			l.metrics.toolIDs.WithLabelValues(provider, "first").Inc()
		case f.id == out[i].Call.ID:
			out[i].Stability = toolkey.Stable
			l.metrics.toolIDs.WithLabelValues(provider, "stable").Inc()
		default:
			out[i].Stability = toolkey.Unstable
			l.metrics.toolIDs.WithLabelValues(provider, "unstable").Inc()
			l.log.WarnContext(ctx, "ledger: a repeated model request returned the same tool call with another id: the provider's tool-call ids are unstable; keying it as first seen",
				"provider", provider, "tool", out[i].Call.Name, "first_id", f.id, "id", out[i].Call.ID)
		}
	}
	return out, nil
}
