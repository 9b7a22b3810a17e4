package onceflow

import (
	"context"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// Inspector reaches the machinery under a Client, for operators' tools and programs
// that assemble parts themselves: its stores, the Redis keys of its queues, the handler
// its workers run, the model's ledger, limiter and breakers, the outbox sender of its
// relay, and the completion record of any job whatever its tenant. A workflow needs none
// of it: Enqueue, Job.Complete and Job.Commit are the whole of a workflow's API.
//
// Get one with Client.Inspector; it is a view of the client (no state of its own) and
// safe for concurrent use.
type Inspector struct {
	c *Client
}

// Inspector returns the client's Inspector.
func (c *Client) Inspector() *Inspector { return &Inspector{c: c} }

// DB returns Config.DB, the PostgreSQL pool of the client's tables (nil without one),
// for a workflow's own reads of its tables (a GET of its rows, its audit).
func (in *Inspector) DB() *pgxpool.Pool { return in.c.cfg.DB }

// Redis returns Config.Redis, for reads of a queue's state (queue.ReadStats,
// queue.ListDead) by a workflow's audit.
func (in *Inspector) Redis() redis.UniversalClient { return in.c.rdb }

// QueueKeys returns the Redis keys of queue name under Config.Prefix (of its partition
// 0; QueuePartitions gives them all), for the queue package's inspection functions.
func (in *Inspector) QueueKeys(name string) queue.Keys { return in.c.keys(name) }

// QueuePartitions returns the keys of every partition of queue name that may hold jobs:
// its configured partitions, and more when a higher count was recorded before
// (queue.KnownPartitions, read at most every 30 seconds: a UI page asks several times;
// without Redis's answer, the configured ones and the error).
// For the queue package's inspection functions over a whole queue.
func (in *Inspector) QueuePartitions(ctx context.Context, name string) ([]queue.Keys, error) {
	c := in.c
	n, err := c.knownPartitions(ctx, name)
	if err != nil {
		n = c.partitions(name)
	}
	return c.keys(name).Partitions(n), err
}

// Queues returns the names of the queues Run works, sorted.
func (in *Inspector) Queues() []string { return in.c.queueNames() }

// queueNames returns the names of the queues Run works, sorted.
func (c *Client) queueNames() []string { return slices.Sorted(maps.Keys(c.queues)) }

// Handler returns the queue.Handler that runs the jobs of queue name: it routes each
// job by kind to its Worker through the middleware. Run uses it; it is for programs that
// build their own queue.Worker.
func (in *Inspector) Handler(name string) queue.Handler { return in.c.handler(name, in.c.queues[name]) }

// Breakers returns the client's circuit breakers: Redis's, PostgreSQL's (with
// Config.DB) and the model's (with Config.Model), in that order. Each opens after
// Config.BreakerThreshold transient failures in a row, across jobs:
//   - Redis: failing health checks (PING);
//   - PostgreSQL: failing health checks, and commits or ledger calls that found it
//     unreachable;
//   - the model: calls that failed with a 5xx, a timeout or a lost connection after
//     their retries, or an exhausted quota (at once); while it is open model calls fail
//     at once.
//
// Run and RunWorkers check Redis and PostgreSQL every HealthInterval; while one's
// breaker is open that check is its probe, and the first that passes closes it. The
// model's breaker is probed by one job's call every QuotaProbe. The queues take no work
// while a breaker is open (QueueConfig.Gate), so an outage spends no job's deliveries:
// a job that meets it is handed back (ErrUnavailable) and runs once the dependency is
// back. The slice is new on each call; the breakers are the client's.
func (in *Inspector) Breakers() []*breaker.Breaker {
	c := in.c
	out := []*breaker.Breaker{c.redisBreaker}
	if c.pgBreaker != nil {
		out = append(out, c.pgBreaker)
	}
	if c.model != nil {
		out = append(out, c.model.breaker)
	}
	return out
}

// ModelBreaker returns the circuit breaker of the client's model calls (nil without
// Config.Model): open while the provider's quota is exhausted, or after
// BreakerThreshold calls in a row failed with a 5xx, a timeout or a lost connection,
// until a probe succeeds. Report it in a readiness check; its Err says since when and
// why it is open. It is one of Breakers.
func (in *Inspector) ModelBreaker() *breaker.Breaker {
	if in.c.model == nil {
		return nil
	}
	return in.c.model.breaker
}

// Ledger returns the llm_calls ledger of the client's model calls (nil without
// Config.Model), for inspection (Get) and audits.
func (in *Inspector) Ledger() *ledger.Ledger {
	if in.c.model == nil {
		return nil
	}
	return in.c.model.ledger
}

// Limiter returns the admission control of the client's model calls (nil without
// Config.Model, or with Config.NoLimits), for its state and tools.
func (in *Inspector) Limiter() *limiter.Limiter {
	if in.c.model == nil {
		return nil
	}
	return in.c.model.limiter
}

// Sender returns the outbox sender of the relay Run runs: Config.Senders by topic plus
// the built-in sender of EnqueueTx's jobs, as an *outbox.Router, which makes a relay
// claim only its topics. It is for programs that run the relay themselves
// (outbox.NewRelay(pgoutbox.New(pool), inspector.Sender(), cfg)); nil without Config.DB.
func (in *Inspector) Sender() outbox.Sender {
	if in.c.router == nil {
		return nil
	}
	return in.c.router
}

// Completion returns the completion record of job id whatever its tenant (Tenant is
// set): for operator tools (the adminui package), never for an API a tenant calls
// (Client.JobState checks the tenant). A job without one (not done, never done with a
// Commit, or an unknown id) gives ErrJobNotFound; so does a client without DB.
func (in *Inspector) Completion(ctx context.Context, id string) (*JobState, error) {
	if in.c.cfg.DB == nil {
		return nil, ErrJobNotFound
	}
	return in.c.completion(ctx, id)
}

// Workflows returns the workflows of the client's Config, in order.
func (in *Inspector) Workflows() []Workflow { return slices.Clone(in.c.cfg.Workflows) }
