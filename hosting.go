package onceflow

import (
	"context"
	"errors"
	"fmt"
)

// ErrUnknownQueue is returned by RunWorkers for a queue the client's Config does not
// list (Config.Queues and the workflows' queues).
var ErrUnknownQueue = errors.New("onceflow: unknown queue")

// RunWorkers is the worker half of Run, for processes that run the parts separately
// (`onceflow work --queue` and `onceflow relay`): it works the named queues, all of the
// client's when none is named, purges the model ledger's expired rows when the client
// has a Model, and checks Redis and PostgreSQL for their breakers (Client.Breakers),
// until ctx is cancelled; then it drains each queue within its
// ShutdownTimeout and returns nil. It does not run the outbox relay (RunRelay does). A
// name the client does not know is an error wrapping ErrUnknownQueue, before anything
// runs. Unlike Run it may be called concurrently with RunRelay.
func (c *Client) RunWorkers(ctx context.Context, queues ...string) error {
	if len(queues) == 0 {
		queues = c.Queues()
	}
	var parts []func(context.Context) error
	seen := map[string]bool{}
	for _, name := range queues {
		if _, ok := c.queues[name]; !ok {
			return fmt.Errorf("%w %q (the client's queues: %v)", ErrUnknownQueue, name, c.Queues())
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		run, err := c.queueRunner(ctx, name)
		if err != nil {
			return err
		}
		parts = append(parts, run)
	}
	if c.model != nil {
		parts = append(parts, c.model.ledger.Run)
		if c.model.limiter != nil {
			parts = append(parts, c.model.limiter.Run)
		}
	}
	return runParts(ctx, append(parts, c.watchers()...))
}

// RunRelay is the relay half of Run: it runs the outbox relay, which hands the effects
// of committed jobs to Config.Senders by topic (and sends EnqueueTx's jobs), until ctx is
// cancelled, and returns nil. It needs Config.DB. It may run in a process of its own,
// several at once (they never send the same row at once), or beside RunWorkers.
func (c *Client) RunRelay(ctx context.Context) error {
	if c.relay == nil {
		return errors.New("onceflow: RunRelay: Config.DB is required (the outbox is in PostgreSQL)")
	}
	return c.relay.Run(ctx)
}
