package limiter

import (
	"context"
	"errors"
	"iter"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// WithTenant returns ctx carrying tenant, the tenant a Wrap-ped client admits calls
// for (its budget, share and cap). A call without one is nobody's. It is
// llm.WithTenant: the ledger records the same tenant on the call's row.
func WithTenant(ctx context.Context, tenant string) context.Context {
	return llm.WithTenant(ctx, tenant)
}

// TenantFrom returns the tenant WithTenant put in ctx, "" for none.
func TenantFrom(ctx context.Context) string { return llm.TenantFrom(ctx) }

type backgroundKeyType struct{}

// WithBackground returns ctx whose calls through a Wrap-ped client are background
// calls (Call.Background): they take only capacity nobody else needs.
func WithBackground(ctx context.Context) context.Context {
	return context.WithValue(ctx, backgroundKeyType{}, true)
}

// callOf is the Call of req made with ctx: its tenant and class from ctx.
func callOf(ctx context.Context, req *llm.Request) Call {
	c := CallFor(TenantFrom(ctx), req)
	c.Background, _ = ctx.Value(backgroundKeyType{}).(bool)
	return c
}

// Wrap returns next behind the limiter: each call (Complete, Stream) is admitted with
// Acquire before it is made (as CallFor's Call, for WithTenant's tenant) and settled
// with Done when it is over. A call the limiter puts off fails at once with Acquire's
// *retry.WaitError; so does a call the provider answered with a 429, which pauses the
// model for the fleet (the WaitError then wraps the provider's error): the caller
// waits, it did not fail. The result is safe for concurrent use when next is.
func (l *Limiter) Wrap(next llm.Client) llm.Client { return &client{l: l, next: next} }

// WrapAround returns layer(next) behind the limiter, for a layer that may answer a call
// without making it (the llm_calls ledger replays recorded answers and waits for calls
// other deliveries make): the limiter admits every call before layer, and learns
// whether layer made it from an observer placed between layer and next. A call layer
// answered on its own gives its capacity back at once, uncharged.
func (l *Limiter) WrapAround(layer func(llm.Client) llm.Client, next llm.Client) llm.Client {
	return &client{l: l, next: layer(&observer{next: next}), observed: true}
}

type permitKeyType struct{}

// client admits and settles calls (Wrap, WrapAround).
type client struct {
	l        *Limiter
	next     llm.Client
	observed bool // an observer below records what became of the call
}

func (c *client) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	p, err := c.l.Acquire(ctx, callOf(ctx, req))
	if err != nil {
		return nil, err
	}
	if c.observed {
		ctx = context.WithValue(ctx, permitKeyType{}, p)
	}
	returned := false
	defer func() {
		if !returned { // the client below panicked: the call may have been sent
			p.Done(Result{Sent: true, Ambiguous: true, Err: errPanicked})
		}
	}()
	resp, err := c.next.Complete(ctx, req)
	returned = true
	r := c.result(p, resp, err)
	return resp, c.settle(p, r, err)
}

func (c *client) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		p, err := c.l.Acquire(ctx, callOf(ctx, req))
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if c.observed {
			ctx = context.WithValue(ctx, permitKeyType{}, p)
		}
		col := &streamResult{}
		settled := false
		defer func() {
			if !settled { // the consumer stopped early: the answer was cut off
				p.Done(c.streamDone(p, col, errStopped))
			}
		}()
		for ch, err := range c.next.Stream(ctx, req) {
			col.add(ch, err)
			if err != nil {
				settled = true
				yield(ch, c.settle(p, c.streamDone(p, col, err), err))
				return
			}
			if ch.Done {
				settled = true
				p.Done(c.streamDone(p, col, nil))
			}
			if !yield(ch, nil) {
				return
			}
		}
		if !settled {
			settled = true
			p.Done(c.streamDone(p, col, nil))
		}
	}
}

// errPanicked stands for a call whose client panicked: its answer, if any, is lost.
var errPanicked = errors.New("limiter: the model client panicked")

// errStopped stands for a stream its consumer stopped reading: its answer is lost.
var errStopped = errors.New("limiter: the stream's consumer stopped")

// result is what became of a Complete call: the observer's record when there is one,
// else what the call returned (a call that returns was made, unless its error says
// it was never sent).
func (c *client) result(p *Permit, resp *llm.Response, err error) Result {
	if c.observed {
		if r := p.obs.Load(); r != nil {
			return *r
		}
		return Result{} // the layer answered without a call
	}
	return observe(resp, err)
}

