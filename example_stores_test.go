package onceflow_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/url"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/migrations"
)

// exampleStores gives a runnable example the test Redis (ONCEFLOW_REDIS_URL) with a key
// prefix of its own, and a pool on a PostgreSQL schema of its own (ONCEFLOW_DATABASE_URL)
// migrated by onceflow's migrations and extra's, with the user's tables created by ddl;
// done removes both. The examples' logs are not part of their output: it discards
// slog's default.
func exampleStores(ddl string, extra ...migrations.Source) (rdb *redis.Client, prefix string, db *pgxpool.Pool, done func()) {
	slog.SetDefault(slog.New(slog.DiscardHandler))
	ctx := context.Background()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "ex" + hex.EncodeToString(b)
	rdb, err := connect.Redis(os.Getenv("ONCEFLOW_REDIS_URL"))
	must(err)
	base := os.Getenv("ONCEFLOW_DATABASE_URL")
	admin, err := pgx.Connect(ctx, base)
	must(err)
	_, err = admin.Exec(ctx, "CREATE SCHEMA "+name)
	must(err)
	u, err := url.Parse(base)
	must(err)
	q := u.Query()
	q.Set("search_path", name)
	u.RawQuery = q.Encode()
	_, err = migrations.Up(ctx, u.String(), nil, extra...)
	must(err)
	db, err = connect.Postgres(ctx, u.String(), nil)
	must(err)
	_, err = db.Exec(ctx, ddl)
	must(err)
	return rdb, name, db, func() {
		db.Close()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+name+" CASCADE")
		_ = admin.Close(ctx)
		iter := rdb.Scan(ctx, 0, name+":*", 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Unlink(ctx, iter.Val())
		}
		_ = rdb.Close()
	}
}

// waitDone waits until job id of tenant is done, and returns its state.
func waitDone(c *onceflow.Client, tenant, id string) *onceflow.JobState {
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := c.JobState(context.Background(), tenant, id)
		if err == nil && st.Status == onceflow.StatusDone || time.Now().After(deadline) {
			return st
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
