package openai_test

import (
	"bytes"
	"net/http"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/llmtest"
	"github.com/onceflow/onceflow/llm/openai"
)

// newClient is the adapter for the server at base (its root: the adapter's path is
// /v1), over hc (nil: the adapter's own).
func newClient(base string, hc *http.Client) llm.Client {
	return openai.New(openai.Config{BaseURL: base + "/v1", APIKey: "sk-test-not-a-real-key", HTTPClient: hc})
}

// The OpenAI adapter passes the suite every llm.Client adapter passes, against
// fake-llm's OpenAI wire format.
func TestOpenAIAdapterPassesTheAdapterConformanceSuite(t *testing.T) {
	t.Parallel()
	llmtest.Run(t, llmtest.Adapter{
		New:                   newClient,
		Endpoint:              "chat_completions",
		Model:                 "gpt-4.1-mini",
		ResponseIDPrefix:      "chatcmpl-",
		ToolCallIDPrefix:      "call_",
		ToolArgumentsVerbatim: true,
		RateLimitCode:         "rate_limit_exceeded",
		QuotaCode:             "insufficient_quota",
		ContextTooLongCode:    "context_length_exceeded",
		OverloadedStatus:      http.StatusServiceUnavailable,
		OverloadedType:        "server_error",
		StreamErrorType:       "server_error",
	})
}

// FuzzDecodeCompletion feeds arbitrary bodies to the response parser: it returns a
// response with at least one choice's worth of data or an error, never panics.
func FuzzDecodeCompletion(f *testing.F) {
	f.Add([]byte(`{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`))
	f.Add([]byte(`{"id":"x","choices":[{"message":{"content":null,"tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}`))
	f.Add([]byte(`{"choices":[]}`))
	f.Add([]byte(`{"choices":"nope"}`))
	f.Add([]byte(`<html>`))
	f.Add([]byte(`{"id":"broken","choices":[{"message":{"role":"assis`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		resp, err := openai.DecodeCompletion(raw)
		if err != nil {
			if resp != nil {
				t.Fatal("error with a response")
			}
			return
		}
		if !bytes.Equal(resp.Raw, raw) {
			t.Fatal("Raw is not the input")
		}
		for _, tc := range resp.ToolCalls {
			if tc.Name == "" {
				t.Fatal("tool call without a name accepted")
			}
		}
	})
}
