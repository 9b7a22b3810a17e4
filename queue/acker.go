package queue

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// acker acknowledges finished entries in batches: one XACK carries every id that
// finished while the previous one was on the wire, up to max ids, so under load the
// acknowledgement costs a fraction of a round trip per job, and when idle an id is
// acknowledged at once (after linger, when set). Their success records go in the same
// round trip (flush).
type acker struct {
	rdb       redis.Cmdable
	stream    string
	successes string
	group     string
	max       int
	linger    time.Duration
	log       *slog.Logger
	m         *workerMetrics

	ch   chan ack
	done chan struct{}

	mu     sync.RWMutex
	closed bool
}

func newAcker(rdb redis.Cmdable, keys Keys, group string, max int, linger time.Duration, log *slog.Logger, m *workerMetrics) *acker {
	return &acker{
		rdb: rdb, stream: keys.Stream(), successes: keys.Successes(), group: group, max: max, linger: linger, log: log, m: m,
		ch: make(chan ack, max), done: make(chan struct{}),
	}
}

// ack is one entry to acknowledge, with the success record of its delivery
// (historyRecord; "" for none).
type ack struct {
	id, history string
}

// add queues a for acknowledgement. It reports false, dropping it, once the acker is
// closed (a handler that outlived the shutdown timeout): the entry stays pending.
func (a *acker) add(e ack) bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.closed {
		return false
	}
	a.ch <- e
	return true
}

// close stops accepting ids, acknowledges the queued ones and returns when done.
func (a *acker) close() {
	a.mu.Lock()
	if !a.closed {
		a.closed = true
		close(a.ch)
	}
	a.mu.Unlock()
	<-a.done
}

// run flushes batches until close; start it once.
func (a *acker) run() {
	defer close(a.done)
	batch := make([]ack, 0, a.max)
	for e := range a.ch {
		batch = append(batch[:0], e)
		open := a.collect(&batch)
		a.flush(batch)
		if !open {
			return
		}
	}
}

// collect adds queued ids to batch without waiting, then for up to linger; it reports
// false when the channel was closed.
func (a *acker) collect(batch *[]ack) bool {
	for len(*batch) < a.max {
		select {
		case e, ok := <-a.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, e)
			continue
		default:
		}
		break
	}
	if a.linger <= 0 || len(*batch) >= a.max {
		return true
	}
	t := time.NewTimer(a.linger)
	defer t.Stop()
	for len(*batch) < a.max {
		select {
		case e, ok := <-a.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, e)
		case <-t.C:
			return true
		}
	}
	return true
}

// flush sends one XACK for batch and, in the same round trip (a pipeline), one HSET of
// the batch's success records into the queue's successes hash (Keys.Successes),
// retrying a failed round trip twice: both are idempotent. Entries whose XACK fails
// stay pending and are redelivered after ClaimIdle: the handler ran, so the redelivery
// is a duplicate its idempotency absorbs. A lost success record loses only a line of
// the job's history.
func (a *acker) flush(batch []ack) {
	ids := make([]string, len(batch))
	recs := make([]any, 0, 2*len(batch))
	for i, e := range batch {
		ids[i] = e.id
		if e.history != "" {
			recs = append(recs, e.id, e.history)
		}
	}
	var err error
	for attempt := range 3 {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var n int64
		if len(recs) == 0 {
			n, err = a.rdb.XAck(ctx, a.stream, a.group, ids...).Result()
		} else {
			var acked *redis.IntCmd
			var recorded *redis.IntCmd
			_, _ = a.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				acked = p.XAck(ctx, a.stream, a.group, ids...)
				recorded = p.HSet(ctx, a.successes, recs...)
				return nil
			})
			// The acknowledgement is the XACK's: a refused record (Redis out of memory,
			// say) loses only a line of history, and is not retried.
			n, err = acked.Result()
			if err == nil && recorded.Err() != nil {
				a.log.Debug("recording successes failed; their jobs' histories lack them", "entries", len(batch), "err", recorded.Err())
			}
		}
		cancel()
		if err == nil {
			a.m.acks.Add(float64(n))
			return
		}
		a.m.redisError("ack")
	}
	a.log.Error("acknowledge failed; the entries stay pending and will be redelivered", "entries", len(batch), "first", batch[0].id, "err", err)
}
