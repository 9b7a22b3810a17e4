package migrations_test

import (
	"context"
	"embed"
	"os"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/migrations"
)

func TestUpIsIdempotentAndCreatesTheContractTables(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t) // already migrated once
	ctx := context.Background()
	v, err := migrations.Up(ctx, dsn, nil)
	if err != nil {
		t.Fatalf("second Up: %v", err)
	}
	if v < 1 {
		t.Fatalf("version = %d", v)
	}
	for _, table := range []string{"summaries", "outbox", "llm_calls"} {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables
			WHERE table_schema = current_schema() AND table_name = $1`, table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Errorf("table %s: %d", table, n)
		}
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+migrations.VersionTable+` WHERE version_id > 0`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if int64(applied) != v {
		t.Errorf("%d migrations recorded, want %d: the second Up re-applied some", applied, v)
	}
}

// The guarantees of docs/RELIABILITY.md rest on these constraints; check them on the real schema.
func TestConstraintsTheSeedsRelyOn(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	job := "6f1c1c0e-8e9b-5d4e-9a51-0d3b2c1a0f00"
	ins := `INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 't', 's') ON CONFLICT (job_id) DO NOTHING RETURNING job_id`
	var got string
	if err := pool.QueryRow(ctx, ins, job).Scan(&got); err != nil {
		t.Fatalf("first insert: %v", err)
	}
	if err := pool.QueryRow(ctx, ins, job).Scan(&got); err != pgx.ErrNoRows {
		t.Fatalf("second insert of one job_id: err = %v, want no rows (the primary key keeps one)", err)
	}
	out := `INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('email.summary_ready', 'summary_ready:x', '{}')`
	if _, err := pool.Exec(ctx, out); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, out); err == nil {
		t.Fatal("a second outbox row with the same dedupe_key was accepted")
	}
	if _, err := pool.Exec(ctx, `INSERT INTO llm_calls (idem_key, state, request_hash, expires_at) VALUES ('k', 'bogus', 'h', now())`); err == nil {
		t.Fatal("llm_calls accepted state 'bogus'")
	}
}

func TestConcurrentUpAppliesOnce(t *testing.T) {
	t.Parallel()
	target := testenv.EmptySchema(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { _, errs[i] = migrations.Up(ctx, target, nil) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	conn, err := pgx.Connect(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var tables, versions int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables
		WHERE table_schema = current_schema() AND table_name = 'summaries'`).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+migrations.VersionTable+` WHERE version_id = 1`).Scan(&versions); err != nil {
		t.Fatal(err)
	}
	if tables != 1 || versions != 1 {
		t.Fatalf("summaries tables = %d, version 1 recorded %d times; want 1 and 1", tables, versions)
	}
}

//go:embed testdata/app/*.sql
var appMigrations embed.FS

// A program's own migrations run after onceflow's in one call, recorded in their own
// version table (so both start at version 1); a second call applies nothing, and a
// migration added later is applied by the next.
func TestUpRunsTheUsersMigrationsBesideOnceflows(t *testing.T) {
	t.Parallel()
	target := testenv.EmptySchema(t)
	ctx := context.Background()
	app := migrations.Source{FS: appMigrations, Dir: "testdata/app", Table: "app_migrations"}
	v, err := migrations.Up(ctx, target, nil, app)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	applied := func(table string) (n int) {
		t.Helper()
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE version_id > 0`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if int64(applied(migrations.VersionTable)) != v || applied("app_migrations") != 1 {
		t.Fatalf("onceflow %d of %d, app %d of 1", applied(migrations.VersionTable), v, applied("app_migrations"))
	}
	if _, err := conn.Exec(ctx, `INSERT INTO job_completions (job_id, kind) VALUES ('j1', 'refund');
		INSERT INTO refunds VALUES ('j1', 'order-9', 1250)`); err != nil {
		t.Fatalf("the user's table: %v", err)
	}

	later := fstest.MapFS{
		"00001_refunds.sql": &fstest.MapFile{Data: mustRead(t, "testdata/app/00001_refunds.sql")},
		"00002_reason.sql":  &fstest.MapFile{Data: []byte("-- +goose Up\nALTER TABLE refunds ADD COLUMN reason text;\n-- +goose Down\nALTER TABLE refunds DROP COLUMN reason;\n")},
	}
	if _, err := migrations.Up(ctx, target, nil, migrations.Source{FS: later, Table: "app_migrations"}); err != nil {
		t.Fatal(err)
	}
	if applied("app_migrations") != 2 || int64(applied(migrations.VersionTable)) != v {
		t.Fatalf("after the second call: app %d, onceflow %d", applied("app_migrations"), applied(migrations.VersionTable))
	}
	if _, err := conn.Exec(ctx, `UPDATE refunds SET reason = 'late'`); err != nil {
		t.Fatalf("the later migration: %v", err)
	}
}

func TestUpRefusesAmbiguousSources(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, srcs := range map[string][]migrations.Source{
		"no FS":               {{Table: "app_migrations"}},
		"no table":            {{FS: appMigrations}},
		"onceflow's table":    {{FS: appMigrations, Table: migrations.VersionTable}},
		"quoted table":        {{FS: appMigrations, Table: `app"; DROP TABLE x; --`}},
		"one table, two sets": {{FS: appMigrations, Table: "a_migrations"}, {FS: appMigrations, Table: "a_migrations"}},
	} {
		// Refused before connecting: the URL is never used.
		if _, err := migrations.Up(ctx, "postgres://nobody@127.0.0.1:1/none", nil, srcs...); err == nil || strings.Contains(err.Error(), "connect") {
			t.Errorf("%s: %v, want a refusal naming the source", name, err)
		}
	}
}

func mustRead(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
