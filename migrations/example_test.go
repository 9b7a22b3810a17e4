package migrations_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/migrations"
)

// Your workflow's tables migrate with onceflow's in one call: embed your goose files
// (here testdata/app/00001_refunds.sql) and give them a version table of their own.
//
//	//go:embed migrations/*.sql
//	var appMigrations embed.FS
func ExampleUp_withYourOwnMigrations() {
	ctx := context.Background()
	dsn, drop := scratchSchema(ctx) // a database URL of its own: os.Getenv("DATABASE_URL") in your program
	defer drop()

	_, err := migrations.Up(ctx, dsn, nil, migrations.Source{
		FS: appMigrations, Dir: "testdata/app", Table: "app_migrations",
	})
	if err != nil {
		panic(err)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	rows, _ := conn.Query(ctx, `SELECT table_name FROM information_schema.tables
		WHERE table_schema = current_schema() AND table_name IN ('job_completions', 'outbox', 'refunds') ORDER BY 1`)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	fmt.Println(tables, err)
	// Output: [job_completions outbox refunds] <nil>
}

// scratchSchema creates an empty schema on the test PostgreSQL and returns a URL that
// selects it, and a func that drops it.
func scratchSchema(ctx context.Context) (string, func()) {
	base := os.Getenv("ONCEFLOW_DATABASE_URL")
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "ex_" + hex.EncodeToString(b)
	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		panic(err)
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		panic(err)
	}
	u, err := url.Parse(base)
	if err != nil {
		panic(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), func() {
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		_ = admin.Close(ctx)
	}
}
