package ledger

import (
	"context"
	"sync"
)

// Deferred is the answers recorded under a context of DeferFlush: committed without
// waiting for their WAL flush, and durable once a later durable commit on the same
// PostgreSQL flushed them (WAL is flushed in order: a commit that waits for its flush
// makes everything written before it durable too) or Flush did. It is safe for
// concurrent use.
type Deferred struct {
	mu  sync.Mutex
	key string // the last answer recorded since the last flush
	// added counts the answers recorded under d, so that a durable write clears only
	// what was recorded before it began (Mark, FlushedSince).
	added uint64
}

// deferredKey is the context key of a *Deferred.
type deferredKey struct{}

// DeferFlush returns ctx under which the answers Attempt.Succeed records (and so
// Client's) commit without waiting for the WAL flush, collected in d (its zero value is
// ready to use); a nil d makes them durable again under ctx (a caller that must have an
// answer durable whatever its context). It is for a caller whose next step is a durable
// commit of its own on the same PostgreSQL (onceflow's job runtime: an answer it held,
// recorded when the delivery does something before its Commit), which then makes the
// answer durable with it: the answer costs no durable commit of its own. Until then a
// crash of PostgreSQL (not of the caller) can lose the answer, which leaves the call's
// row in_flight with its durable in-flight record: the next attempt takes it over once
// the lease ends, counted as ambiguous, and asks again. The caller must not act on the
// answer outside that commit before it (or Flush) returns, and calls Flush if it does
// not commit after all. SucceedTx and a Ledger over a pgx.Tx ignore it (the
// transaction's commit is the caller's).
func DeferFlush(ctx context.Context, d *Deferred) context.Context {
	return context.WithValue(ctx, deferredKey{}, d)
}

// deferredFrom returns ctx's Deferred, or nil.
func deferredFrom(ctx context.Context) *Deferred {
	d, _ := ctx.Value(deferredKey{}).(*Deferred)
	return d
}

// add notes the answer of key, written without waiting for its flush; a nil d does
// nothing.
func (d *Deferred) add(key string) {
	if d == nil {
		return
	}
	d.mu.Lock()
	d.key = key
	d.added++
	d.mu.Unlock()
}

// Mark returns a mark of the answers recorded under d so far, for FlushedSince: take
// it before a durable commit, and tell d after it succeeded. A nil d returns 0.
func (d *Deferred) Mark() uint64 {
	if d == nil {
		return 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.added
}

// FlushedSince tells d that a durable commit on the ledger's PostgreSQL, begun after
// Mark returned mark, succeeded: the answers recorded before it are durable. An answer
// recorded since the mark (perhaps after that commit) stays pending, for a later flush.
// A nil d does nothing.
func (d *Deferred) FlushedSince(mark uint64) {
	if d == nil {
		return
	}
	d.mu.Lock()
	if d.added == mark {
		d.key = ""
	}
	d.mu.Unlock()
}

// Pending reports whether an answer was recorded under d since the last Flushed or
// Flush: one that a crash of PostgreSQL could still lose.
func (d *Deferred) Pending() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.key != ""
}

// Flushed tells d that a durable commit on the ledger's PostgreSQL succeeded after the
// answers recorded so far: they are durable. A caller whose answers may be recorded
// while it commits (concurrent steps) uses Mark and FlushedSince instead.
func (d *Deferred) Flushed() {
	d.mu.Lock()
	d.key = ""
	d.mu.Unlock()
}

// flushSQL makes the answers committed before it durable: a write (the row's own
// updated_at, unchanged) whose commit waits for the WAL flush, which covers every
// commit before it. A row the crash lost matches nothing: then there is nothing to
// flush. $1 idem_key.
const flushSQL = `UPDATE llm_calls SET updated_at = updated_at WHERE idem_key = $1`

// Flush makes d's pending answers durable with one durable commit, when there are any;
// within Config.WriteTimeout, under context.WithoutCancel(ctx). Its errors are database
// errors (ErrUnavailable): the answers may then still be lost to a crash of
// PostgreSQL, as the WAL writer flushes them within a fraction of a second anyway.
func (l *Ledger) Flush(ctx context.Context, d *Deferred) error {
	if d == nil {
		return nil
	}
	d.mu.Lock()
	key, mark := d.key, d.added
	d.mu.Unlock()
	if key == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.WriteTimeout)
	defer cancel()
	if _, err := l.db.Exec(ctx, flushSQL, key); err != nil {
		return dbError("flush the answer of "+key, err)
	}
	d.FlushedSince(mark)
	return nil
}
