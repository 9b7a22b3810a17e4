package ledger

import (
	"context"
	"fmt"
	"time"
)

// purgeCallsSQL deletes one batch of expired call rows. An in_flight row whose owner
// still renews its lease is kept even past expiry (it is being used right now); every
// other expired row goes. SKIP LOCKED lets several purgers (one per worker process)
// run side by side without waiting for each other or for rows being claimed.
//
//	$1 now (NULL: now()), $2 batch size
const purgeCallsSQL = `
WITH now AS (SELECT coalesce($1::timestamptz, now()) AS t),
doomed AS (
	SELECT idem_key FROM llm_calls, now
	WHERE expires_at < now.t AND (state <> 'in_flight' OR owner IS NULL OR lease_until < now.t)
	ORDER BY expires_at
	LIMIT $2
	FOR UPDATE OF llm_calls SKIP LOCKED
)
DELETE FROM llm_calls c USING doomed WHERE c.idem_key = doomed.idem_key`

// purgeToolCallsSQL deletes one batch of expired tool-call rows.
//
//	$1 now (NULL: now()), $2 batch size
const purgeToolCallsSQL = `
WITH now AS (SELECT coalesce($1::timestamptz, now()) AS t),
doomed AS (
	SELECT request_key, args_key FROM llm_tool_calls, now
	WHERE expires_at < now.t
	ORDER BY expires_at
	LIMIT $2
	FOR UPDATE OF llm_tool_calls SKIP LOCKED
)
DELETE FROM llm_tool_calls t USING doomed WHERE t.request_key = doomed.request_key AND t.args_key = doomed.args_key`

// Purge deletes every expired row (calls and tool calls), Config.PurgeBatch rows per
// statement, until a batch comes back short, and returns how many it deleted. It stops
// early, with what it deleted so far, when ctx is done or a statement fails. Several
// purgers may run at once.
func (l *Ledger) Purge(ctx context.Context) (int64, error) {
	var total int64
	for _, sql := range []string{purgeCallsSQL, purgeToolCallsSQL} {
		for {
			tag, err := l.db.Exec(ctx, sql, l.now(), l.cfg.PurgeBatch)
			if err != nil {
				return total, fmt.Errorf("ledger: purge expired rows: %w", err)
			}
			total += tag.RowsAffected()
			l.metrics.purged.Add(float64(tag.RowsAffected()))
			if tag.RowsAffected() < int64(l.cfg.PurgeBatch) {
				break
			}
		}
	}
	return total, nil
}

// Run purges expired rows every Config.PurgeInterval until ctx is cancelled, then
// returns nil. A failed purge is logged and tried again at the next tick. Run it once
// per process that uses the ledger (onceflow work and gateway do).
func (l *Ledger) Run(ctx context.Context) error {
	t := time.NewTicker(l.cfg.PurgeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		n, err := l.Purge(ctx)
		if err != nil && ctx.Err() == nil {
			l.log.WarnContext(ctx, "ledger: purge failed; trying again later", "err", err)
		}
		if n > 0 {
			l.log.InfoContext(ctx, "ledger: purged expired rows", "rows", n)
		}
	}
}
