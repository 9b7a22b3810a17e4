package onceflow

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
)

// PostgresConfig parses a PostgreSQL URL (postgres://user:password@host:port/db?options,
// see pgxpool.ParseConfig) into a pool configuration with onceflow's defaults: at most
// DefaultPostgresMaxConns connections unless pool_max_conns is in the URL, and a connect
// timeout of DefaultPostgresConnectTimeout unless connect_timeout is. Errors do not show
// the password. Change the result (a ConnConfig.Tracer, AfterConnect, ...) as you need
// before pgxpool.NewWithConfig.
func PostgresConfig(url string) (*pgxpool.Config, error) { return connect.PostgresConfig(url) }

// NewPostgres returns a pool built from PostgresConfig(url). It connects lazily, so a
// program can start while PostgreSQL is down; ctx bounds nothing after it returns.
func NewPostgres(ctx context.Context, url string) (*pgxpool.Pool, error) {
	return connect.Postgres(ctx, url, nil)
}
