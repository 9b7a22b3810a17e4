package roundtrip

import (
	"context"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// Commits is a pgx tracer that counts round trips (Counter) and the commits of a pool
// whose users open no explicit transactions: every statement that is not a SELECT, and
// every batch (pgx runs a batch sent outside a transaction as one implicit
// transaction), commits once. A commit is durable when it waits for its WAL flush, and
// relaxed when its statement (a batch's: its first) sets synchronous_commit off for its
// own transaction (set_config('synchronous_commit', 'off', true), as the ledger's
// answers that a job's Commit flushes and its streamed output do). An autocommit
// SELECT writes nothing and flushes nothing. The zero value is ready; it is safe for
// concurrent use.
type Commits struct {
	Counter
	// Only, when set, restricts the commits counted to the statements (a batch: its
	// first) it reports true for; round trips are all counted.
	Only func(sql string) bool

	durable, relaxed atomic.Int64
}

var (
	_ pgx.QueryTracer = (*Commits)(nil)
	_ pgx.BatchTracer = (*Commits)(nil)
)

// Durable returns the commits counted that waited for their WAL flush.
func (c *Commits) Durable() int64 { return c.durable.Load() }

// Relaxed returns the commits counted that did not wait for their WAL flush.
func (c *Commits) Relaxed() int64 { return c.relaxed.Load() }

// Reset sets every count to zero.
func (c *Commits) Reset() {
	c.Counter.Reset()
	c.durable.Store(0)
	c.relaxed.Store(0)
}

// TraceQueryStart implements pgx.QueryTracer.
func (c *Commits) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.count(d.SQL)
	return c.Counter.TraceQueryStart(ctx, conn, d)
}

// TraceBatchStart implements pgx.BatchTracer: one batch, one commit.
func (c *Commits) TraceBatchStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if d.Batch != nil && len(d.Batch.QueuedQueries) > 0 {
		c.count(d.Batch.QueuedQueries[0].SQL)
	}
	return c.Counter.TraceBatchStart(ctx, conn, d)
}

// RelaxedCommit is the SQL by which a statement's transaction commits without waiting
// for its WAL flush.
const RelaxedCommit = "set_config('synchronous_commit', 'off', true)"

func (c *Commits) count(sql string) {
	switch {
	case c.Only != nil && !c.Only(sql):
	case strings.HasPrefix(strings.ToUpper(strings.TrimSpace(sql)), "SELECT"):
	case strings.Contains(sql, RelaxedCommit):
		c.relaxed.Add(1)
	default:
		c.durable.Add(1)
	}
}
