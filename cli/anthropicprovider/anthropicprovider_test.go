package anthropicprovider_test

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/onceflow/onceflow/cli/anthropicprovider"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// The provider is ONCEFLOW_LLM=anthropic's: a client of ONCEFLOW_LLM_BASE_URL, with or
// without its /v1, asking ONCEFLOW_LLM_MODEL with ANTHROPIC_API_KEY.
func TestProviderCallsTheConfiguredEndpoint(t *testing.T) {
	srv, err := fakeserver.New(fakeserver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(func() { srv.Close(); ts.Close() })
	p := anthropicprovider.Provider()
	if p.Name != "anthropic" {
		t.Fatalf("name %q, want anthropic", p.Name)
	}
	for i, base := range []string{ts.URL, ts.URL + "/v1", ts.URL + "/v1/"} {
		cfg := config.Defaults()
		cfg.LLM, cfg.LLMBaseURL, cfg.LLMModel, cfg.AnthropicAPIKey = "anthropic", base, "claude-test", "sk-ant-test-not-a-real-key"
		c, err := p.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.Complete(context.Background(), &llm.Request{MaxTokens: 100,
			Messages: []llm.Message{{Role: llm.RoleUser, Content: "hello"}}})
		if err != nil || resp.Content == "" {
			t.Fatalf("base URL %s: Complete: %+v, %v", base, resp, err)
		}
		if st := srv.Stats(); st.Requests != int64(i+1) {
			t.Fatalf("base URL %s: the fake server saw %d requests, want %d", base, st.Requests, i+1)
		}
	}
}
