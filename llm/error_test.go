package llm_test

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

func TestParseErrorBody(t *testing.T) {
	t.Parallel()
	cases := []struct {
		body string
		want llm.ErrorBody
		ok   bool
	}{
		{`{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}`,
			llm.ErrorBody{Type: "requests", Code: "rate_limit_exceeded", Message: "Rate limit reached"}, true},
		{`{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			llm.ErrorBody{Type: "invalid_request_error", Code: "context_length_exceeded", Param: "messages", Message: "too long"}, true},
		{`{"error":{"message":"x","type":"server_error","code":502}}`, llm.ErrorBody{Type: "server_error", Code: "502", Message: "x"}, true},
		{`{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`, llm.ErrorBody{Type: "overloaded_error", Message: "Overloaded"}, true},
		{`{"type":"error","error":{"type":"rate_limit_error","message":"m","details":{"error_code":"enforced_spend_limit_reached"}}}`,
			llm.ErrorBody{Type: "rate_limit_error", Code: "enforced_spend_limit_reached", Message: "m"}, true},
		{`{"error":"upstream connect error"}`, llm.ErrorBody{Message: "upstream connect error"}, true},
		{`{"detail":"Not Found"}`, llm.ErrorBody{Message: "Not Found"}, true},
		{`{"message":"Internal error"}`, llm.ErrorBody{Message: "Internal error"}, true},
		{`{"error":{"message":"line1\nline2\u0000"}}`, llm.ErrorBody{Message: "line1 line2"}, true},
		{`<html><body>502 Bad Gateway</body></html>`, llm.ErrorBody{}, false},
		{``, llm.ErrorBody{}, false},
		{`null`, llm.ErrorBody{}, false},
		{`[]`, llm.ErrorBody{}, false},
		{`{"error":null}`, llm.ErrorBody{}, false},
		{`{"error":{}}`, llm.ErrorBody{}, false},
		{`{"error":{"type":["not","a","string"]}}`, llm.ErrorBody{}, false},
	}
	for _, tc := range cases {
		got, ok := llm.ParseErrorBody([]byte(tc.body))
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseErrorBody(%s) = %+v, %t; want %+v, %t", tc.body, got, ok, tc.want, tc.ok)
		}
	}
}

func FuzzParseErrorBody(f *testing.F) {
	for _, s := range []string{
		`{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}`,
		`{"type":"error","error":{"type":"overloaded_error","message":"Overloaded","details":{"error_code":"x"}}}`,
		`{"error":"text"}`, `{"detail":"d"}`, `{"message":1e999}`, `{"error":{"code":-0.5e-3}}`, `<html>`, `{"error":{"message":"\ud800"}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		eb, ok := llm.ParseErrorBody(body)
		if !ok && eb != (llm.ErrorBody{}) {
			t.Fatalf("not ok but fields set: %+v", eb)
		}
		for name, v := range map[string]string{"type": eb.Type, "code": eb.Code, "param": eb.Param} {
			if len(v) > 128 || !utf8.ValidString(v) {
				t.Fatalf("%s not bounded or not UTF-8: %q", name, v)
			}
		}
		if len(eb.Message) > 1024 || !utf8.ValidString(eb.Message) || strings.ContainsAny(eb.Message, "\n\r\x00") {
			t.Fatalf("message not cleaned: %q", eb.Message)
		}
		// Whatever the body, the APIError built from it classifies without panicking
		// and its text stays one bounded line.
		e := llm.NewAPIError("fuzz", 500, http.Header{"Retry-After": {string(body)}}, body, time.Now(), nil)
		_ = retry.Classify(e)
		if msg := e.Error(); strings.ContainsAny(msg, "\n\r") || len(msg) > 1024 {
			t.Fatalf("error text not one bounded line: %q", msg)
		}
	})
}

func TestAPIErrorFromResponse(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	h.Set("x-request-id", "req_123")
	h.Set("retry-after-ms", "1500")
	h.Set("Retry-After", "2")
	h.Set("x-should-retry", "true")
	sdk := errors.New("sdk error")
	e := llm.NewAPIError("openai", 429, h, []byte(`{"error":{"message":"slow down","type":"requests","code":"rate_limit_exceeded"}}`), time.Now(), sdk)
	if e.RequestID != "req_123" || !e.RetryAfterSet || e.RetryAfterDelay != 1500*time.Millisecond || e.Code != "rate_limit_exceeded" || !errors.Is(e, sdk) {
		t.Fatalf("APIError %+v", e)
	}
	want := "openai: HTTP 429 Too Many Requests (requests/rate_limit_exceeded): slow down [request req_123]"
	if e.Error() != want {
		t.Fatalf("Error() = %q, want %q", e.Error(), want)
	}
	v := retry.Classify(fmt.Errorf("summarise: %w", e))
	if !v.Retryable || v.Class != retry.ClassRateLimited || v.RetryAfter != 1500*time.Millisecond {
		t.Fatalf("verdict %+v", v)
	}

	// A 401's message can echo part of the key: it is left out of Error().
	auth := llm.NewAPIError("openai", 401, nil, []byte(`{"error":{"message":"Incorrect API key provided: sk-abc***xyz","type":"invalid_request_error","code":"invalid_api_key"}}`), time.Now(), nil)
	if strings.Contains(auth.Error(), "sk-") {
		t.Fatalf("401 error text leaks the key hint: %q", auth.Error())
	}

	huge := llm.NewAPIError("x", 500, nil, make([]byte, 2*llm.MaxErrorBody), time.Now(), nil)
	if len(huge.Body) != llm.MaxErrorBody {
		t.Fatalf("body kept %d bytes", len(huge.Body))
	}
}

func TestMalformedIsPermanent(t *testing.T) {
	t.Parallel()
	cause := errors.New("unexpected end of JSON input")
	err := llm.Malformed("openai", "req_1", cause)
	if !errors.Is(err, llm.ErrMalformedResponse) || !errors.Is(err, cause) || !retry.IsPermanent(err) || retry.Retryable(err) {
		t.Fatalf("Malformed: %v", err)
	}
	if !strings.Contains(err.Error(), "req_1") {
		t.Fatalf("request id missing: %v", err)
	}
}

func TestCollectJoinsAStreamIntoOneResponse(t *testing.T) {
	t.Parallel()
	t.Run("the chunks' content, raw lines and the last chunk's finish and usage", func(t *testing.T) {
		t.Parallel()
		seq := func(yield func(llm.Chunk, error) bool) {
			_ = yield(llm.Chunk{Content: "Hel", ID: "c1", Raw: []byte(`{"a":1}`)}, nil) &&
				yield(llm.Chunk{Content: "lo", ID: "c1", Raw: []byte(`{"a":2}`)}, nil) &&
				yield(llm.Chunk{Done: true, FinishReason: llm.FinishStop, Usage: &llm.Usage{InputTokens: 3, OutputTokens: 2}, RequestID: "r"}, nil)
		}
		resp, err := llm.Collect(seq)
		if err != nil || resp.Content != "Hello" || resp.ID != "c1" || resp.FinishReason != "stop" || resp.Usage.OutputTokens != 2 ||
			resp.RequestID != "r" || string(resp.Raw) != "{\"a\":1}\n{\"a\":2}\n" {
			t.Fatalf("Collect = %+v, %v", resp, err)
		}
	})
	t.Run("an error returned with the content before it", func(t *testing.T) {
		t.Parallel()
		boom := errors.New("boom")
		resp, err := llm.Collect(func(yield func(llm.Chunk, error) bool) {
			_ = yield(llm.Chunk{Content: "par"}, nil) && yield(llm.Chunk{}, boom)
		})
		if !errors.Is(err, boom) || resp.Content != "par" {
			t.Fatalf("Collect with error = %+v, %v", resp, err)
		}
	})
}

func TestNewHTTPClientKeepsConnectionsForConcurrentCalls(t *testing.T) {
	tr, ok := llm.NewHTTPClient().Transport.(*http.Transport)
	if !ok || tr.MaxIdleConnsPerHost < 64 || tr.MaxIdleConns < tr.MaxIdleConnsPerHost {
		t.Fatalf("transport keeps %d idle connections per host (%d in all); a worker's concurrent calls would re-dial", tr.MaxIdleConnsPerHost, tr.MaxIdleConns)
	}
	if llm.NewHTTPClient().Timeout != 0 {
		t.Fatal("an overall client timeout would cut streams; each call's context bounds it")
	}
}
