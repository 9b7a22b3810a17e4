package anthropicprovider_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

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

// Its batch API (the batch lane's, ONCEFLOW_SUMMARIES_LANE=batch) is the Message Batches
// API of the same endpoint, with or without its /v1, and key: a batch it submits is one
// fake-llm created for ANTHROPIC_API_KEY, of ONCEFLOW_LLM_MODEL's requests, and one it
// then lists and reads.
func TestProviderBatchesGoToTheConfiguredEndpoint(t *testing.T) {
	srv, err := fakeserver.New(fakeserver.Config{BatchDelay: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(func() { srv.Close(); ts.Close() })
	p := anthropicprovider.Provider()
	if p.NewBatch == nil {
		t.Fatal("the anthropic provider has no batch API")
	}
	for i, base := range []string{ts.URL, ts.URL + "/v1/"} {
		cfg := config.Defaults()
		cfg.LLM, cfg.LLMBaseURL, cfg.LLMModel, cfg.AnthropicAPIKey = "anthropic", base, "claude-test", "sk-ant-test-not-a-real-key"
		b, err := p.NewBatch(cfg)
		if err != nil {
			t.Fatal(err)
		}
		before := time.Now().Add(-time.Minute)
		info, err := b.Submit(context.Background(), llm.BatchSubmission{ID: "s", Model: "claude-test", Items: []llm.BatchItem{
			{CustomID: "a", Request: &llm.Request{MaxTokens: 100, Messages: []llm.Message{{Role: llm.RoleUser, Content: "hello"}}}}}})
		if err != nil {
			t.Fatalf("base URL %s: Submit: %v", base, err)
		}
		if st := srv.Stats(); st.BatchesCreated["anthropic"] != int64(i+1) {
			t.Fatalf("base URL %s: fake-llm created %v batches, want %d Anthropic ones", base, st.BatchesCreated, i+1)
		}
		listed, err := b.List(context.Background(), before)
		if err != nil || len(listed) != i+1 || listed[0].ID != info.ID {
			t.Fatalf("base URL %s: List: %+v %v, want the new batch first of %d", base, listed, err, i+1)
		}
		for !info.Ended && err == nil {
			time.Sleep(20 * time.Millisecond)
			info, err = b.Get(context.Background(), info.ID)
		}
		for r, err := range b.Results(context.Background(), info.ID) {
			if err != nil || r.CustomID != "a" || r.Outcome != llm.BatchSucceeded || r.Response.Model != "claude-test" {
				t.Fatalf("base URL %s: result %+v %v", base, r, err)
			}
		}
	}
}
