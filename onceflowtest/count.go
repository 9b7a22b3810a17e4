package onceflowtest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
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
