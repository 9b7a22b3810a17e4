package outbox

import (
	"context"
	"time"
)

// Store is the database side of a Relay. pgoutbox.Store implements it for PostgreSQL.
//
// Implementations must be safe for concurrent use by several relays, in one process or
// many, and must never select due rows by "id greater than the last one seen": ids are
// assigned in insertion order but commit out of order.
type Store interface {
	// Claim leases up to limit due rows (unsent, not exhausted, next attempt due, not
	// leased by a live claim) to relay until lease from now, and returns them in due
	// order. It commits before returning, so no database lock is held while the caller
	// sends. Two concurrent claims never return the same row while its lease runs.
	Claim(ctx context.Context, relay string, limit int, lease time.Duration) ([]Message, error)
	// Settle records what happened to rows relay claimed, all in one round trip, and
	// clears their lease. It applies only to rows still claimed by relay and not yet
	// sent or exhausted (fencing: a relay whose lease ran out and whose rows another
	// relay claimed changes nothing); Settled says which rows it applied to.
	Settle(ctx context.Context, relay string, s Settlement) (Settled, error)
	// PurgeSent deletes up to limit rows sent more than olderThan ago and returns how
	// many it deleted.
	PurgeSent(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
}

// OldestUnsentStore is a Store that can say how long the oldest unsent, not exhausted
// row has waited (zero when there is none); the relay samples it as a metric.
type OldestUnsentStore interface {
	OldestUnsent(ctx context.Context) (time.Duration, error)
}

// Settlement is the outcome of one claimed batch.
type Settlement struct {
	// Sent are the rows the provider accepted.
	Sent []int64
	// Failed are the rows whose send failed.
	Failed []Failure
	// Released are the rows that were claimed but not sent (the relay is shutting down,
	// or a send was abandoned mid-way): their lease is cleared without counting an
	// attempt, so any relay may claim them again at once.
	Released []int64
}

// Failure is one failed send.
type Failure struct {
	ID int64
	// Error is stored as the row's last_error.
	Error string
	// Delay is how long until the row is due again.
	Delay time.Duration
	// Exhaust marks the row exhausted: it is not tried again until a person resets it.
	Exhaust bool
	// Outage marks a failure that says a dependency is down (the send's error matched
	// ErrUnavailable): the row is due again after Delay, like any failure, but the
	// attempt is not counted (the row's attempts stay as they were), so an outage,
	// however long, never brings it closer to exhaustion. The relay never sets Exhaust
	// with it; a Store that ignores Outage counts the attempt, and the relay still does
	// not exhaust the row for this failure.
	Outage bool
}

// Settled reports which rows a Settle applied to. Rows of the Settlement missing here
// were fenced: claimed by another relay, or already settled.
type Settled struct {
	Sent      []int64
	Retrying  []int64
	Exhausted []int64
	Released  []int64
}

// Len returns the number of rows settled.
func (s Settled) Len() int {
	return len(s.Sent) + len(s.Retrying) + len(s.Exhausted) + len(s.Released)
}
