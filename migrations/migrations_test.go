package migrations_test

import (
	"context"
	"sync"
	"testing"

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

// The guarantees of seed 000 rest on these constraints; check them on the real schema.
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
