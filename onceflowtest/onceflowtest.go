// Package onceflowtest is onceflow's test kit, as River's rivertest is River's: real
// Redis and real PostgreSQL isolated per test, a Client built and run for a test, a
// webhook sink and a fake model in-process, real processes to kill, and counts of the
// effects a test asserts (outbox rows by topic, deliveries received, model calls), so
// that a crash test of a user's workflow is a few lines.
//
// Redis and PostgreSQL are the servers named by ONCEFLOW_REDIS_URL and
// ONCEFLOW_DATABASE_URL (in this repository `make test` starts them with
// scripts/dev-services and exports both). Each test gets its own Redis key prefix and
// its own PostgreSQL schema, removed at cleanup, so tests run in parallel against the
// same servers. When a variable is unset the test fails rather than skips: a suite
// that silently skips its real-service tests proves nothing. No mock of either stands
// in: the guarantees under test are the servers' (Lua scripts, transactions).
//
// Every function takes the test's testing.TB, fails the test on error and registers
// its cleanup with t.Cleanup.
package onceflowtest

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/migrations"
)

// RedisURL returns ONCEFLOW_REDIS_URL, the test Redis, for a subprocess (give it the
// prefix of Redis(t) too), or fails the test.
func RedisURL(t testing.TB) string {
	t.Helper()
	return testenv.RedisURL(t)
}

// Redis returns a client of the test Redis (ONCEFLOW_REDIS_URL, with onceflow's client
// settings, see onceflow.RedisOptions) and a key prefix of this test's own, for
// onceflow.Config.Prefix. At cleanup every key under the prefix is deleted and the
// client closed.
func Redis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	return testenv.Redis(t)
}

// Postgres creates a schema of this test's own on the test PostgreSQL
// (ONCEFLOW_DATABASE_URL), applies onceflow's migrations and then extra (a program's
// own tables, as migrations.Up does), and returns a pool whose search_path selects the
// schema, with a URL that does the same (for a subprocess). The schema is dropped at
// cleanup.
func Postgres(t testing.TB, extra ...migrations.Source) (*pgxpool.Pool, string) {
	t.Helper()
	return testenv.Postgres(t, extra...)
}

// Logger returns a logger that writes through t.Log: a test's log lines show only when
// it fails (or with -v).
func Logger(t testing.TB) *slog.Logger {
	t.Helper()
	return testenv.Logger(t)
}

// WaitFor polls cond every 10ms until it holds, failing the test with what after
// timeout. Wait for effects this way rather than sleeping.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	testenv.WaitFor(t, timeout, what, cond)
}

// Env is a test's Client with the stores it runs on.
type Env struct {
	// Client is the client New built.
	Client *onceflow.Client
	// Redis and Prefix are the client's Redis and key prefix.
	Redis  redis.UniversalClient
	Prefix string
	// DB is the client's PostgreSQL pool, and DatabaseURL its URL when New created the
	// schema ("" when cfg.DB was given).
	DB          *pgxpool.Pool
	DatabaseURL string

	t testing.TB
}

// New builds a Client for a test from cfg, filling what cfg leaves unset: Redis and
// Prefix from Redis(t), DB from Postgres(t) with the migrations of cfg.Workflows, and
// Logger from Logger(t). The Client does not run until Start.
func New(t testing.TB, cfg onceflow.Config) *Env {
	t.Helper()
	e := &Env{t: t}
	if cfg.Redis == nil {
		cfg.Redis, cfg.Prefix = Redis(t)
	}
	if cfg.DB == nil {
		var extra []migrations.Source
		for _, w := range cfg.Workflows {
			if w.Migrations != nil {
				extra = append(extra, *w.Migrations)
			}
		}
		cfg.DB, e.DatabaseURL = Postgres(t, extra...)
	}
	if cfg.Logger == nil {
		cfg.Logger = Logger(t)
	}
	c, err := onceflow.NewClient(cfg)
	if err != nil {
		t.Fatalf("onceflow.NewClient: %v", err)
	}
	e.Client, e.Redis, e.Prefix, e.DB = c, cfg.Redis, cfg.Prefix, cfg.DB
	return e
}

// Start runs the Client (its queues' workers and its outbox relay) until the test
// ends; then it stops it and waits for Run to return. It returns a func that does the
// same at once, for a test that stops the Client midway (a second call is a no-op).
func (e *Env) Start() (stop func()) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Client.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			e.t.Errorf("onceflow.Client.Run: %v", err)
		}
	}
	e.t.Cleanup(stop)
	return stop
}

// OutboxRows counts the test database's outbox rows of topic (see OutboxRows).
func (e *Env) OutboxRows(topic string) int {
	e.t.Helper()
	return OutboxRows(e.t, e.DB, topic)
}

// Count runs a counting query on the test database (see Count).
func (e *Env) Count(sql string, args ...any) int {
	e.t.Helper()
	return Count(e.t, e.DB, sql, args...)
}
