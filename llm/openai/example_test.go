package openai_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/retry"
)

// Build an OpenAI client against fake-llm (here in-process; `onceflow fake-llm --addr
// 127.0.0.1:9090` serves the same at http://127.0.0.1:9090/v1) and call it under a
// retry policy. The first request is rate limited; the retry succeeds.
func ExampleNew() {
	fakeLLM, _ := fakeserver.New(fakeserver.Config{})
	fakeLLM.Script(fakeserver.Fault{Kind: fakeserver.Fault429, Header: http.Header{"Retry-After-Ms": {"100"}}})
	srv := httptest.NewServer(fakeLLM)
	defer srv.Close()
	defer fakeLLM.Close()

	client := openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "sk-anything", Model: "gpt-4.1-mini"})
	req := &llm.Request{
		Messages: []llm.Message{
			{Role: llm.RoleUser, Content: "Summarise for the account team:\n\nThe March invoice was charged twice."},
		},
		Temperature:    llm.Float(0),
		IdempotencyKey: "job-42", // the same key on every attempt of this job
	}
	policy := retry.Policy{
		PerCallTimeout: 5 * time.Second,
		OnRetry: func(r retry.Retry) {
			fmt.Printf("attempt %d: %s, retrying after the server's Retry-After: %t\n", r.Attempt, r.Class, r.FromRetryAfter)
		},
	}
	resp, err := retry.Do(context.Background(), policy, retry.After(30*time.Second), func(ctx context.Context) (*llm.Response, error) {
		return client.Complete(ctx, req)
	})
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	fmt.Println(resp.Content)
	fmt.Println(resp.FinishReason)
	// Output:
	// attempt 1: rate_limited, retrying after the server's Retry-After: true
	// Summary d3ec7752: The March invoice was charged twice. (6 words)
	// stop
}