// observe turns a call's outcome into a Result.
func observe(resp *llm.Response, err error) Result {
	if err != nil {
		r := Result{Sent: !notSent(err), Err: err, Ambiguous: ledger.IsAmbiguous(err)}
		var api *llm.APIError
		if errors.As(err, &api) {
			r.RateLimit = api.RateLimit
		}
		return r
	}
	r := Result{Sent: true}
	if resp != nil {
		u := resp.Usage
		r.Usage, r.RateLimit = &u, resp.RateLimit
	}
	return r
}

// notSent reports an error that says the request never left: a refused connection, a
// failed dial, a request refused before processing (what the ledger does not call
// ambiguous and is not the provider's answer), or a limit or breaker that stopped it.
func notSent(err error) bool {
	switch {
	case errors.Is(err, retry.ErrWaiting), errors.Is(err, retry.ErrUnavailable):
		return true
	case errors.As(err, new(*llm.APIError)), errors.Is(err, llm.ErrMalformedResponse):
		return false
	}
	return !ledger.IsAmbiguous(err)
}

// settle ends p with r and returns what the caller gets for err: a *retry.WaitError
// wrapping err when the answer paused the model for a 429, else err.
func (c *client) settle(p *Permit, r Result, err error) error {
	pause := p.Done(r)
	if err != nil && pause > 0 && errors.As(err, new(*llm.APIError)) && retry.Classify(err).Class == retry.ClassRateLimited {
		return &retry.WaitError{Delay: pause + jitter(pause/10, waitJitter), Reason: "model " + p.model + " is paused: the provider answered 429", Err: err}
	}
	return err
}

// streamResult collects what a stream's chunks say of its call.
type streamResult struct {
	chunks    int
	usage     *llm.Usage
	rateLimit *llm.RateLimit
}

func (s *streamResult) add(ch llm.Chunk, err error) {
	if err != nil {
		return
	}
	s.chunks++
	if ch.Done {
		s.usage, s.rateLimit = ch.Usage, ch.RateLimit
	}
}

// streamDone is what became of a stream that ended with err (nil: its final chunk).
func (c *client) streamDone(p *Permit, col *streamResult, err error) Result {
	if c.observed {
		if r := p.obs.Load(); r != nil {
			return *r
		}
		if col.chunks == 0 || err == nil {
			return Result{} // replayed or waited for by the layer: no call of ours
		}
	}
	if err == nil {
		return Result{Sent: true, Usage: col.usage, RateLimit: col.rateLimit}
	}
	if errors.Is(err, errStopped) || col.chunks > 0 {
		return Result{Sent: true, Ambiguous: true, Err: err}
	}
	return observe(nil, err)
}

// observer sits between a layer and the provider (WrapAround) and records on the
// context's permit what became of the call the layer made.
type observer struct{ next llm.Client }

func permitFrom(ctx context.Context) *Permit {
	p, _ := ctx.Value(permitKeyType{}).(*Permit)
	return p
}

// Complete sends the call and records what became of it, unless its model was paused
// after the call's admission (while the layer above, the ledger, wrote its row): then
// it returns the pause's wait without reaching the provider
// (Permit.pausedSinceAdmission).
func (o *observer) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	p := permitFrom(ctx)
	if err := p.pausedSinceAdmission(); err != nil {
		p.observed(Result{Err: err})
		return nil, err
	}
	resp, err := o.next.Complete(ctx, req)
	if p != nil {
		p.observed(observe(resp, err))
	}
	return resp, err
}

func (o *observer) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		p := permitFrom(ctx)
		if err := p.pausedSinceAdmission(); err != nil { // as in Complete
			p.observed(Result{Err: err})
			yield(llm.Chunk{}, err)
			return
		}
		col := &streamResult{}
		record := func(r Result) {
			if p != nil {
				p.observed(r)
			}
		}
		done := false
		defer func() {
			if !done {
				record(Result{Sent: true, Ambiguous: true, Err: errStopped})
			}
		}()
		for ch, err := range o.next.Stream(ctx, req) {
			col.add(ch, err)
			if err != nil {
				done = true
				if col.chunks > 0 {
					record(Result{Sent: true, Ambiguous: true, Err: err})
				} else {
					record(observe(nil, err))
				}
				yield(ch, err)
				return
			}
			if ch.Done {
				done = true
				record(Result{Sent: true, Usage: col.usage, RateLimit: col.rateLimit})
			}
			if !yield(ch, nil) {
				return
			}
		}
		if !done {
			done = true
			record(Result{Sent: true, Usage: col.usage, RateLimit: col.rateLimit})
		}
	}
}
