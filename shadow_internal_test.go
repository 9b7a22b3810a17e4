package onceflow

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fake"
)

// The purge deletes the shadow runs older than Config.ShadowRetention, and keeps the
// others.
func TestShadowRunsOlderThanTheRetentionArePurged(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	c, err := NewClient(Config{Redis: rdb, DB: db, Prefix: prefix, Model: fake.New(), NoLimits: true,
		Shadows: []Shadow{{Step: "summary", Model: "m", Rate: 1}}, ShadowRetention: 48 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i, age := range []string{"72 hours", "47 hours", "1 minute"} {
		if _, err := db.Exec(ctx, `INSERT INTO shadow_runs (prod_key, candidate, job_id, step, prod_answer, cand_answer, agree, score, created_at)
VALUES ($1, 'm', 'j', 'summary', '{}', '{}', true, 1, now() - $2::interval)`, "llm-"+string(rune('a'+i)), age); err != nil {
			t.Fatal(err)
		}
	}
	n, err := c.shadows.purge(ctx)
	if err != nil || n != 1 {
		t.Fatalf("purged %d (%v), want the one older than 48h", n, err)
	}
	var left int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM shadow_runs`).Scan(&left); err != nil || left != 2 {
		t.Fatalf("%d shadow runs left (%v), want 2", left, err)
	}
	if _, err := NewClient(Config{Redis: rdb, DB: db, Prefix: prefix, Model: fake.New(),
		Shadows: []Shadow{{Step: "summary", Model: "m", Rate: 1}}, ShadowRetention: -time.Hour}); err == nil {
		t.Fatal("a negative ShadowRetention was accepted")
	}
}
