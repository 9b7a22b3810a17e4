package onceflow

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
)

// Connection defaults of RedisOptions, RedisClusterOptions and PostgresConfig. Each can
// be overridden in the URL (dial_timeout, read_timeout, write_timeout, pool_max_conns,
// connect_timeout, statement_timeout, idle_in_transaction_session_timeout).
const (
	// DefaultRedisDialTimeout bounds connecting to Redis, so a stopped Redis fails fast.
	DefaultRedisDialTimeout = 2 * time.Second
	// DefaultRedisIOTimeout bounds one Redis read or write when the context has no
	// deadline.
	DefaultRedisIOTimeout = 3 * time.Second
	// DefaultPostgresConnectTimeout bounds connecting to PostgreSQL.
	DefaultPostgresConnectTimeout = 3 * time.Second
	// DefaultPostgresMaxConns is the PostgreSQL pool size.
	DefaultPostgresMaxConns = 32
	// DefaultPostgresStatementTimeout is every session's statement_timeout: a statement
	// that runs longer (a lock wait on a stuck row, a runaway query) fails, so it cannot
	// hold a job for ever.
	DefaultPostgresStatementTimeout = connect.DefaultPostgresStatementTimeout
	// DefaultPostgresIdleInTransactionTimeout is every session's
	// idle_in_transaction_session_timeout.
	DefaultPostgresIdleInTransactionTimeout = connect.DefaultPostgresIdleInTransactionTimeout
)

// RedisOptions parses a Redis URL (redis://[user:password@]host:port/db?options, see
// redis.ParseURL) into go-redis options that onceflow's guarantees hold under, which
// CheckRedis accepts:
//   - ContextTimeoutEnabled: a context's deadline bounds socket reads and writes, so a
//     hung Redis cannot hold a call past its deadline (an accept answers 503 in time).
//   - MaxRetries -1: go-redis never re-sends a command after a network error (its
//     default re-sends up to 3 times, and an XADD or a script that reached Redis would
//     run again); the caller decides what to retry, within its deadline.
//   - DialTimeout DefaultRedisDialTimeout, ReadTimeout and WriteTimeout
//     DefaultRedisIOTimeout, one dial retry instead of five (a refused connection is
//     reported quickly while Redis is down), maintenance notifications off (a Redis 8
//     handshake that costs Redis 7 a round trip per connection).
//
// Settings in the URL win (max_retries=2 is kept, and then refused by CheckRedis).
// Errors do not quote the URL, which may hold a password. Change the result's other
// fields (PoolSize, TLSConfig, ...) as you need before redis.NewClient.
func RedisOptions(url string) (*redis.Options, error) { return connect.RedisOptions(url) }

// NewRedis returns a Redis client built from RedisOptions(url). It does not connect: the
// first command does, so a program can start while Redis is down.
func NewRedis(url string) (*redis.Client, error) { return connect.Redis(url) }

// RedisClusterOptions parses a Redis Cluster URL (redis://host:port?addr=host2:port2,
// see redis.ParseClusterURL) into go-redis cluster options with RedisOptions' settings
// and one more, MaxRedirects -1: a *redis.ClusterClient runs each command in one loop
// of up to MaxRedirects extra attempts (go-redis's default: 3) that both follows MOVED
// and ASK redirects and re-sends the command after a network error. With -1 nothing is
// re-sent; a redirect while slots move (resharding, failover) is an error the caller
// retries like a network error, and the client reloads the slot map meanwhile.
func RedisClusterOptions(url string) (*redis.ClusterOptions, error) {
	return connect.RedisClusterOptions(url)
}

// NewRedisCluster returns a Redis Cluster client built from RedisClusterOptions(url).
// It does not connect.
func NewRedisCluster(url string) (*redis.ClusterClient, error) { return connect.RedisCluster(url) }

// ErrRedisOptions is matched by CheckRedis's errors.
var ErrRedisOptions = errors.New("onceflow: unsafe Redis client options")

// CheckRedis reports whether rdb's options are ones onceflow's guarantees hold under:
// ContextTimeoutEnabled, so that every call ends at its context's deadline (a bounded
// accept answers 503 instead of hanging), and no retries by go-redis itself, so that it
// never re-sends a command on its own (the scripts are safe to retry, each documents why,
// but the retry must be onceflow's decision, within its deadline, not a hidden second,
// third and fourth attempt): MaxRetries -1 (go-redis's default, 0, means 3 on a
// *redis.Client), and on a *redis.ClusterClient MaxRedirects -1 as well (see
// RedisClusterOptions). Clients built with NewRedis, NewRedisCluster, RedisOptions or
// RedisClusterOptions pass; NewClient calls it. Its errors match ErrRedisOptions and name
// the setting. Other UniversalClient implementations (a *redis.Ring, a user's own) are
// accepted as they are.
func CheckRedis(rdb redis.UniversalClient) error {
	var ctxTimeout bool
	var retries, redirects int
	switch c := rdb.(type) {
	case *redis.Client:
		o := c.Options()
		ctxTimeout, retries = o.ContextTimeoutEnabled, o.MaxRetries
	case *redis.ClusterClient:
		o := c.Options()
		ctxTimeout, retries, redirects = o.ContextTimeoutEnabled, o.MaxRetries, o.MaxRedirects
	default:
		return nil
	}
	switch {
	case !ctxTimeout:
		return fmt.Errorf("%w: ContextTimeoutEnabled is false (calls would outlive their context's deadline); set it, or build the client with onceflow.NewRedis", ErrRedisOptions)
	case retries > 0: // a built client holds its normalised options: 0 or -1 for none
		return fmt.Errorf("%w: MaxRetries: the client re-sends commands %d times on its own (go-redis's default, 0, means 3); set MaxRetries to -1, or build the client with onceflow.NewRedis", ErrRedisOptions, retries)
	case redirects > 0: // normalised too: 0 for -1, 3 for go-redis's default
		return fmt.Errorf("%w: MaxRedirects: the cluster client re-sends commands after network errors up to %d times on its own (go-redis's default, 0, means 3); set MaxRedirects to -1, or build the client with onceflow.NewRedisCluster", ErrRedisOptions, redirects)
	}
	return nil
}

// redisUnreachable reports whether err says that Redis is unreachable or cannot take
// writes for now, rather than that a command or its arguments failed: a connection
// that could not be made or broke (a net.Error: refused, reset, a dial or read timeout;
// io.EOF and io.ErrUnexpectedEOF: the server closed it), no pooled connection to be had
// in time (redis.ErrPoolTimeout, redis.ErrPoolExhausted), or a server reply that names
// the server's state, as go-redis's helpers recognise it (LOADING, READONLY, MASTERDOWN,
// CLUSTERDOWN, TRYAGAIN, OOM, NOREPLICAS, max number of clients reached). The end of the caller's context is not
// an outage (a shutdown, a budget), unless it ended a dial; neither is a client closed
// by the program (redis.ErrClosed), nor a reply about the command (a script's error,
// WRONGTYPE, NOSCRIPT, MOVED).
func redisUnreachable(err error) bool {
	if err == nil || errors.Is(err, redis.ErrClosed) {
		return false
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Op == "dial" {
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) {
		return true
	}
	return redis.IsLoadingError(err) || redis.IsReadOnlyError(err) || redis.IsMasterDownError(err) ||
		redis.IsClusterDownError(err) || redis.IsTryAgainError(err) || redis.IsMaxClientsError(err) ||
		redis.IsOOMError(err) || redis.IsNoReplicasError(err)
}
