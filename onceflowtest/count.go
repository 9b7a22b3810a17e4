package onceflowtest

import (
	"cmp"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
)

// Count runs sql, a query returning one number ("SELECT count(*) FROM tickets WHERE
// ..."), and returns it.
func Count(t testing.TB, db *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int
	if err := db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("count %q: %v", sql, err)
	}
	return n
}

// OutboxRows counts the outbox rows of topic, the effects committed with Commit.Emit,
// sent or not; "" counts every topic's, EnqueueTx's jobs included.
func OutboxRows(t testing.TB, db *pgxpool.Pool, topic string) int {
	t.Helper()
	if topic == "" {
		return Count(t, db, `SELECT count(*) FROM outbox`)
	}
	return Count(t, db, `SELECT count(*) FROM outbox WHERE topic = $1`, topic)
}

// SentOutboxRows counts the outbox rows of topic ("" for all) that the relay has sent.
func SentOutboxRows(t testing.TB, db *pgxpool.Pool, topic string) int {
	t.Helper()
	return Count(t, db, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL AND ($1 = '' OR topic = $1)`, topic)
}

// Completions counts the job completion records of kind ("" for all): the jobs whose
// Commit won.
func Completions(t testing.TB, db *pgxpool.Pool, kind string) int {
	t.Helper()
	return Count(t, db, `SELECT count(*) FROM job_completions WHERE $1 = '' OR kind = $1`, kind)
}

// Pending counts the jobs of queue name (under prefix) that a worker received and has
// not acknowledged: a job whose worker died before its acknowledgement stays pending
// until another worker reclaims it. A queue no worker has read yet has none.
func Pending(t testing.TB, rdb redis.UniversalClient, prefix, name string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	keys := queue.Keys{Prefix: cmp.Or(prefix, onceflow.DefaultPrefix), Queue: name}
	p, err := rdb.XPending(ctx, keys.Stream(), queue.DefaultGroup).Result()
	if err != nil {
		if strings.HasPrefix(err.Error(), "NOGROUP") || errors.Is(err, redis.Nil) {
			return 0
		}
		t.Fatalf("pending of queue %s: %v", name, err)
	}
	return int(p.Count)
}
