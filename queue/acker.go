package queue

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// ackScript acknowledges a batch of entries and starts the TTL of their jobs' indexes.
//
//	KEYS[1]   the stream
//	KEYS[1+i] the job index of the i-th entry
//	ARGV[1]   consumer group
//	ARGV[2]   index TTL in milliseconds
//	ARGV[2+i] the i-th entry id
//
// Returns the number of entries XACK acknowledged. An index gets the TTL only when its
// "entry" is the acknowledged entry: not when the job was enqueued again and a newer
// entry waits in the stream (its index must not expire while it does), and not when the
// job was dead-lettered (the dead-letter script removes "entry": the index must outlive
// the dead letter). One HGET and at most one PEXPIRE per job. Invariant: an index
// expires only after its job left the stream.
var ackScript = redis.NewScript(ackLua)

const ackLua = `
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'entry') == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  end
end
return n
`

// ackChunk bounds the entries of one ackScript call (Lua's unpack has a stack limit).
const ackChunk = 1000

// ack is one finished entry and its job.
type ack struct{ id, jobID string }

// acker acknowledges finished entries in batches: one script call (XACK plus the job
// indexes' TTL) carries every id that finished while the previous call was on the wire,
// up to max ids, so under load the acknowledgement costs a fraction of a round trip per
// job, and when idle an id is acknowledged at once (after linger, when set).
type acker struct {
	rdb       redis.Cmdable
	stream    string
	jobPrefix string // Keys.Job(""): a job's index key is jobPrefix + its id
	group     string
	max       int
	linger    time.Duration
	jobTTL    time.Duration
	log       *slog.Logger
	m         *workerMetrics

	ch   chan ack
	done chan struct{}

	// Owned by run: the script's keys and args, reused from batch to batch.
	keyBuf []string
	argBuf []any

	mu     sync.RWMutex
	closed bool
}

func newAcker(rdb redis.Cmdable, keys Keys, group string, max int, linger, jobTTL time.Duration, log *slog.Logger, m *workerMetrics) *acker {
	return &acker{
		rdb: rdb, stream: keys.Stream(), jobPrefix: keys.Job(""), group: group, max: max, linger: linger, jobTTL: jobTTL, log: log, m: m,
		ch: make(chan ack, max), done: make(chan struct{}),
	}
}

// add queues entry id of job jobID for acknowledgement. It reports false, dropping id,
// once the acker is closed (a handler that outlived the shutdown timeout): the entry
// stays pending.
func (a *acker) add(id, jobID string) bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.closed {
		return false
	}
	a.ch <- ack{id, jobID}
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
	for x := range a.ch {
		batch = append(batch[:0], x)
		open := a.collect(&batch)
		for len(batch) > 0 {
			chunk := batch[:min(len(batch), ackChunk)]
			batch = batch[len(chunk):]
			a.flush(chunk)
		}
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
		case x, ok := <-a.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, x)
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
		case x, ok := <-a.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, x)
		case <-t.C:
			return true
		}
	}
	return true
}

// flush sends one ackScript call for batch, retrying a failed one twice. Entries whose
// acknowledgement fails stay pending and are redelivered after ClaimIdle: the handler
// ran, so the redelivery is a duplicate its idempotency absorbs.
func (a *acker) flush(batch []ack) {
	keys := append(a.keyBuf[:0], a.stream)
	args := append(a.argBuf[:0], a.group, a.jobTTL.Milliseconds())
	for _, x := range batch {
		keys = append(keys, a.jobPrefix+x.jobID)
		args = append(args, x.id)
	}
	a.keyBuf, a.argBuf = keys, args
	var err error
	for attempt := range 3 {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var n int64
		n, err = ackScript.Run(ctx, a.rdb, keys, args...).Int64()
		cancel()
		if err == nil {
			a.m.acks.Add(float64(n))
			return
		}
		a.m.redisError("ack")
	}
	a.log.Error("acknowledge failed; the entries stay pending and will be redelivered", "entries", len(batch), "first", batch[0].id, "err", err)
}
