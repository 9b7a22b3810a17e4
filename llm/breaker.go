package llm

import (
	"context"
	"iter"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/retry"
)

// Breaker stops calls to a provider while it is unusable as a whole (an exhausted
// quota); *breaker.Breaker implements it.
type Breaker interface {
	// Allow returns nil when a call may go, with the call's ticket, else an error
	// matching retry.ErrUnavailable.
	Allow() (breaker.Ticket, error)
	// Trip stops calls because of cause, for wait when positive.
	Trip(cause error, wait time.Duration)
	// SucceedStarted reports that the call of a ticket, which started at the given
	// time, worked.
	SucceedStarted(breaker.Ticket, time.Time)
}

// TicketReleaser is a Breaker that can take back the ticket of a call that did not reach
// the provider (its answer was replayed from a record, see MarkReplayed), so that the
// probe it may have been is let through again; *breaker.Breaker implements it.
type TicketReleaser interface {
	Release(breaker.Ticket)
}

// WithBreaker returns c behind b: a call is made only when b.Allow permits it (while
// b is open, calls fail at once with b's error, which retry.Classify reports as
// ClassUnavailable); an answer that says the provider's quota, spend or billing limit is
// exhausted (retry.ClassQuota, unless x-should-retry says otherwise) trips b, for the answer's Retry-After when it has one; a
// call that succeeds tells b so, which closes it after a probe. A call whose answer a
// layer below c replayed from a record (MarkReplayed: the ledger of model calls) says
// nothing of the provider: b hears nothing of it, but for its ticket handed back when b
// is a TicketReleaser. The result is safe for concurrent use when c is.
func WithBreaker(c Client, b Breaker) Client { return &breakerClient{next: c, b: b} }

// replayedKey is the context key of the flag MarkReplayed sets.
type replayedKey struct{}

// MarkReplayed tells WithBreaker, above the layer that calls it, that the answer of the
// call ctx belongs to was replayed from a record (a ledger's) and did not come from the
// provider: the breaker counts it neither as the provider working nor as a probe. A
// no-op for a ctx that no WithBreaker call carries. Safe for concurrent use.
func MarkReplayed(ctx context.Context) {
	if f, ok := ctx.Value(replayedKey{}).(*atomic.Bool); ok {
		f.Store(true)
	}
}

// withReplayFlag returns ctx carrying a flag for MarkReplayed, and the flag.
func withReplayFlag(ctx context.Context) (context.Context, *atomic.Bool) {
	f := new(atomic.Bool)
	return context.WithValue(ctx, replayedKey{}, f), f
}

type breakerClient struct {
	next Client
	b    Breaker
}

func (c *breakerClient) Complete(ctx context.Context, req *Request) (*Response, error) {
	t, err := c.b.Allow()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	ctx, replayed := withReplayFlag(ctx)
	resp, err := c.next.Complete(ctx, req)
	c.observe(t, start, replayed.Load(), err)
	return resp, err
}

func (c *breakerClient) Stream(ctx context.Context, req *Request) iter.Seq2[Chunk, error] {
	return func(yield func(Chunk, error) bool) {
		t, err := c.b.Allow()
		if err != nil {
			yield(Chunk{}, err)
			return
		}
		start := time.Now()
		ctx, replayed := withReplayFlag(ctx)
		for ch, err := range c.next.Stream(ctx, req) {
			if err != nil {
				c.observe(t, start, replayed.Load(), err)
				yield(ch, err)
				return
			}
			if ch.Done {
				c.observe(t, start, replayed.Load(), nil)
			}
			if !yield(ch, nil) {
				return
			}
		}
	}
}

// observe trips the breaker on a quota verdict and reports success; a replayed answer
// only hands its ticket back.
func (c *breakerClient) observe(t breaker.Ticket, start time.Time, replayed bool, err error) {
	if replayed {
		if r, ok := c.b.(TicketReleaser); ok {
			r.Release(t)
		}
		return
	}
	if err == nil {
		c.b.SucceedStarted(t, start)
		return
	}
	if v := retry.Classify(err); v.Class == retry.ClassQuota && !v.Retryable {
		c.b.Trip(err, v.RetryAfter)
	}
}
