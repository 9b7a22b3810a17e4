package onceflow

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// The Client methods below moved to Inspector; they forward to it for this release.

// DB returns Config.DB.
//
// Deprecated: use c.Inspector().DB.
func (c *Client) DB() *pgxpool.Pool { return c.Inspector().DB() }

// Redis returns Config.Redis.
//
// Deprecated: use c.Inspector().Redis.
func (c *Client) Redis() redis.UniversalClient { return c.Inspector().Redis() }

// QueueKeys returns the Redis keys of queue name's partition 0.
//
// Deprecated: use c.Inspector().QueueKeys.
func (c *Client) QueueKeys(name string) queue.Keys { return c.Inspector().QueueKeys(name) }

// QueuePartitions returns the keys of every partition of queue name that may hold jobs.
//
// Deprecated: use c.Inspector().QueuePartitions.
func (c *Client) QueuePartitions(ctx context.Context, name string) ([]queue.Keys, error) {
	return c.Inspector().QueuePartitions(ctx, name)
}

// Queues returns the names of the queues Run works, sorted.
//
// Deprecated: use c.Inspector().Queues.
func (c *Client) Queues() []string { return c.Inspector().Queues() }

// Handler returns the queue.Handler that runs the jobs of queue name.
//
// Deprecated: use c.Inspector().Handler.
func (c *Client) Handler(name string) queue.Handler { return c.Inspector().Handler(name) }

// Breakers returns the client's circuit breakers.
//
// Deprecated: use c.Inspector().Breakers.
func (c *Client) Breakers() []*breaker.Breaker { return c.Inspector().Breakers() }

// ModelBreaker returns the circuit breaker of the client's model calls.
//
// Deprecated: use c.Inspector().ModelBreaker.
func (c *Client) ModelBreaker() *breaker.Breaker { return c.Inspector().ModelBreaker() }

// Ledger returns the llm_calls ledger of the client's model calls.
//
// Deprecated: use c.Inspector().Ledger.
func (c *Client) Ledger() *ledger.Ledger { return c.Inspector().Ledger() }

// Limiter returns the admission control of the client's model calls.
//
// Deprecated: use c.Inspector().Limiter.
func (c *Client) Limiter() *limiter.Limiter { return c.Inspector().Limiter() }

// Sender returns the outbox sender of the relay Run runs.
//
// Deprecated: use c.Inspector().Sender.
func (c *Client) Sender() outbox.Sender { return c.Inspector().Sender() }

// Completion returns the completion record of job id whatever its tenant.
//
// Deprecated: use c.Inspector().Completion.
func (c *Client) Completion(ctx context.Context, id string) (*JobState, error) {
	return c.Inspector().Completion(ctx, id)
}

// Workflows returns the workflows of the client's Config, in order.
//
// Deprecated: use c.Inspector().Workflows.
func (c *Client) Workflows() []Workflow { return c.Inspector().Workflows() }
