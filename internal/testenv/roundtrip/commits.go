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
// relaxed when its statement (a batch's: any) sets synchronous_commit off for its
// own transaction (set_config('synchronous_commit', 'off', true), as the ledger's
// answers that a job's Commit flushes and its streamed output do). An autocommit
// SELECT writes nothing and flushes nothing. The zero value is ready; it is safe for
// concurrent use.
type Commits struct {
	Counter
	// Only, when set, restricts the commits counted to the statements it reports true
	// for (a batch counts when one of its statements does); round trips are all
	// counted.
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
	if d.Batch != nil {
		c.countBatch(d.Batch.QueuedQueries)
	}
	return c.Counter.TraceBatchStart(ctx, conn, d)
}

// RelaxedCommit is the SQL by which a statement's transaction commits without waiting
// for its WAL flush.
const RelaxedCommit = "set_config('synchronous_commit', 'off', true)"

// countBatch counts a batch's one commit: relaxed when a statement sets
// synchronous_commit off for the transaction, durable when a statement writes, none
// when every statement is a SELECT.
func (c *Commits) countBatch(qs []*pgx.QueuedQuery) {
	kind := ""
	for _, q := range qs {
		if c.Only != nil && !c.Only(q.SQL) {
			continue
		}
		switch {
		case strings.Contains(q.SQL, RelaxedCommit):
			kind = "relaxed"
		case kind == "" && !strings.HasPrefix(strings.ToUpper(strings.TrimSpace(q.SQL)), "SELECT"):
			kind = "durable"
		}
	}
	switch kind {
	case "relaxed":
		c.relaxed.Add(1)
	case "durable":
		c.durable.Add(1)
	}
}

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
