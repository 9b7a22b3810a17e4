package anthropic_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/llmtest"
	"github.com/onceflow/onceflow/retry"
)

// newClient is the adapter for the server at base, over hc (nil: the adapter's own).
func newClient(base string, hc *http.Client) llm.Client {
	return anthropic.New(anthropic.Config{BaseURL: base, APIKey: "sk-ant-test-not-real", Model: "claude-sonnet-4-5", HTTPClient: hc})
}

// The Anthropic adapter passes the suite every llm.Client adapter passes, against
// fake-llm's Messages wire format: an overloaded provider answers 529 with Retry-After,
// an error event mid-stream is overloaded_error, and Request.Temperature is not sent.
func TestAnthropicAdapterPassesTheAdapterConformanceSuite(t *testing.T) {
	t.Parallel()
	llmtest.Run(t, llmtest.Adapter{
		New:                  newClient,
		Endpoint:             "messages",
		Model:                "claude-sonnet-4-5",
		ResponseIDPrefix:     "msg_",
		ToolCallIDPrefix:     "toolu_",
		QuotaCode:            "enforced_spend_limit_reached",
		OverloadedStatus:     529,
		OverloadedType:       "overloaded_error",
		OverloadedRetryAfter: true,
		NoTemperature:        true,
		StreamErrorType:      "overloaded_error",
	})
}

// Anthropic answers an organisation that ran out of prepaid credits with HTTP 400
// invalid_request_error "Your credit balance is too low to access the Anthropic API"
// (not a 429, no quota code: the answer every anthropic-sdk user sees). It is the
// account's state, exactly like OpenAI's insufficient_quota, so it is ClassQuota (trip
// the breaker, hand jobs back), not ClassClientError, which would dead-letter every
// queued job on its first delivery.
func TestCreditBalanceTooLowIsQuota(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("request-id", "req_011CbrFTcXhtiMzr3s6EocF7")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits."},"request_id":"req_011CbrFTcXhtiMzr3s6EocF7"}`))
	}))
	t.Cleanup(srv.Close)
	req := &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise."}}, MaxTokens: 300, IdempotencyKey: "job-credit"}
	_, err := newClient(srv.URL, nil).Complete(context.Background(), req)
	if err == nil {
		t.Fatal("a 400 succeeded")
	}
	if v := retry.Classify(err); v.Class != retry.ClassQuota {
		t.Fatalf("credit balance too low classified %+v, want %s (a provider-wide stop, not a dead letter per job)", v, retry.ClassQuota)
	}
}

// FuzzDecodeMessage feeds arbitrary bodies to the response parser: it never panics, and
// never accepts a tool call without a name or with arguments that are not JSON.
func FuzzDecodeMessage(f *testing.F) {
	f.Add([]byte(`{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":1,"output_tokens":1}}`))
	f.Add([]byte(`{"id":"msg_1","type":"message","content":[{"type":"tool_use","id":"t","name":"n","input":{"a":1}}],"stop_reason":"tool_use"}`))
	f.Add([]byte(`{"type":"message","content":null}`))
	f.Add([]byte(`{"type":"error","error":{"type":"overloaded_error"}}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		resp, err := anthropic.DecodeMessage(raw)
		if err != nil {
			return
		}
		for _, tc := range resp.ToolCalls {
			if tc.Name == "" || !json.Valid([]byte(tc.Arguments)) {
				t.Fatalf("bad tool call accepted: %+v", tc)
			}
		}
	})
}
