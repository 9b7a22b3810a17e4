package onceflow

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/metrics"
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
	stored, replayed, err := c.store.AcceptWrite(ctx, scope, fp, resp, redisstore.Write{
		Lua: queue.EnqueueLua, Keys: keys.EnqueueKeys(m.JobID), Args: args,
	})
	if err == nil && !replayed {
		c.enqueued.WithLabelValues(keys.Queue).Inc()
	}
	c.noteQueue(keys.Queue)
	return stored, replayed, queue.EnqueueError(err)
}

// enqueue adds m to keys' queue without a key (queue.Enqueue) and counts it.
func (c *Client) enqueue(ctx context.Context, keys queue.Keys, m queue.Message) error {
	c.noteQueue(keys.Queue)
	if _, err := queue.Enqueue(ctx, c.rdb, keys, m); err != nil {
		return err
	}
	c.enqueued.WithLabelValues(keys.Queue).Inc()
	return nil
}

// newEnqueuedCounter returns onceflow_queue_enqueued_total on reg (nil: not exported),
// with a series at zero for each of queues. Its name, labels and help are those of the
// summaries route's counter, so that both may share one registry.
func newEnqueuedCounter(reg prometheus.Registerer, queues []string) *prometheus.CounterVec {
	vec := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "queue", Name: "enqueued_total",
		Help: "Jobs added to the stream by the API: new requests only (a replayed response enqueues nothing).",
	}, []string{"queue"}))
	metrics.Init(vec, queues)
	return vec
}

// LoadScripts loads the accept script (Route's and a keyed Enqueue's) into Redis's
// script cache, so that the first accept costs one round trip rather than two. It is
// optional: a script missing from the cache is sent once, then cached.
func (c *Client) LoadScripts(ctx context.Context) error {
	return c.store.LoadScripts(ctx, queue.EnqueueLua)
}
