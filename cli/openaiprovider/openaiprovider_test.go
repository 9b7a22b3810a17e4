package openaiprovider_test

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/onceflow/onceflow/cli/openaiprovider"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// The provider is ONCEFLOW_LLM=openai's: a client of ONCEFLOW_LLM_BASE_URL (with /v1)
// asking ONCEFLOW_LLM_MODEL with OPENAI_API_KEY.
func TestProviderCallsTheConfiguredEndpoint(t *testing.T) {
	srv, err := fakeserver.New(fakeserver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(func() { srv.Close(); ts.Close() })
	p := openaiprovider.Provider()
	if p.Name != "openai" {
		t.Fatalf("name %q, want openai", p.Name)
	}
	cfg := config.Defaults()
	cfg.LLM, cfg.LLMBaseURL, cfg.LLMModel, cfg.OpenAIAPIKey = "openai", ts.URL+"/v1", "gpt-test", "sk-test-not-a-real-key"
	c, err := p.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Complete(context.Background(), &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "hello"}}})
	if err != nil || resp.Content == "" || resp.Model != "gpt-test" {
		t.Fatalf("Complete: %+v, %v", resp, err)
	}
	if st := srv.Stats(); st.Requests != 1 {
		t.Fatalf("the fake server saw %d requests, want 1", st.Requests)
	}
}
