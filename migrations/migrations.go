// Package migrations holds onceflow's PostgreSQL schema as embedded SQL files and applies
// them with goose. It is what `onceflow migrate` runs, and what tests run on their own
// schemas. A program's own migrations (the tables of its workflows) run beside
// onceflow's in the same call: pass them to Up as a Source, with a version table of
// their own.
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
	"io/fs"
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

// Source is a set of migrations of the user's own (the tables of their workflows) that
// Up applies after onceflow's, with a version table of its own, so its version numbers
// are independent of onceflow's.
type Source struct {
	// FS holds the goose SQL files (NNNNN_name.sql, each with -- +goose Up and
	// -- +goose Down sections), typically an embed.FS. Required.
	FS fs.FS
	// Dir is the directory of FS that holds them. Default: "." (FS's root).
	Dir string
	// Table is the version table that records which of them were applied, in the
	// connection's schema: 1 to 63 characters of a-z 0-9 _, starting with a letter or
	// "_", not VersionTable and not another Source's. Required.
	Table string
}

// Up applies every pending migration to the database at databaseURL, onceflow's first
// and then each of extra in order (each recorded in its own version table), and returns
// the version of onceflow's schema it leaves. It holds the schema's migration lock (see
// the package doc) while it applies each set. A nil logger means slog.Default(). Its
// errors name the set that failed; the sets before it stay applied.
func Up(ctx context.Context, databaseURL string, logger *slog.Logger, extra ...Source) (int64, error) {
	if logger == nil {
		logger = slog.Default()
	}
	tables := map[string]bool{VersionTable: true}
	for i, src := range extra {
		switch {
		case src.FS == nil:
			return 0, fmt.Errorf("migration source %d: FS is required", i)
		case !validTable(src.Table):
			return 0, fmt.Errorf("migration source %d: Table %q is not 1-63 characters of a-z 0-9 _ starting with a letter or _", i, src.Table)
		case tables[src.Table]:
			return 0, fmt.Errorf("migration source %d: Table %q is already used by another set of migrations", i, src.Table)
		}
		tables[src.Table] = true
	}
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return 0, fmt.Errorf("parse database url: %w", err)
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	v, err := up(ctx, db, files, VersionTable, logger)
	if err != nil {
		return 0, err
	}
	for _, src := range extra {
		fsys := src.FS
		if src.Dir != "" && src.Dir != "." {
			if fsys, err = fs.Sub(src.FS, src.Dir); err != nil {
				return v, fmt.Errorf("migrations of %s: %w", src.Table, err)
			}
		}
		if _, err := up(ctx, db, fsys, src.Table, logger); err != nil {
			return v, fmt.Errorf("migrations of %s: %w", src.Table, err)
		}
	}
	return v, nil
}

// up applies the pending migrations of fsys, recorded in table, and returns the
// version it leaves.
func up(ctx context.Context, db *sql.DB, fsys fs.FS, table string, logger *slog.Logger) (int64, error) {
	p, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
		goose.WithSessionLocker(schemaLocker{}),
		goose.WithTableName(table),
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
		logger.InfoContext(ctx, "migration applied", "table", table, "version", r.Source.Version,
			"file", r.Source.Path, "duration", r.Duration)
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	return v, nil
}

// validTable reports whether name can be a version table: 1 to 63 characters of a-z 0-9
// _, starting with a letter or "_" (an identifier PostgreSQL needs no quotes for).
func validTable(name string) bool {
	if len(name) == 0 || len(name) > 63 {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c == '_' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
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
