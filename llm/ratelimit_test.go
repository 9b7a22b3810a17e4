package llm_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
)

func TestParseRateLimitOpenAI(t *testing.T) {
	h := http.Header{}
	h.Set("x-ratelimit-limit-requests", "600")
	h.Set("x-ratelimit-remaining-requests", "599")
	h.Set("x-ratelimit-reset-requests", "100ms")
	h.Set("x-ratelimit-limit-tokens", "200000")
	h.Set("x-ratelimit-remaining-tokens", "198000")
	h.Set("x-ratelimit-reset-tokens", "6m0s")
	rl, ok := llm.ParseRateLimit(h, time.Now())
	want := llm.RateLimit{
		Requests: llm.RateWindow{Limit: 600, Remaining: 599, HasRemaining: true, Reset: 100 * time.Millisecond, HasReset: true},
		Tokens:   llm.RateWindow{Limit: 200000, Remaining: 198000, HasRemaining: true, Reset: 6 * time.Minute, HasReset: true},
	}
	if !ok || rl != want {
		t.Fatalf("got %+v %v, want %+v", rl, ok, want)
	}
}

func TestParseRateLimitAnthropic(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	h := http.Header{}
	h.Set("anthropic-ratelimit-requests-limit", "50")
	h.Set("anthropic-ratelimit-requests-remaining", "0")
	h.Set("anthropic-ratelimit-requests-reset", "2026-12-01T12:00:07Z")
	h.Set("anthropic-ratelimit-input-tokens-limit", "40000")
	h.Set("anthropic-ratelimit-input-tokens-remaining", "39000")
	h.Set("anthropic-ratelimit-input-tokens-reset", "2026-11-30T12:00:00Z") // past: 0
	rl, ok := llm.ParseRateLimit(h, now)
	if !ok || rl.Requests != (llm.RateWindow{Limit: 50, HasRemaining: true, Reset: 7 * time.Second, HasReset: true}) {
		t.Fatalf("requests %+v %v", rl.Requests, ok)
	}
	if rl.InputTokens != (llm.RateWindow{Limit: 40000, Remaining: 39000, HasRemaining: true, HasReset: true}) {
		t.Fatalf("input tokens %+v", rl.InputTokens)
	}
}

func TestParseRateLimitIgnoresNonsenseOneByOne(t *testing.T) {
	h := http.Header{}
	h.Set("x-ratelimit-limit-requests", "-5")
	h.Set("x-ratelimit-remaining-requests", "12abc")
	h.Set("x-ratelimit-reset-requests", "forever")
	h.Set("x-ratelimit-limit-tokens", "99999999999999999999999")
	h.Set("x-ratelimit-reset-tokens", "48h")
	h.Set("x-ratelimit-remaining-tokens", "10")
	rl, ok := llm.ParseRateLimit(h, time.Now())
	if !ok || rl.Requests != (llm.RateWindow{}) || rl.Tokens != (llm.RateWindow{Remaining: 10, HasRemaining: true}) {
		t.Fatalf("got %+v %v", rl, ok)
	}
	if _, ok := llm.ParseRateLimit(http.Header{"Content-Type": {"x"}}, time.Now()); ok {
		t.Fatal("no rate-limit header: ok must be false")
	}
	if llm.RateLimitOf(nil, time.Now()) != nil {
		t.Fatal("nil header: nil")
	}
}

func FuzzParseRateLimit(f *testing.F) {
	f.Add("600", "12", "6m0s", "2026-12-01T12:00:07Z")
	f.Add("", "-1", "0.5", "garbage")
	f.Fuzz(func(t *testing.T, limit, remaining, reset, resetTime string) {
		h := http.Header{}
		h.Set("x-ratelimit-limit-requests", limit)
		h.Set("x-ratelimit-remaining-tokens", remaining)
		h.Set("x-ratelimit-reset-requests", reset)
		h.Set("anthropic-ratelimit-output-tokens-reset", resetTime)
		rl, _ := llm.ParseRateLimit(h, time.Now())
		for _, w := range []llm.RateWindow{rl.Requests, rl.Tokens, rl.InputTokens, rl.OutputTokens} {
			if w.Limit < 0 || w.Remaining < 0 || w.Reset < 0 || w.Reset > 24*time.Hour {
				t.Fatalf("out of range: %+v", w)
			}
		}
	})
}

func TestEstimateTokensCountsMessagesToolsAndTheOutput(t *testing.T) {
	req := &llm.Request{Messages: []llm.Message{
		{Role: llm.RoleSystem, Content: "You summarise."},               // 14 chars: 4 tokens
		{Role: llm.RoleUser, Content: "Ünïcödé counts code points, ok"}, // 30 code points: 8
	}}
	if got, want := llm.EstimateInputTokens(req), 3+(4+4)+(4+8); got != want {
		t.Fatalf("EstimateInputTokens = %d, want %d", got, want)
	}
	if got, want := llm.EstimateTokens(req), 23+llm.DefaultOutputTokens; got != want {
		t.Fatalf("EstimateTokens without MaxTokens = %d, want %d", got, want)
	}
	req.MaxTokens = 10
	req.Tools = []llm.Tool{{Name: "refund", Description: "Refund an order", Parameters: []byte(`{"type":"object"}`)}}
	if got, want := llm.EstimateTokens(req), 23+(6+15+17+3)/4+10; got != want {
		t.Fatalf("EstimateTokens with a tool and MaxTokens = %d, want %d", got, want)
	}
	if llm.EstimateTokens(nil) != 0 {
		t.Fatal("nil request")
	}
}
