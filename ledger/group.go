package ledger

import (
	"context"
	"slices"
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
	// groupsInFlight is how many group transactions of one statement may be in flight
	// at once: while one is, writes queue up and the next group takes them all. One
	// gave the most jobs per second in BenchmarkPipeline (docs/BENCHMARKS.md): two or
	// four split the same writes into more, smaller transactions.
	groupsInFlight = 1
)

// batcher is what group commit needs from the database besides DB: *pgxpool.Pool and
// *pgx.Conn have it. A DB without it (or a pgx.Tx, whose commit is the caller's)
// writes every call alone.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

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
}

// group is the queue of one statement's writes (group commit): concurrent calls'
// writes of that statement share one transaction, one round trip and one WAL flush.
//
// A write is queued; when fewer than groupsInFlight groups of the statement are in
// flight, the writer leads a new group: it waits the linger when other calls of the
// ledger are in progress (a call alone pays none), takes up to max queued writes,
// sorts them by key and sends them as one pgx batch, which PostgreSQL runs as one
// implicit transaction. When the group ends, queued writes start the next one. Each
// write's outcome is its own row: a write that finds nothing (pgx.ErrNoRows) does not
// fail the others. A group that fails as a whole (a statement's error aborts the
// transaction; a lost connection) is written again call by call, each alone as
// without group commit, so that one call's bad input or a deadlock fails that call
// only, and every call gets its own error.
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
	running int
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
// returns when the group committed (or failed), within Config.WriteTimeout of the group
// starting: the group runs under its own context, since other calls depend on it, and
// ctx bounds only how long this call waits to join one. A call whose ctx ends while its
// group runs still gets the group's outcome, so that what committed is known.
func (g *group) write(ctx context.Context, key string, args []any, scan func(pgx.Row) error) (again bool, err error) {
	w := &groupWrite{key: key, args: args, scan: scan, done: make(chan error, 1)}
	g.mu.Lock()
	g.queue = append(g.queue, w)
	lead := g.running < groupsInFlight
	if lead {
		g.running++
	}
	g.mu.Unlock()
	if lead {
		g.lead(ctx)
	}
	err = <-w.done
	return w.alone, err
}

// lead runs groups until the queue is empty or another leader has it: the first with
// the writes queued now, after the linger; then, from a goroutine of its own, one with
// whatever queued meanwhile, so that the writer that led returns with its outcome.
func (g *group) lead(ctx context.Context) {
	if g.linger > 0 && g.l.active.Load() > g.self {
		g.wait(ctx)
	}
	batch := g.take()
	if batch == nil {
		g.done()
		return
	}
	g.run(batch)
	if g.more() {
		go g.follow()
	}
}

// follow runs the groups of writes that queued while a group was in flight.
func (g *group) follow() {
	for {
		batch := g.take()
		if batch == nil {
			g.done()
			return
		}
		g.run(batch)
		if !g.more() {
			return
		}
	}
}

// wait sleeps the linger, cut short when ctx ends.
func (g *group) wait(ctx context.Context) {
	g.lingered.Add(1)
	t := time.NewTimer(g.linger)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// take removes up to max writes from the queue; nil when it is empty.
func (g *group) take() []*groupWrite {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := min(len(g.queue), g.max)
	if n == 0 {
		return nil
	}
	batch := slices.Clone(g.queue[:n])
	g.queue = slices.Delete(g.queue, 0, n)
	return batch
}

// more reports whether writes are queued, keeping this group's slot when they are and
// giving it up when not.
func (g *group) more() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.queue) > 0 {
		return true
	}
	g.running--
	return false
}

// done gives up this group's slot.
func (g *group) done() {
	g.mu.Lock()
	g.running--
	g.mu.Unlock()
}

// run sends batch as one transaction and hands each write its outcome; when the
// transaction fails it writes them again one by one.
func (g *group) run(batch []*groupWrite) {
	slices.SortStableFunc(batch, func(a, b *groupWrite) int {
		switch {
		case a.key < b.key:
			return -1
		case a.key > b.key:
			return 1
		}
		return 0
	})
	ctx, cancel := context.WithTimeout(context.Background(), g.l.cfg.WriteTimeout)
	defer cancel()
	if len(batch) == 1 {
		w := batch[0]
		w.done <- w.scan(g.l.db.QueryRow(ctx, g.sql, w.args...))
		return
	}
	b := &pgx.Batch{}
	for _, w := range batch {
		b.Queue(g.sql, w.args...)
	}
	br := g.db.SendBatch(ctx, b)
	errs := make([]error, len(batch))
	var failed error
	for i, w := range batch {
		errs[i] = w.scan(br.QueryRow())
		if errs[i] != nil && !isNoRows(errs[i]) {
			failed = errs[i]
			break
		}
	}
	if err := br.Close(); failed == nil {
		failed = err
	}
	g.l.metrics.groupCommit(len(batch), failed == nil)
	if failed == nil {
		for i, w := range batch {
			w.done <- errs[i]
		}
		return
	}
	// The transaction did not commit (or may not have: a lost connection). Each write
	// alone decides its own outcome; the statements are written to find what an
	// earlier commit of theirs left (Begin's insert reads its own row, Succeed's upsert
	// the recorded answer).
	for _, w := range batch {
		w.alone = true
		w.done <- w.scan(g.l.db.QueryRow(ctx, g.sql, w.args...))
	}
}
