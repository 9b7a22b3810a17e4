// Package migrations holds onceflow's PostgreSQL schema as embedded SQL files and applies
// them with goose. It is what `onceflow migrate` runs, and what tests run on their own
// schemas.
//
// Migrating is safe to run twice and concurrently: every run holds a PostgreSQL
// session-level advisory lock for the schema the connection's search_path selects, so
// concurrent runs against one schema apply each migration once, while runs against
// different schemas (parallel tests) do not wait for each other.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed *.sql
var files embed.FS

// VersionTable records which migrations were applied, in the connection's schema.
const VersionTable = "onceflow_migrations"

// Up applies every pending migration to the database at databaseURL and returns the
// schema version it leaves. A nil logger means slog.Default().
func Up(ctx context.Context, databaseURL string, logger *slog.Logger) (int64, error) {
	if logger == nil {
		logger = slog.Default()
	}
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return 0, fmt.Errorf("parse database url: %w", err)
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithSessionLocker(schemaLocker{}),
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return 0, fmt.Errorf("load migrations: %w", err)
	}
	results, err := p.Up(ctx)
	if err != nil {
		return 0, fmt.Errorf("apply migrations: %w", err)
	}
	for _, r := range results {
		logger.InfoContext(ctx, "migration applied", "version", r.Source.Version,
			"file", r.Source.Path, "duration", r.Duration)
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	return v, nil
}

// schemaLocker is a goose session locker that waits on pg_advisory_lock (no polling)
// with a key derived from the current schema.
type schemaLocker struct{}

var _ lock.SessionLocker = schemaLocker{}

// lockKey is the advisory lock key of the connection's current schema.
const lockKey = `hashtextextended('onceflow.migrate:' || coalesce(current_schema(), ''), 0)`

func (schemaLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock(`+lockKey+`)`); err != nil {
		return fmt.Errorf("take migration lock: %w", err)
	}
	return nil
}

func (schemaLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_unlock(`+lockKey+`)`); err != nil {
		return fmt.Errorf("release migration lock: %w", err)
	}
	return nil
}
