package summaries_test

import (
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

// exampleStores gives a runnable example the test Redis (ONCEFLOW_REDIS_URL) with a key
// prefix of its own and a pool on a migrated PostgreSQL schema of its own
// (ONCEFLOW_DATABASE_URL); done removes both. It discards slog's default logger.
func exampleStores() (rdb *redis.Client, prefix string, db *pgxpool.Pool, done func()) {
	slog.SetDefault(slog.New(slog.DiscardHandler))
	t := testenv.NewExampleT()
	rdb, prefix = testenv.Redis(t)
	db, _ = testenv.Postgres(t)
	return rdb, prefix, db, t.Done
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}
