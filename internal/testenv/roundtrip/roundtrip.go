// Package roundtrip counts network round trips to Redis and PostgreSQL, for tests and
// benchmarks that claim a number of round trips per job or per request.
//
// A Counter is a go-redis hook (one command or one pipeline/MULTI-EXEC is one round trip)
// and a pgx tracer (one Query, QueryRow or Exec is one round trip, so Begin and Commit
// count; one SendBatch is one round trip). The commands go-redis sends to set up a new
// connection (HELLO, AUTH, SELECT, CLIENT SETINFO) are not counted: they happen once per
// pooled connection, not per operation.
package roundtrip

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// Counter counts round trips. The zero value is ready; it is safe for concurrent use.
type Counter struct {
	redis    atomic.Int64
	postgres atomic.Int64
}

var (
	_ redis.Hook      = (*Counter)(nil)
	_ pgx.QueryTracer = (*Counter)(nil)
	_ pgx.BatchTracer = (*Counter)(nil)
)

// Redis returns the Redis round trips counted so far.
func (c *Counter) Redis() int64 { return c.redis.Load() }

// Postgres returns the PostgreSQL round trips counted so far.
func (c *Counter) Postgres() int64 { return c.postgres.Load() }

// Reset sets both counts to zero.
func (c *Counter) Reset() {
	c.redis.Store(0)
	c.postgres.Store(0)
}

// DialHook implements redis.Hook; dialling is not counted.
func (c *Counter) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return next(ctx, network, addr)
	}
}

// ProcessHook implements redis.Hook: one command, one round trip.
func (c *Counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !connSetup(cmd) {
			c.redis.Add(1)
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook: one pipeline or transaction, one round trip.
func (c *Counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if !connSetup(cmd) {
				c.redis.Add(1)
				break
			}
		}
		return next(ctx, cmds)
	}
}

// connSetup reports whether cmd is one go-redis sends when it opens a connection.
func connSetup(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "auth", "select":
		return true
	case "client":
		args := cmd.Args()
		if len(args) > 1 {
			sub := strings.ToLower(fmt.Sprint(args[1]))
			return sub == "setinfo" || sub == "maint_notifications"
		}
	}
	return false
}

// TraceQueryStart implements pgx.QueryTracer.
func (c *Counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.postgres.Add(1)
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (c *Counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart implements pgx.BatchTracer: one batch, one round trip.
func (c *Counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.postgres.Add(1)
	return ctx
}

// TraceBatchQuery implements pgx.BatchTracer.
func (c *Counter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

// TraceBatchEnd implements pgx.BatchTracer.
func (c *Counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

var _ pgx.PrepareTracer = (*Counter)(nil)

// TracePrepareStart implements pgx.PrepareTracer.
func (c *Counter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd implements pgx.PrepareTracer: preparing a statement that was not
// prepared yet (once per connection and statement in pgx's default cache mode) is one
// round trip.
func (c *Counter) TracePrepareEnd(_ context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if !data.AlreadyPrepared {
		c.postgres.Add(1)
	}
}
