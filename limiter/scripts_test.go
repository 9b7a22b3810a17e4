package limiter

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/scriptcheck"
	"github.com/onceflow/onceflow/llm"
)

// TestScriptsRunWithTheKeysTheirHeadersName admits a call through Redis (admit.lua),
// ends it with a 429 (pause.lua, settle.lua), on a client whose script calls are
// recorded as Redis receives them, and checks that every .lua file of the limiter ran,
// each call with the number of keys and args its header names.
func TestScriptsRunWithTheKeysTheirHeadersName(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	rec := scriptcheck.Record(rdb)
	l, err := New(rdb, Config{Prefix: prefix, Limits: Limits{RPM: 600}, TenantTokenBudget: 1_000_000,
		Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	p, err := l.Acquire(context.Background(), Call{Model: "m", Tenant: "acme", InputTokens: 10, OutputTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	if !p.viaRedis {
		t.Fatal("the call was not admitted through Redis")
	}
	h := http.Header{}
	h.Set("Retry-After", "1")
	rateLimited := llm.NewAPIError("openai", 429, h, nil, time.Now(), nil)
	if pause := p.Done(Result{Sent: true, Err: rateLimited, RateLimit: rateLimited.RateLimit}); pause <= 0 {
		t.Fatalf("a 429 did not pause the model (%v)", pause)
	}
	rec.Check(t, scripts)
}
