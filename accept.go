package onceflow

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/queue"
)

// accept runs the one-round-trip accept: in one script, it checks scope's record (a
// replay or a reused key) or runs the queue's own enqueue of m on keys' queue (its entry
// and its job index: queue.EnqueueStep, or queue.EnqueueAtStep for a runAt in the
// future) and stores resp for Config.ResultTTL.
func (c *Client) accept(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, m queue.Message, keys queue.Keys, runAt time.Time) (*idempotency.Response, bool, error) {
	var step redisstore.Step
	var err error
	if later(runAt) {
		step, err = queue.EnqueueAtStep(keys, m, runAt)
	} else {
		step, err = queue.EnqueueStep(keys, m)
	}
	if err != nil {
		return nil, false, err
	}
	stored, replayed, err := c.store.AcceptStep(ctx, scope, fp, resp, step)
	if err == nil && !replayed {
		c.enqueued.WithLabelValues(keys.Queue).Inc()
	}
	c.noteQueue(keys.Queue)
	return stored, replayed, queue.EnqueueError(err)
}

// later reports whether runAt is a time in the future: the job waits in the scheduled
// set until then.
func later(runAt time.Time) bool { return !runAt.IsZero() && time.Until(runAt) > 0 }

// enqueue adds m to keys' queue without a key (queue.Enqueue, or queue.EnqueueAt for a
// runAt in the future) and counts it.
func (c *Client) enqueue(ctx context.Context, keys queue.Keys, m queue.Message, runAt time.Time) error {
	c.noteQueue(keys.Queue)
	var err error
	if later(runAt) {
		_, err = queue.EnqueueAt(ctx, c.rdb, keys, m, runAt)
	} else {
		_, err = queue.Enqueue(ctx, c.rdb, keys, m)
	}
	if err != nil {
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

// LoadScripts loads the accept scripts (Route's and a keyed Enqueue's, for a job now and
// for a job at a time) into Redis's script cache, so that the first accept costs one
// round trip rather than two. It is optional: a script missing from the cache is sent
// once, then cached.
func (c *Client) LoadScripts(ctx context.Context) error {
	return c.store.Preload(ctx, queue.StepFunctions()...)
}
