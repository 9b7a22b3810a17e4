package queue

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// acker acknowledges finished entries in batches: one XACK carries every id that
// finished while the previous XACK was on the wire, up to max ids, so under load the
// acknowledgement costs a fraction of a round trip per job, and when idle an id is
// acknowledged at once (after linger, when set).
type acker struct {
	rdb    redis.Cmdable
	stream string
	group  string
	max    int
	linger time.Duration
	log    *slog.Logger
	m      *workerMetrics

	ch   chan string
	done chan struct{}

	mu     sync.RWMutex
	closed bool
}

func newAcker(rdb redis.Cmdable, keys Keys, group string, max int, linger time.Duration, log *slog.Logger, m *workerMetrics) *acker {
	return &acker{
		rdb: rdb, stream: keys.Stream(), group: group, max: max, linger: linger, log: log, m: m,
		ch: make(chan string, max), done: make(chan struct{}),
	}
}

// add queues id for acknowledgement. It reports false, dropping id, once the acker is
// closed (a handler that outlived the shutdown timeout): the entry stays pending.
func (a *acker) add(id string) bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.closed {
		return false
	}
	a.ch <- id
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
	batch := make([]string, 0, a.max)
	for id := range a.ch {
		batch = append(batch[:0], id)
		open := a.collect(&batch)
		a.flush(batch)
		if !open {
			return
		}
	}
}

// collect adds queued ids to batch without waiting, then for up to linger; it reports
// false when the channel was closed.
func (a *acker) collect(batch *[]string) bool {
	for len(*batch) < a.max {
		select {
		case id, ok := <-a.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, id)
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
		case id, ok := <-a.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, id)
		case <-t.C:
			return true
		}
	}
	return true
}

// flush sends one XACK for batch, retrying a failed one twice. Entries whose XACK
// fails stay pending and are redelivered after ClaimIdle: the handler ran, so the
// redelivery is a duplicate its idempotency absorbs.
func (a *acker) flush(batch []string) {
	ids := make([]string, len(batch))
	copy(ids, batch)
	var err error
	for attempt := range 3 {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var n int64
		n, err = a.rdb.XAck(ctx, a.stream, a.group, ids...).Result()
		cancel()
		if err == nil {
			a.m.acks.Add(float64(n))
			return
		}
		a.m.redisError("ack")
	}
	a.log.Error("acknowledge failed; the entries stay pending and will be redelivered", "entries", len(ids), "first", ids[0], "err", err)
}
