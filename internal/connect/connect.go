// Package connect opens onceflow's connections to Redis and PostgreSQL with the settings
// every role shares. It is the only place that decides client-level timeouts and retries.
//
// Its functions are public as the root package's onceflow.RedisOptions, NewRedis,
// RedisClusterOptions, NewRedisCluster, PostgresConfig and NewPostgres, which library
// users and cmd/onceflow call. They live here, in a package that imports nothing of
// onceflow's, because internal/testenv and the tests inside packages the root package
// imports (queue, idempotency, outbox) open their connections with them: importing the
// root package from there would be an import cycle.
package connect

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	neturl "net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Redis client defaults. Each can be overridden in the URL (dial_timeout, read_timeout,
// write_timeout, pool_size, max_retries, ...), which go-redis parses.
const (
	// DefaultRedisDialTimeout bounds connecting, so a stopped Redis fails fast.
	DefaultRedisDialTimeout = 2 * time.Second
	// DefaultRedisIOTimeout bounds one read or write when the context has no deadline.
	DefaultRedisIOTimeout = 3 * time.Second
	// DefaultPostgresConnectTimeout bounds connecting unless connect_timeout is in the URL.
	DefaultPostgresConnectTimeout = 3 * time.Second
	// DefaultPostgresMaxConns is the pool size unless pool_max_conns is in the URL.
	DefaultPostgresMaxConns = 32
	// DefaultPostgresStatementTimeout is the server's statement_timeout unless the URL
	// sets one: no statement holds a job (and its entry) for longer.
	DefaultPostgresStatementTimeout = 30 * time.Second
	// DefaultPostgresIdleInTransactionTimeout is idle_in_transaction_session_timeout
	// unless the URL sets one: a transaction whose client vanished releases its locks.
	DefaultPostgresIdleInTransactionTimeout = time.Minute
)

// Redis returns a go-redis client for url. It does not connect: the first command does,
// so a process can start while Redis is down and report it through /readyz.
//
// Settings chosen on purpose:
//   - ContextTimeoutEnabled: a context deadline bounds socket I/O, so a hung Redis cannot
//     hold a request past its deadline.
//   - MaxRetries -1 unless the URL says otherwise: go-redis would otherwise re-send a
//     command after a network error, and for XADD or a Lua script that may run it twice.
//     onceflow's callers decide what to retry (the worker loop backs off, the API answers
//     503), so one layer owns the policy.
//   - Maintenance notifications off (a Redis 8 feature).
//   - DialerRetries 1: a refused connection is reported after one quick retry rather than
//     five, which keeps /readyz and the 503 path fast while Redis is down.
//
// A URL with a master_name parameter names Sentinels, not a Redis: the client is
// go-redis's failover client (see RedisFailoverOptions), which asks the sentinels for
// the primary and follows it through a failover.
func Redis(url string) (*redis.Client, error) {
	if IsSentinelURL(url) {
		opt, err := RedisFailoverOptions(url)
		if err != nil {
			return nil, err
		}
		return redis.NewFailoverClient(opt), nil
	}
	opt, err := RedisOptions(url)
	if err != nil {
		return nil, err
	}
	return redis.NewClient(opt), nil
}

// IsSentinelURL reports whether url names Sentinels: a redis:// or rediss:// URL with a
// master_name parameter.
func IsSentinelURL(rawURL string) bool {
	u, err := neturl.Parse(rawURL)
	return err == nil && u.Query().Has("master_name")
}

// RedisFailoverOptions parses a Sentinel URL (redis://sentinel1:26379?addr=sentinel2:26379
// &master_name=mymaster, see redis.ParseFailoverURL: the URL's user and password are the
// sentinels', the primary's are the username and password parameters) into go-redis
// failover options with RedisOptions' defaults applied (no retries by go-redis,
// ContextTimeoutEnabled, onceflow's timeouts). A failover breaks the connections to the
// old primary: the commands on them fail, and the callers retry, as after any network
// error; new connections go to the primary the sentinels name.
func RedisFailoverOptions(url string) (*redis.FailoverOptions, error) {
	opt, err := redis.ParseFailoverURL(url)
	if err != nil {
		return nil, fmt.Errorf("parse redis sentinel url: %w", parseError(err, url))
	}
	switch {
	case opt.MasterName == "":
		return nil, errors.New("parse redis sentinel url: master_name is empty")
	case opt.RouteByLatency || opt.RouteRandomly:
		// go-redis's failover client panics on them (they need a cluster client), and
		// reads from replicas would not see the writes the accept just made.
		return nil, errors.New("parse redis sentinel url: route_by_latency and route_randomly are not supported: onceflow reads and writes the primary")
	case opt.ReplicaOnly || opt.UseDisconnectedReplicas:
		// A replica refuses every write (READONLY), while PING answers: a client that
		// looks healthy and can never accept a job.
		return nil, errors.New("parse redis sentinel url: replica_only and use_disconnected_replicas are not supported: onceflow writes to the primary")
	}
	opt.ContextTimeoutEnabled, opt.DialerRetries = true, 1
	defaults(url, &opt.MaxRetries, &opt.DialTimeout, &opt.ReadTimeout, &opt.WriteTimeout)
	verifyEachHost(opt.TLSConfig)
	return opt, nil
}

// verifyEachHost makes a TLS configuration shared by several nodes verify each node's
// certificate against the host it dials: go-redis sets ServerName to the URL's first
// host and dials every node (sentinels, the primary they name, a cluster's nodes) with
// that one configuration; with ServerName empty, crypto/tls takes it from each
// address.
func verifyEachHost(c *tls.Config) {
	if c != nil {
		c.ServerName = ""
	}
}

