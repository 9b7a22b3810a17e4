package ledger

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// Defaults and bounds of group commit (Config.GroupLinger, Config.GroupMax).
const (
	// DefaultGroupLinger is how long the first write of a group transaction waits for
	// other calls' writes to join it, when other calls of the ledger are in progress.
	DefaultGroupLinger = 100 * time.Microsecond
	// MaxGroupLinger bounds Config.GroupLinger: a linger is a wait every call may pay.
	MaxGroupLinger = 5 * time.Millisecond
	// DefaultGroupMax is the most writes one group transaction carries.
	DefaultGroupMax = 64
	// groupStall is how long a group may be in flight before the writes queued behind
	// it start a group of their own: while groups commit in time, one at a time takes
	// every write that queued meanwhile (the fewest, largest transactions: two or four
	// at a time gave fewer jobs per second in BenchmarkPipeline, docs/BENCHMARKS.md);
	// one that waits (a row another transaction holds, a slow disk, a PostgreSQL that
	// hangs) holds up the writes behind it no longer than this.
	groupStall = 20 * time.Millisecond
	// maxGroupsInFlight bounds the groups of one statement in flight at once.
	maxGroupsInFlight = 8
	// groupLockTimeout bounds how long a group transaction waits for a row lock
	// (lock_timeout, for that transaction only): a row another transaction holds fails
	// the group at once, and each of its writes is then made alone, so that only the
	// write of that row waits for it.
	groupLockTimeout = "50ms"
)

// batcher is what group commit needs from the database besides DB: *pgxpool.Pool and
// *pgx.Conn have it. A DB without it (or a pgx.Tx, whose commit is the caller's)
// writes every call alone.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// States of a groupWrite's outcome (groupWrite.state).
const (
	writeWaiting   = iota // its caller waits for the outcome
	writeDelivered        // the outcome was handed to its caller
	writeAbandoned        // its caller went away (ctx ended) while its group ran
)

// groupWrite is one call's statement waiting for its group: its key orders the group
// (so that concurrent groups lock rows in one order and cannot deadlock each other),
// scan reads its row, and done receives its outcome.
type groupWrite struct {
	key  string
	args []any
	scan func(pgx.Row) error
	done chan error
	// alone is set when the write ran alone after its group failed: the group may
	// have committed it before failing (a connection lost after the commit), so what
	// the write finds may be its own earlier outcome.
	alone bool
	// state is writeWaiting until the outcome is delivered or the caller abandons the
	// write; undo, when set, takes back a write that succeeded after its caller went.
	state atomic.Int32
	undo  func()
}

// deliver hands w its outcome, or undoes a successful write whose caller went away.
func (w *groupWrite) deliver(err error) {
	if w.state.CompareAndSwap(writeWaiting, writeDelivered) {
		w.done <- err
		return
	}
	if err == nil && w.undo != nil {
		w.undo()
	}
}

// group is the queue of one statement's writes (group commit): concurrent calls'
// writes of that statement share one transaction, one round trip and one WAL flush.
//
// A write is queued; when no group of the statement is in flight (or the last one has
// been in flight for groupStall), a runner starts: it waits the linger when other calls
// of the ledger are in progress (a call alone pays none), takes up to max queued
// writes, sorts them by key and sends them as one pgx batch, which PostgreSQL runs as
// one implicit transaction, and goes on with what queued meanwhile until the queue is
// empty. Each write's outcome is its own row: a write that finds nothing
// (pgx.ErrNoRows) does not fail the others. A group that fails as a whole (a
// statement's error aborts the transaction; a row lock it would wait for; a lost
// connection) is written again call by call, each alone as without group commit, so
// that one call's bad input or held row fails or delays that call only, and every call
// gets its own outcome. A caller whose ctx ends stops waiting: its write is dropped
// when still queued, and undone when its group commits it after all.
type group struct {
	l      *Ledger
	db     batcher
	sql    string
	linger time.Duration
	max    int
	// self is how many of Ledger.active a writer of this statement counts itself
	// (Begin's insert: 1; an answer, written after its attempt ended: 0): more than
	// that are other calls, which may join a group.
	self int64

	mu      sync.Mutex
	queue   []*groupWrite
	running int       // runners in flight
	started time.Time // when the last group was taken
	// lingered counts the lingers (for tests: a call alone must pay none).
	lingered atomic.Int64
}

// newGroup returns the group of statement sql, or nil when group commit is off or db
// cannot send batches (then every call writes alone).
func (l *Ledger) newGroup(sql string, self int64) *group {
	db, ok := l.db.(batcher)
	if _, inTx := l.db.(pgx.Tx); !ok || inTx || l.cfg.GroupLinger < 0 {
		return nil
	}
	return &group{l: l, db: db, sql: sql, linger: l.cfg.GroupLinger, max: l.cfg.GroupMax, self: self}
}

