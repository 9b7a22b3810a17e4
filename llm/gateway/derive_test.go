package gateway_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/gateway"
)

// sdkPost sends a request without Idempotency-Key as the official SDKs do, with
// X-Stainless-Retry-Count count ("" for none), giving up after timeout.
func sdkPost(t *testing.T, url, auth, count, body string, timeout time.Duration) (int, []byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", auth)
	if count != "" {
		req.Header.Set("X-Stainless-Retry-Count", count)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// With ONCEFLOW_GATEWAY_DERIVE_KEYS=retry-count, an SDK's automatic retry of a request
// without a key (X-Stainless-Retry-Count: 1) is answered from its first attempt's call,
// on any gateway process: joined while it runs, replayed after. A new first attempt
// with the same body is a new call; so is a retry with other credentials, and every
// request of a client that does not number its attempts.
func TestDerivedKeysAnswerAnSDKRetryFromTheFirstAttempt(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Latency: 800 * time.Millisecond, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 2, gateway.Config{DeriveKeys: gateway.DeriveRetryCount})
	// The first attempt times out at the client; the SDK retries on the other process.
	if _, _, err := sdkPost(t, fl.urls[0], "Bearer sk-a", "0", chatBody, 200*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the first attempt did not time out: %v", err)
	}
	code, retried, err := sdkPost(t, fl.urls[1], "Bearer sk-a", "1", chatBody, 10*time.Second)
	if err != nil || code != 200 {
		t.Fatalf("retry: %d %s %v", code, retried, err)
	}
	if n := fs.Stats().Requests; n != 1 {
		t.Fatalf("%d upstream requests for one request and its retry, want 1", n)
	}
	code, again, err := sdkPost(t, fl.urls[0], "Bearer sk-a", "2", chatBody, 10*time.Second)
	if err != nil || code != 200 || !bytes.Equal(again, retried) {
		t.Fatalf("second retry: %d %s %v; want the first answer replayed", code, again, err)
	}
	// Not retries of it: a new first attempt, other credentials, no count, a bad count.
	for _, c := range []struct{ auth, count string }{{"Bearer sk-a", "0"}, {"Bearer sk-b", "1"}, {"Bearer sk-a", ""}, {"Bearer sk-a", "x"}} {
		code, b, err := sdkPost(t, fl.urls[0], c.auth, c.count, chatBody, 10*time.Second)
		if err != nil || code != 200 || bytes.Equal(b, retried) {
			t.Fatalf("%+v: %d %s %v; want a new call", c, code, b, err)
		}
	}
	if n := fs.Stats().Requests; n != 5 {
		t.Fatalf("%d upstream requests, want 5 (one per request that is not a retry)", n)
	}
	// A minute after its answer a note is no longer offered: an SDK retries within
	// seconds, so this is the retry of a later identical request whose first attempt
	// never reached the gateway, and it gets a call of its own.
	if _, err := fl.pool.Exec(context.Background(), `UPDATE llm_calls SET updated_at = now() - interval '61 seconds' WHERE state = 'succeeded'`); err != nil {
		t.Fatal(err)
	}
	code, late, err := sdkPost(t, fl.urls[1], "Bearer sk-a", "1", chatBody, 10*time.Second)
	if err != nil || code != 200 || bytes.Equal(late, retried) {
		t.Fatalf("a retry a minute after the answer: %d %s %v; want a new call", code, late, err)
	}
	if n := fs.Stats().Requests; n != 6 {
		t.Fatalf("%d upstream requests, want 6", n)
	}
}

// Without the option, X-Stainless-Retry-Count changes nothing: every request without a
// key is passed through.
func TestWithoutDerivedKeysRetriesPassThrough(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 1, gateway.Config{})
	for _, count := range []string{"0", "1"} {
		if code, b, err := sdkPost(t, fl.urls[0], "Bearer sk-a", count, chatBody, 10*time.Second); err != nil || code != 200 {
			t.Fatalf("%d %s %v", code, b, err)
		}
	}
	if n := fs.Stats().Requests; n != 2 {
		t.Fatalf("%d upstream requests, want 2", n)
	}
}
