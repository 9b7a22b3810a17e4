package onceflow

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/retry"
)

// Connections to Redis and PostgreSQL: the options onceflow's guarantees hold under,
// the clients built from URLs, the health checks, and the one classifier of each
// store's outages.

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

// PostgresConfig parses a PostgreSQL URL (postgres://user:password@host:port/db?options,
// see pgxpool.ParseConfig) into a pool configuration with onceflow's defaults: at most
// DefaultPostgresMaxConns connections unless pool_max_conns is in the URL, a connect
// timeout of DefaultPostgresConnectTimeout unless connect_timeout is, and the sessions'
// statement_timeout (DefaultPostgresStatementTimeout) and
// idle_in_transaction_session_timeout unless the URL sets them. Errors do not show
// the password. Change the result (a ConnConfig.Tracer, AfterConnect, ...) as you need
// before pgxpool.NewWithConfig.
func PostgresConfig(url string) (*pgxpool.Config, error) { return connect.PostgresConfig(url) }

// NewPostgres returns a pool built from PostgresConfig(url). It connects lazily, so a
// program can start while PostgreSQL is down; ctx bounds nothing after it returns.
func NewPostgres(ctx context.Context, url string) (*pgxpool.Pool, error) {
	return connect.Postgres(ctx, url, nil)
}

// postgresUnreachableCodes are the SQLSTATEs (besides class 08, connection exception)
// with which PostgreSQL says it is going away or cannot take the session, not that a
// statement failed.
var postgresUnreachableCodes = map[string]bool{
	"57P01": true, // admin_shutdown: a fast or smart shutdown, pg_terminate_backend
	"57P02": true, // crash_shutdown: another backend crashed, the server restarts
	"57P03": true, // cannot_connect_now: starting up, shutting down, in recovery
	"53300": true, // too_many_connections: max_connections or a role's limit reached
}

// postgresUnreachable reports whether err says that PostgreSQL is unreachable or going
// away, rather than that a statement failed: a failed connection attempt
// (*pgconn.ConnectError, whatever its cause), a server error of SQLSTATE class 08 or one
// of postgresUnreachableCodes, an error pgx reports as safe to retry (nothing was sent:
// the connection was closed or broken before the write), a net.Error (a reset, a
// refused connection, a read timeout without a context deadline), or io.EOF and
// io.ErrUnexpectedEOF (the server closed the connection mid-exchange). Any other server
// error (a constraint, a syntax error, a serialization failure) is the statement's,
// and so is the end of the caller's context (context.Canceled, context.DeadlineExceeded:
// a shutdown, the job's budget), unless it ended a connection attempt.
//
// It is the one classifier of PostgreSQL outages for the database calls a job makes
// through onceflow (Job.Commit, Job.CommitTx, the ledger of Job.Complete and Job.Stream).
func postgresUnreachable(err error) bool {
	if err == nil {
		return false
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "08") || postgresUnreachableCodes[pgErr.Code]
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// PostgresError returns err marked Unavailable (errors.Is ErrUnavailable) when it says
// PostgreSQL is unreachable or going away, rather than that a statement failed: a failed
// connection attempt, a lost or closed connection, a server shutting down, starting up
// or out of connections. Any other error, nil, and an error already marked Unavailable
// or Permanent are returned as they are. A Worker that reads or writes its own tables
// through Client.DB returns its errors through it, as Commit, CommitTx and the model
// ledger do, so that a database outage hands the job back without spending a delivery
// while a failing statement still does.
func PostgresError(err error) error {
	if err == nil || retry.IsPermanent(err) || errors.Is(err, ErrUnavailable) || !postgresUnreachable(err) {
		return err
	}
	return Unavailable(err)
}

// PingRedis checks that rdb answers: PING to the one Redis of a *redis.Client (the
// primary, for a Sentinel-managed one), or to every primary of a *redis.ClusterClient.
// Its error names each node that did not answer, and matches ErrSomeRedisNodesDown when
// others did. For readiness checks: `onceflow serve` reports such a cluster as degraded
// in /readyz (200, the nodes named), and down only when no primary answers; the
// workers' Redis breaker likewise opens only when none does.
func PingRedis(ctx context.Context, rdb redis.UniversalClient) error {
	_, err := pingNodes(ctx, rdb)
	return err
}

// pingNodes pings rdb's primaries and returns each one's address and whether it
// answered (nil for a client that is not a cluster's), and an error naming those that
// did not.
func pingNodes(ctx context.Context, rdb redis.UniversalClient) (map[string]bool, error) {
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return nil, rdb.Ping(ctx).Err()
	}
	var mu sync.Mutex
	up := map[string]bool{}
	var failed []string
	err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		addr := node.Options().Addr
		err := node.Ping(ctx).Err()
		mu.Lock()
		defer mu.Unlock()
		up[addr] = err == nil
		if err != nil {
			failed = append(failed, fmt.Sprintf("node %s: %v", addr, err))
		}
		return nil
	})
	if err != nil {
		// The slot map could not be loaded: no node answered.
		return up, fmt.Errorf("redis cluster: %w", err)
	}
	if len(failed) == 0 {
		return up, nil
	}
	slices.Sort(failed)
	err = errors.New("redis cluster: " + strings.Join(failed, "; "))
	if len(failed) < len(up) {
		err = fmt.Errorf("%w: %w", ErrSomeRedisNodesDown, err)
	}
	return up, err
}

// nodeGauge is onceflow_redis_node_up: 1 for each primary of a Redis Cluster that
// answered the last health check, 0 for one that did not.
type nodeGauge struct {
	g    *prometheus.GaugeVec
	mu   sync.Mutex
	seen map[string]bool
}

func newNodeGauge(reg prometheus.Registerer) *nodeGauge {
	if reg == nil {
		return nil
	}
	return &nodeGauge{seen: map[string]bool{}, g: metrics.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "redis", Name: "node_up",
		Help: "Whether each primary of the Redis Cluster answered the last health check (1) or not (0); a node no longer among the primaries is dropped.",
	}, []string{"node"}))}
}

// set records the last check's answers; nodes that are no longer primaries are dropped.
func (n *nodeGauge) set(up map[string]bool) {
	if n == nil || up == nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for addr := range n.seen {
		if _, ok := up[addr]; !ok {
			n.g.DeleteLabelValues(addr)
			delete(n.seen, addr)
		}
	}
	for addr, ok := range up {
		v := 0.0
		if ok {
			v = 1
		}
		n.g.WithLabelValues(addr).Set(v)
		n.seen[addr] = true
	}
}
