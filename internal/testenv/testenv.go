// Package testenv gives tests real Redis and PostgreSQL, isolated per test.
//
// Redis and Postgres use the shared servers named by ONCEFLOW_REDIS_URL and
// ONCEFLOW_DATABASE_URL (`make test` starts them with scripts/dev-services and exports
// both). Each test gets its own Redis key prefix, whose keys are deleted in t.Cleanup,
// and a PostgreSQL schema of its own while it runs: one of a pool of schemas migrated
// once and emptied between tests (schemapool.go), so packages and parallel tests share
// the servers without migrating a schema per test.
// When a variable is unset the test fails, telling the reader to run `make test`: a
// suite that silently skips its real-service tests proves nothing.
//
// Tests that stop or kill a server use PrivateRedis or PrivatePostgres, which start a
// server of their own on a free port.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/migrations"
)

// RedisURL returns ONCEFLOW_REDIS_URL or fails the test.
func RedisURL(t testing.TB) string {
	t.Helper()
	return mustGetenv(t, "ONCEFLOW_REDIS_URL")
}

// testConnectTimeout is the connect_timeout (seconds) DatabaseURL gives the shared test
// PostgreSQL when ONCEFLOW_DATABASE_URL sets none: make test runs some sixty test
// processes on two cores, and there a connection's handshake has taken longer than
// the product's 3 s default, which no test of the shared server is about (tests of
// connect timeouts use a private server, PrivatePostgres).
const testConnectTimeout = "10"

// DatabaseURL returns ONCEFLOW_DATABASE_URL, with connect_timeout=10 unless it sets one,
// or fails the test.
func DatabaseURL(t testing.TB) string {
	t.Helper()
	dsn := mustGetenv(t, "ONCEFLOW_DATABASE_URL")
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return dsn // a keyword/value string, or not a URL: as given
	}
	q := u.Query()
	if q.Get("connect_timeout") == "" {
		q.Set("connect_timeout", testConnectTimeout)
		u.RawQuery = q.Encode()
	}
	return u.String()
}

func mustGetenv(t testing.TB, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		t.Fatalf("%s is not set: point it at the test server (in onceflow's repository, run the tests with `make test`, which starts Redis and PostgreSQL with scripts/dev-services and exports it)", name)
	}
	return v
}

// Prefix returns a Redis key prefix unique to this test run (no colon, no braces).
func Prefix(t testing.TB) string {
	t.Helper()
	return "oft" + randomHex(6)
}

// Redis returns a client of the shared test Redis and a key prefix of this test's own.
// At cleanup every key under the prefix is deleted and the client closed.
func Redis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	c, err := connect.Redis(RedisURL(t))
	if err != nil {
		t.Fatalf("redis: %v", err)
	}
	prefix := Prefix(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		DeleteKeys(ctx, c, prefix)
		_ = c.Close()
	})
	return c, prefix
}

// QueueRedis is Redis for the suites that run on a single node and on a Redis Cluster
// alike: with ONCEFLOW_TEST_REDIS_CLUSTER set (comma-separated seed addresses, as
// `make test-cluster` sets it), a cluster client of that cluster, else Redis(t). Keys
// under the prefix are deleted from every primary at cleanup.
func QueueRedis(t testing.TB) (redis.UniversalClient, string) {
	t.Helper()
	seeds := os.Getenv("ONCEFLOW_TEST_REDIS_CLUSTER")
	if seeds == "" {
		return Redis(t)
	}
	c, err := connect.RedisCluster(ClusterURL(seeds))
	if err != nil {
		t.Fatalf("redis cluster: %v", err)
	}
	prefix := Prefix(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
			DeleteKeys(ctx, node, prefix)
			return nil
		})
		_ = c.Close()
	})
	return c, prefix
}

// ClusterURL returns the URL of a Redis Cluster (onceflow.RedisClusterOptions) of the
// comma-separated seed addresses seeds.
func ClusterURL(seeds string) string {
	addrs := strings.Split(seeds, ",")
	u := "redis://" + addrs[0]
	if len(addrs) > 1 {
		u += "?addr=" + strings.Join(addrs[1:], "&addr=")
	}
	return u
}

// DeleteKeys removes every key that starts with prefix and a colon.
func DeleteKeys(ctx context.Context, c *redis.Client, prefix string) {
	iter := c.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 500 {
			c.Unlink(ctx, batch...)
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		c.Unlink(ctx, batch...)
	}
}

// Postgres gives the test a schema of its own on the shared test PostgreSQL with
// onceflow's migrations applied (then extra, a program's own, as migrations.Up does), and
// returns a pool whose search_path selects it, with the URL that does the same (for
// subprocesses and code that opens its own connections). Without extra the schema comes
// from the schema pool (schemapool.go): migrated once, emptied between tests; with extra
// it is a fresh schema, migrated, and dropped at cleanup.
func Postgres(t testing.TB, extra ...migrations.Source) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var dsn string
	if len(extra) == 0 {
		dsn = WithSearchPath(t, DatabaseURL(t), pooledSchema(t, DatabaseURL(t)))
	} else {
		dsn = EmptySchema(t)
		if _, err := migrations.Up(ctx, dsn, discardLogger(), extra...); err != nil {
			t.Fatalf("migrate: %v", err)
		}
	}
	pool, err := connect.Postgres(ctx, dsn, nil)
	if err != nil {
		t.Fatalf("postgres pool: %v", err)
	}
	t.Cleanup(pool.Close) // runs before the schema is handed back (cleanups run last-in first-out)
	return pool, dsn
}

// EmptySchema creates an empty schema of this test's own on the shared test PostgreSQL
// and returns a URL whose search_path selects it. The schema is dropped at cleanup.
func EmptySchema(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	base := DatabaseURL(t)
	schema := "t_" + randomHex(6)
	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatalf("postgres: %v", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	return WithSearchPath(t, base, schema)
}

// WithSearchPath returns dsn with its search_path set to schema.
func WithSearchPath(t testing.TB, dsn, schema string) string {
	t.Helper()
	u, err := withSearchPath(dsn, schema)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func withSearchPath(dsn, schema string) (string, error) {
	u, err := url.Parse(dsn)
	if err != nil {
		return "", fmt.Errorf("parse database url: %w", err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return strings.ToLower(hex.EncodeToString(b))
}

// Long skips t under -short: a test of the long profile, which `make test-long` runs
// (Makefile: LONG_TESTS) and `make test` (go test -short) leaves out, to keep within its
// budget (docs/development.md). A plain `go test` runs it.
func Long(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("a long test: make test-long runs it (go test without -short)")
	}
}
