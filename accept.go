package onceflow

import (
	"context"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/queue"
)

// accept runs the one-round-trip accept: in one script, it checks scope's record (a
// replay or a reused key) or runs the queue's own enqueue of m on keys' queue (its entry
// and its job index, queue.EnqueueLua) and stores resp for Config.ResultTTL.
func (c *Client) accept(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, m queue.Message, keys queue.Keys) (*idempotency.Response, bool, error) {
	args, err := queue.EnqueueArgs(m)
	if err != nil {
		return nil, false, err
	}
	return c.store.AcceptWrite(ctx, scope, fp, resp, redisstore.Write{
		Lua: queue.EnqueueLua, Keys: keys.EnqueueKeys(m.JobID), Args: args,
	})
}

// LoadScripts loads the accept script (Route's and a keyed Enqueue's) into Redis's
// script cache, so that the first accept costs one round trip rather than two. It is
// optional: a script missing from the cache is sent once, then cached.
func (c *Client) LoadScripts(ctx context.Context) error {
	return c.store.LoadScripts(ctx, queue.EnqueueLua)
}
