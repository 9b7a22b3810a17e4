package ledger_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry/retrytest"
)

func TestPurgeDeletesExpiredRowsInBatches(t *testing.T) {
	t.Parallel()
	clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l, pool := newLedger(t, ledger.Config{Retention: time.Hour, Lease: 10 * time.Minute, PurgeBatch: 2, Clock: clock, Wait: -1})
	ctx := ctxT(t)
	for i := range 5 {
		att, _, err := l.Begin(ctx, callOf(fmt.Sprintf("job-%d/s", i), request("x")))
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := att.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "r"})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.ToolKeys(ctx, "openai", "req", []llm.ToolCall{{ID: "c1", Name: "t", Arguments: "{}"}}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(59 * time.Minute)
	live, _, err := l.Begin(ctx, callOf("job-live/s", request("x"))) // created now: expires in an hour
	if err != nil {
		t.Fatal(err)
	}
	n, err := l.Purge(ctx)
	if err != nil || n != 0 {
		t.Fatalf("purged %d before expiry (%v)", n, err)
	}
	clock.Advance(2 * time.Minute)
	n, err = l.Purge(ctx)
	if err != nil || n != 6 {
		t.Fatalf("purged %d rows (%v), want 5 calls and 1 tool call", n, err)
	}
	// An expired in_flight row whose owner still renews is kept.
	clock.Advance(time.Hour)
	if _, err := pool.Exec(ctx, `UPDATE llm_calls SET lease_until = $1`, clock.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if n, _ := l.Purge(ctx); n != 0 {
		t.Fatalf("purged a live in_flight row")
	}
	_ = live.Fail(ctx, errors.New("x"), false)
	if n, _ := l.Purge(ctx); n != 1 {
		t.Fatalf("purged %d, want the now failed expired row", n)
	}
}
