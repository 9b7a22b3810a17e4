package anthropic_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/retry"
)

// Anthropic answers an organisation that ran out of prepaid credits with HTTP 400
// invalid_request_error "Your credit balance is too low to access the Anthropic API"
// (not a 429, no quota code: the answer every anthropic-sdk user sees). It is the
// account's state, exactly like OpenAI's insufficient_quota, so it must be ClassQuota
// (trip the breaker, hand jobs back) and not ClassClientError, which dead-letters every
// queued job on its first delivery.
func TestAttackAnthropicCreditBalanceTooLowIsQuota(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("request-id", "req_011CbrFTcXhtiMzr3s6EocF7")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits."},"request_id":"req_011CbrFTcXhtiMzr3s6EocF7"}`))
	}))
	t.Cleanup(srv.Close)
	c := anthropic.New(anthropic.Config{BaseURL: srv.URL, APIKey: "sk-ant-test-not-real"})
	_, err := c.Complete(context.Background(), summarise("job-credit"))
	if err == nil {
		t.Fatal("a 400 succeeded")
	}
	if v := retry.Classify(err); v.Class != retry.ClassQuota {
		t.Fatalf("credit balance too low classified %+v, want %s (a provider-wide stop, not a dead letter per job)", v, retry.ClassQuota)
	}
}
