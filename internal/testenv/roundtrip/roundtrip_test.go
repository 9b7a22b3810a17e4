package roundtrip_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

func TestCountsRedisRoundTrips(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var c roundtrip.Counter
	rdb.AddHook(&c)
	ctx := context.Background()
	rdb.Set(ctx, prefix+":a", 1, 0)
	rdb.Get(ctx, prefix+":a")
	if got := c.Redis(); got != 2 {
		t.Fatalf("two commands counted as %d", got)
	}
	c.Reset()
	_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.Incr(ctx, prefix+":a")
		p.Incr(ctx, prefix+":a")
		p.Get(ctx, prefix+":a")
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Redis(); got != 1 {
		t.Fatalf("one pipeline counted as %d", got)
	}
	c.Reset()
	if _, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Incr(ctx, prefix+":a")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if got := c.Redis(); got != 1 {
		t.Fatalf("one MULTI/EXEC counted as %d", got)
	}
}

func TestCountsPostgresRoundTrips(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	var c roundtrip.Counter
	ctx := context.Background()
	pool, err := connect.Postgres(ctx, dsn, &c)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil { // connect outside the count
		t.Fatal(err)
	}
	c.Reset()
	insert := func() {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO summaries (job_id, tenant, summary) VALUES (gen_random_uuid(), 't', $1)`, "s")
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	insert()
	// begin + prepare (first use on this connection) + insert + commit
	if got := c.Postgres(); got != 4 {
		t.Fatalf("first transaction counted as %d, want 4", got)
	}
	c.Reset()
	insert()
	if got := c.Postgres(); got != 3 {
		t.Fatalf("second transaction counted as %d, want 3 (statement already prepared)", got)
	}
	c.Reset()
	b := &pgx.Batch{}
	b.Queue(`SELECT 1`)
	b.Queue(`SELECT 2`)
	if err := pool.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	if got := c.Postgres(); got < 1 || got > 3 {
		t.Fatalf("batch counted as %d", got)
	}
}
