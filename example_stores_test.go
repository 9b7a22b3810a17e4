package onceflow_test

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/migrations"
)

// exampleStores gives a runnable example the test Redis (ONCEFLOW_REDIS_URL) with a key
// prefix of its own, and a pool on a PostgreSQL schema of its own (ONCEFLOW_DATABASE_URL)
// migrated by onceflow's migrations and extra's, with the user's tables created by ddl;
// done removes both. The examples' logs are not part of their output: it discards
// slog's default.
func exampleStores(ddl string, extra ...migrations.Source) (rdb *redis.Client, prefix string, db *pgxpool.Pool, done func()) {
	slog.SetDefault(slog.New(slog.DiscardHandler))
	t := testenv.NewExampleT()
	rdb, prefix = testenv.Redis(t)
	db, _ = testenv.Postgres(t, extra...)
	_, err := db.Exec(context.Background(), ddl)
	must(err)
	return rdb, prefix, db, t.Done
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