// write runs sql with args in a group transaction and scans its one row with scan, and
// reports whether it ran again alone after its group failed (see groupWrite.alone). It
// returns when the write committed or failed, or when ctx ends: then with ctx's error,
// having written nothing when the write was still queued, and with undo (if not nil)
// run on the write's success when its group had already taken it. A write under an
// ended ctx is not made.
func (g *group) write(ctx context.Context, key string, args []any, scan func(pgx.Row) error, undo func()) (again bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	w := &groupWrite{key: key, args: args, scan: scan, done: make(chan error, 1), undo: undo}
	g.mu.Lock()
	g.queue = append(g.queue, w)
	start := g.running == 0 || (g.running < maxGroupsInFlight && time.Since(g.started) >= groupStall)
	if start {
		g.running++
	}
	g.mu.Unlock()
	if start {
		go g.run()
	}
	select {
	case err := <-w.done:
		return w.alone, err
	case <-ctx.Done():
	}
	g.mu.Lock()
	if i := slices.Index(g.queue, w); i >= 0 { // not taken: never written
		g.queue = slices.Delete(g.queue, i, i+1)
		g.mu.Unlock()
		return false, ctx.Err()
	}
	g.mu.Unlock()
	if !w.state.CompareAndSwap(writeWaiting, writeAbandoned) {
		err := <-w.done // delivered meanwhile
		return w.alone, err
	}
	return false, ctx.Err()
}

// run sends groups of the queued writes until the queue is empty.
func (g *group) run() {
	if g.linger > 0 && g.l.active.Load() > g.self {
		g.lingered.Add(1)
		time.Sleep(g.linger)
	}
	for {
		batch := g.take()
		if batch == nil {
			return
		}
		g.send(batch)
	}
}

// take removes up to max writes from the queue; when it is empty, it ends the runner
// (nil).
func (g *group) take() []*groupWrite {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := min(len(g.queue), g.max)
	if n == 0 {
		g.running--
		return nil
	}
	batch := slices.Clone(g.queue[:n])
	g.queue = slices.Delete(g.queue, 0, n)
	g.started = time.Now()
	return batch
}

// send writes batch as one transaction and hands each write its outcome; when the
// transaction fails it writes them again one by one.
func (g *group) send(batch []*groupWrite) {
	if len(batch) == 1 {
		g.l.metrics.groupCommit(1, true)
		g.alone(batch[0])
		return
	}
	slices.SortStableFunc(batch, func(a, b *groupWrite) int { return strings.Compare(a.key, b.key) })
	ctx, cancel := context.WithTimeout(context.Background(), g.l.cfg.WriteTimeout)
	defer cancel()
	b := &pgx.Batch{}
	b.Queue(`SELECT set_config('lock_timeout', '` + groupLockTimeout + `', true)`)
	for _, w := range batch {
		b.Queue(g.sql, w.args...)
	}
	br := g.db.SendBatch(ctx, b)
	_, failed := br.Exec()
	errs := make([]error, len(batch))
	for i, w := range batch {
		if failed != nil {
			break
		}
		errs[i] = w.scan(br.QueryRow())
		if errs[i] != nil && !isNoRows(errs[i]) {
			failed = errs[i]
		}
	}
	if err := br.Close(); failed == nil {
		failed = err
	}
	g.l.metrics.groupCommit(len(batch), failed == nil)
	if failed == nil {
		for i, w := range batch {
			w.deliver(errs[i])
		}
		return
	}
	// The transaction did not commit (or may have, as its connection dropped). Each
	// write alone decides its own outcome: the statements find what an earlier commit
	// of theirs left (Begin's insert its own row, Succeed's upsert the recorded answer).
	// Concurrently, each on a connection of its own, so that one that waits (its row
	// held by another transaction) holds up no other.
	var wg sync.WaitGroup
	for _, w := range batch {
		w.alone = true
		wg.Go(func() { g.alone(w) })
	}
	wg.Wait()
}

// alone writes w in a transaction of its own, within Config.WriteTimeout. A write
// whose caller went away is not made again: after an outage every caller that gave up
// would otherwise be written once more, and hold the connections the calls after the
// outage need. (A group that did commit as its connection dropped then leaves such a
// caller's row in flight until its lease ends, as a statement cancelled after its
// commit would: no request went out, and the next attempt takes it over.)
func (g *group) alone(w *groupWrite) {
	if w.state.Load() == writeAbandoned {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), g.l.cfg.WriteTimeout)
	defer cancel()
	w.deliver(w.scan(g.l.db.QueryRow(ctx, g.sql, w.args...)))
}
