package llm

import (
	"context"
	"iter"
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

// WithBreaker returns c behind b: a call is made only when b.Allow permits it (while
// b is open, calls fail at once with b's error, which retry.Classify reports as
// ClassUnavailable); an answer that says the provider's quota, spend or billing limit is
// exhausted (retry.ClassQuota, unless x-should-retry says otherwise) trips b, for the answer's Retry-After when it has one; a
// call that succeeds tells b so, which closes it after a probe. The result is safe for
// concurrent use when c is.
func WithBreaker(c Client, b Breaker) Client { return &breakerClient{next: c, b: b} }

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
	resp, err := c.next.Complete(ctx, req)
	c.observe(t, start, err)
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
		for ch, err := range c.next.Stream(ctx, req) {
			if err != nil {
				c.observe(t, start, err)
				yield(ch, err)
				return
			}
			if ch.Done {
				c.observe(t, start, nil)
			}
			if !yield(ch, nil) {
				return
			}
		}
	}
}

// observe trips the breaker on a quota verdict and reports success.
func (c *breakerClient) observe(t breaker.Ticket, start time.Time, err error) {
	if err == nil {
		c.b.SucceedStarted(t, start)
		return
	}
	if v := retry.Classify(err); v.Class == retry.ClassQuota && !v.Retryable {
		c.b.Trip(err, v.RetryAfter)
	}
}