// RedisOptions parses url into go-redis options with onceflow's defaults applied.
func RedisOptions(url string) (*redis.Options, error) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("parse redis url: %w", parseError(err, url))
	}
	opt.ContextTimeoutEnabled, opt.DialerRetries = true, 1
	defaults(url, &opt.MaxRetries, &opt.DialTimeout, &opt.ReadTimeout, &opt.WriteTimeout)
	opt.MaintNotificationsConfig = noMaintNotifications()
	return opt, nil
}

// defaults sets the settings RedisOptions and RedisClusterOptions share that url does
// not set: no go-redis retries, and onceflow's dial and I/O timeouts.
func defaults(url string, maxRetries *int, dial, read, write *time.Duration) {
	if !strings.Contains(url, "max_retries=") {
		*maxRetries = -1
	}
	if !strings.Contains(url, "dial_timeout=") {
		*dial = DefaultRedisDialTimeout
	}
	if !strings.Contains(url, "read_timeout=") {
		*read = DefaultRedisIOTimeout
	}
	if !strings.Contains(url, "write_timeout=") {
		*write = DefaultRedisIOTimeout
	}
}

// parseError is err (a URL's parse error) without the URL, which may hold a password:
// net/url quotes it, escaped, so it cannot be cut out reliably; its reason is kept.
func parseError(err error, rawURL string) error {
	var ue *neturl.Error
	if errors.As(err, &ue) {
		return errors.New(ue.Err.Error())
	}
	msg := strings.ReplaceAll(err.Error(), rawURL, "...")
	if u, perr := neturl.Parse(rawURL); perr == nil {
		if p, ok := u.User.Password(); ok && p != "" {
			msg = strings.ReplaceAll(msg, p, "[redacted]")
		}
		for k, vs := range u.Query() {
			if strings.Contains(strings.ToLower(k), "pass") {
				for _, v := range vs {
					if v != "" {
						msg = strings.ReplaceAll(msg, v, "[redacted]")
					}
				}
			}
		}
	}
	return errors.New(msg)
}

// noMaintNotifications turns maintenance notifications off: they are a Redis 8 / Redis
// Cloud feature, and on Redis 7 the handshake command only fails and costs a round trip
// per connection.
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}

// RedisClusterOptions parses a Redis Cluster URL (redis://host:port?addr=host2:port2,
// see redis.ParseClusterURL) into go-redis cluster options with RedisOptions' defaults
// applied, and one more: MaxRedirects -1 unless the URL says otherwise. A
// *redis.ClusterClient runs every command in one loop of up to MaxRedirects extra
// attempts (default 3), used both to follow MOVED and ASK redirects and to re-send a
// command after a network error, which for XADD or a script may run it twice. With
// -1 a redirect during resharding or failover is the caller's error to retry, like a
// network error (the cluster state is reloaded meanwhile).
func RedisClusterOptions(url string) (*redis.ClusterOptions, error) {
	opt, err := redis.ParseClusterURL(url)
	if err != nil {
		return nil, fmt.Errorf("parse redis cluster url: %w", parseError(err, url))
	}
	opt.ContextTimeoutEnabled, opt.DialerRetries = true, 1
	defaults(url, &opt.MaxRetries, &opt.DialTimeout, &opt.ReadTimeout, &opt.WriteTimeout)
	if !strings.Contains(url, "max_redirects=") {
		opt.MaxRedirects = -1
	}
	verifyEachHost(opt.TLSConfig)
	opt.MaintNotificationsConfig = noMaintNotifications()
	return opt, nil
}

// RedisCluster returns a go-redis cluster client for url (see RedisClusterOptions).
// Like Redis, it does not connect.
func RedisCluster(url string) (*redis.ClusterClient, error) {
	opt, err := RedisClusterOptions(url)
	if err != nil {
		return nil, err
	}
	return redis.NewClusterClient(opt), nil
}

// PostgresConfig parses url into a pgx pool configuration with onceflow's defaults: at
// most DefaultPostgresMaxConns connections unless pool_max_conns is in the URL, a
// connect timeout of DefaultPostgresConnectTimeout unless connect_timeout is, and the
// session settings statement_timeout and idle_in_transaction_session_timeout
// (DefaultPostgresStatementTimeout, DefaultPostgresIdleInTransactionTimeout) unless the
// URL names them (as a parameter or in options).
func PostgresConfig(url string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err) // pgconn redacts the password
	}
	if !strings.Contains(url, "pool_max_conns") {
		cfg.MaxConns = DefaultPostgresMaxConns
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = DefaultPostgresConnectTimeout
	}
	for name, d := range map[string]time.Duration{
		"statement_timeout":                   DefaultPostgresStatementTimeout,
		"idle_in_transaction_session_timeout": DefaultPostgresIdleInTransactionTimeout,
	} {
		if _, ok := cfg.ConnConfig.RuntimeParams[name]; !ok && !strings.Contains(url, name) {
			cfg.ConnConfig.RuntimeParams[name] = strconv.FormatInt(d.Milliseconds(), 10)
		}
	}
	return cfg, nil
}

// Postgres returns a pgx pool for url (see PostgresConfig). Like Redis it connects
// lazily, so a process can start while PostgreSQL is down. Tracer, when not nil,
// observes every query (see internal/testenv/roundtrip).
func Postgres(ctx context.Context, url string, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	cfg, err := PostgresConfig(url)
	if err != nil {
		return nil, err
	}
	if tracer != nil {
		cfg.ConnConfig.Tracer = tracer
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open postgres pool: %w", err)
	}
	return pool, nil
}
