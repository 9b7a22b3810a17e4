package openai_test

import (
	"strings"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/openai"
)

// ParseBatchResult reads an output file's answer, an error file's failure and an
// expired item, and refuses lines that are none of these.
func TestParseBatchResult(t *testing.T) {
	answer := `{"id":"batch_req_1","custom_id":"abc","response":{"status_code":200,"request_id":"r1","body":` +
		`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4.1-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}},"error":null}`
	for _, tc := range []struct {
		line, outcome, want string
	}{
		{answer, llm.BatchSucceeded, ""},
		{`{"id":"x","custom_id":"abc","response":{"status_code":500,"body":{"error":{"message":"boom"}}},"error":null}`, llm.BatchErrored, ""},
		{`{"id":"x","custom_id":"abc","response":null,"error":{"code":"batch_expired","message":"not done in time"}}`, llm.BatchExpired, ""},
		{`{"id":"x","custom_id":"abc","response":{"status_code":200,"body":{"choices":[]}},"error":null}`, llm.BatchErrored, ""},
		{`{"custom_id":"abc"}`, "", "neither"},
		{`{"response":null,"error":{"code":"x"}}`, "", "no custom_id"},
		{`not json`, "", "not JSON"},
	} {
		r, err := openai.ParseBatchResult([]byte(tc.line))
		if tc.want != "" {
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %+v %v, want an error saying %q", tc.line, r, err, tc.want)
			}
			continue
		}
		if err != nil || r.Outcome != tc.outcome || r.CustomID != "abc" || (tc.outcome == llm.BatchSucceeded) != (r.Response != nil) {
			t.Errorf("%s: %+v %v, want %s", tc.line, r, err, tc.outcome)
		}
	}
	if r, _ := openai.ParseBatchResult([]byte(answer)); r.Response.Content != "hi" || r.Response.Usage.InputTokens != 3 {
		t.Errorf("answer %+v", r.Response)
	}
}

// ParseBatchResult takes any line without panicking; what it accepts names its item.
func FuzzParseBatchResult(f *testing.F) {
	for _, s := range []string{`{"custom_id":"a","response":{"status_code":200,"body":{}}}`, `{"custom_id":"a","error":{"code":"batch_expired"}}`, `{}`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		r, err := openai.ParseBatchResult(line)
		if err == nil && (r.CustomID == "" || r.Outcome == "" || (r.Outcome == llm.BatchSucceeded) != (r.Response != nil)) {
			t.Fatalf("%q parsed to %+v", line, r)
		}
	})
}
