package ledger_test

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

func TestReadStatsCountsCallsByProviderModelAndState(t *testing.T) {
	t.Parallel()
	l, pool := newLedger(t, ledger.Config{Wait: -1})
	ctx := ctxT(t)
	a1, _, _ := l.Begin(ctx, callOf("j1/s", request("1")))
	_ = a1.Fail(ctx, io.ErrUnexpectedEOF, true)
	a1, _, err := l.Begin(ctx, callOf("j1/s", request("1")))
	if err != nil {
		t.Fatal(err)
	}
	_, _, _ = a1.Succeed(ctx, ledger.ResultOf(&llm.Response{ID: "x"}))
	a2, _, _ := l.Begin(ctx, callOf("j2/s", request("2")))
	_ = a2.Fail(ctx, &llm.APIError{StatusCode: 400}, false)
	a3, _, _ := l.Begin(ctx, callOf("j3/s", request("3")))
	_ = a3.Fail(ctx, context.DeadlineExceeded, true)
	other := ledger.Call{Key: "k-other", RequestHash: "h", Provider: "anthropic", Model: "claude-haiku-4-5"}
	if _, _, err := l.Begin(ctx, other); err != nil {
		t.Fatal(err)
	}
	st, err := ledger.ReadStats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	want := []ledger.Stats{
		{Provider: "anthropic", Model: "claude-haiku-4-5", Calls: 1, InFlight: 1, Attempts: 1},
		{Provider: "openai", Model: "gpt-4.1-mini", Calls: 3, InFlight: 1, Succeeded: 1, Failed: 1, Abandoned: 1, Attempts: 2 + 2 + 2, Ambiguous: 2},
	}
	if fmt.Sprint(st) != fmt.Sprint(want) {
		t.Fatalf("stats\n%+v\nwant\n%+v", st, want)
	}
}
