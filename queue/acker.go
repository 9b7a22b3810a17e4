package queue

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// acker acknowledges finished entries in batches: one round trip carries every id that
// finished while the previous one was on the wire, up to max ids, so under load the
// acknowledgement costs a fraction of a round trip per job, and when idle an id is
// acknowledged at once (after linger, when set). A Worker has one per Redis node
// (reader.go): a batch holds the entries of any of the node's partitions, one XACK per
// partition, sent as one pipeline with their success records (flush).
type acker struct {
	rdb    redis.Cmdable
	group  string
	max    int
	linger time.Duration
	log    *slog.Logger
	m      *workerMetrics

	ch   chan ack
	done chan struct{}

	mu     sync.RWMutex
	closed bool
}

func newAcker(rdb redis.Cmdable, group string, max int, linger time.Duration, log *slog.Logger, m *workerMetrics) *acker {
	return &acker{
		rdb: rdb, group: group, max: max, linger: linger, log: log, m: m,
		ch: make(chan ack, max), done: make(chan struct{}),
	}
}

// ack is one entry of partition p to acknowledge, with the success record of its
// delivery (historyRecord; "" for none).
type ack struct {
	p           *part
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

// partAcks is what one flush acknowledges of one partition: its ids and success records
// (id, record, id, record...).
type partAcks struct {
	p    *part
	ids  []string
	recs []any
}

// byPart splits batch by partition, in the order of their first entries.
func byPart(batch []ack) []partAcks {
	var out []partAcks
	index := func(p *part) int {
		for i := range out {
			if out[i].p == p {
				return i
			}
		}
		return -1
	}
	// Count first, so that each partition's ids take one allocation.
	counts := make([]int, 0, 1)
	for _, e := range batch {
		if i := index(e.p); i >= 0 {
			counts[i]++
			continue
		}
		out = append(out, partAcks{p: e.p})
		counts = append(counts, 1)
	}
	for i := range out {
		out[i].ids = make([]string, 0, counts[i])
	}
	for _, e := range batch {
		pa := &out[index(e.p)]
		pa.ids = append(pa.ids, e.id)
		if e.history != "" {
			pa.recs = append(pa.recs, e.id, e.history)
		}
	}
	return out
}

// flush sends, in one round trip, one XACK per partition of batch and, for those with
// success records, one HSET of them into the partition's successes hash
// (Keys.Successes): a lone XACK when the batch is one partition's without records, else
// a pipeline. A failed XACK is retried twice (XACK and HSET are idempotent), the
// partitions acknowledged meanwhile not again. Entries whose XACK fails stay pending and
// are redelivered after ClaimIdle: the handler ran, so the redelivery is a duplicate its
// idempotency absorbs. A lost success record loses only a line of the job's history.
func (a *acker) flush(batch []ack) {
	parts := byPart(batch)
	var err error
	for attempt := range 3 {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		parts, err = a.send(ctx, parts)
		cancel()
		if err == nil {
			return
		}
		a.m.redisError("ack")
	}
	for _, pa := range parts {
		pa.p.log.Error("acknowledge failed; the entries stay pending and will be redelivered", "entries", len(pa.ids), "first", pa.ids[0], "err", err)
	}
}

// send acknowledges parts in one round trip and returns those whose XACK failed, with
// the first error.
func (a *acker) send(ctx context.Context, parts []partAcks) ([]partAcks, error) {
	if len(parts) == 1 && len(parts[0].recs) == 0 {
		n, err := a.rdb.XAck(ctx, parts[0].p.stream, a.group, parts[0].ids...).Result()
		if err != nil {
			return parts, err
		}
		a.m.acks.Add(float64(n))
		return nil, nil
	}
	acked := make([]*redis.IntCmd, len(parts))
	recorded := make([]*redis.IntCmd, len(parts))
	_, _ = a.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, pa := range parts {
			acked[i] = p.XAck(ctx, pa.p.stream, a.group, pa.ids...)
			if len(pa.recs) > 0 {
				recorded[i] = p.HSet(ctx, pa.p.keys.Successes(), pa.recs...)
			}
		}
		return nil
	})
	var failed []partAcks
	var first error
	for i, pa := range parts {
		n, err := acked[i].Result()
		if err != nil {
			failed = append(failed, pa)
			first = firstErr(first, err)
			continue
		}
		a.m.acks.Add(float64(n))
		// The acknowledgement is the XACK's: a refused record (Redis out of memory,
		// say) loses only a line of history, and is not retried.
		if recorded[i] != nil && recorded[i].Err() != nil {
			pa.p.log.Debug("recording successes failed; their jobs' histories lack them", "entries", len(pa.ids), "err", recorded[i].Err())
		}
	}
	return failed, first
}
