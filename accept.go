package onceflow

import (
	"context"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/queue"
)

// accept runs the one-round-trip accept: in one script, it checks scope's record (a
// replay or a reused key) or enqueues m on keys' queue with its job index and stores
// resp for Config.ResultTTL.
func (c *Client) accept(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, m queue.Message, keys queue.Keys) (*idempotency.Response, bool, error) {
	return c.store.Accept(ctx, scope, fp, resp, redisstore.Enqueue{
		Stream:      keys.Stream(),
		Fields:      m.Values(),
		IndexKey:    keys.Job(m.JobID),
		IndexFields: []any{"tenant", m.Tenant},
		IndexTTL:    c.cfg.ResultTTL,
	})
}
