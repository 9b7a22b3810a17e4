package gateway_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
)

// attackGateway serves a gateway in front of upstream and returns its /v1 URL, its
// database and its logs.
func attackGateway(t *testing.T, upstream http.Handler) (string, *pgxpool.Pool, *testenv.SyncBuffer) {
	t.Helper()
	ups := httptest.NewServer(upstream)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	logs := &testenv.SyncBuffer{}
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: pool,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("gateway logs:\n%s", logs)
		}
	})
	return gs.URL + "/v1", pool, logs
}

// rawPost posts body to url with the given headers and returns the status, the
// Idempotent-Replayed header and the body.
func rawPost(t *testing.T, url, body string, h http.Header) (int, string, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	for k, vs := range h {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), b
}

// Some upstreams take their key in the query string (Gemini's ?key=, many self-hosted
// servers' ?api_key=). The gateway promises that no credential is stored; but a keyed
// request whose upstream connection drops stores the transport error, which net/http
// renders with the full URL, query included, in llm_calls.error, in plain text.
func TestAttackQueryStringCredentialIsNotStoredInTheLedger(t *testing.T) {
	t.Parallel()
	const secret = "AIzaSy-query-credential-0123456789"
	drop := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close() // the connection drops before any answer
		}
	})
	url, pool, logs := attackGateway(t, drop)
	code, _, body := rawPost(t, url+"/chat/completions?key="+secret, chatBody, http.Header{"Idempotency-Key": {"query-cred-key-000001"}})
	if code != http.StatusBadGateway {
		t.Fatalf("dropped upstream: %d %s, want 502", code, body)
	}
	var stored string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(coalesce(error, ''), ' '), '') FROM llm_calls`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(stored, secret) {
		t.Errorf("llm_calls.error stores the query-string credential: %q", stored)
	}
	if strings.Contains(logs.String(), secret) || strings.Contains(string(body), secret) {
		t.Errorf("the query-string credential reached the logs or the answer")
	}
}

// A model's answer may contain U+0000 (JSON "\u0000" is valid, and a prompt can ask for
// it). PostgreSQL's jsonb refuses that escape, so the gateway cannot record the answer:
// it passes it on unrecorded and leaves the row in flight, and the caller's retry with
// the same key gets 409 and then, once the lease runs out, a second generation: the
// exactly-once promise is broken by the content of one answer.
func TestAttackAnswerWithNULIsRecordedAndReplayed(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"chatcmpl-nul","object":"chat.completion","created":1,"model":"gpt-4.1-mini",`+
			`"choices":[{"index":0,"message":{"role":"assistant","content":"a\u0000b"},"finish_reason":"stop"}],`+
			`"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	url, _, _ := attackGateway(t, upstream)
	h := http.Header{"Idempotency-Key": {"nul-answer-key-000001"}, "Authorization": {"Bearer sk-alice"}}
	code1, _, b1 := rawPost(t, url+"/chat/completions", chatBody, h)
	if code1 != http.StatusOK {
		t.Fatalf("first: %d %s", code1, b1)
	}
	code2, replayed, b2 := rawPost(t, url+"/chat/completions", chatBody, h)
	if code2 != http.StatusOK || replayed != "true" || !bytes.Equal(b1, b2) {
		t.Fatalf("retry of an answer holding \\u0000: %d replayed=%q %s; want the recorded answer replayed", code2, replayed, b2)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("upstream called %d times", n)
	}
}

// The gateway forwards /v1/REST to Upstream + REST, "the caller chooses only the path
// below it". net/http's ServeMux (as `onceflow gateway` mounts it) cleans "/v1/../x"
// but not its escaped spellings: /v1/%2e%2e/x reaches the handler as Path "/v1/../x",
// and the gateway sends the dot segments on, so a caller escapes ONCEFLOW_LLM_BASE_URL's
// path (another tenant's or deployment's prefix on a shared host, an admin route).
func TestAttackDotSegmentsDoNotEscapeTheUpstreamPath(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var paths []string
	ups := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{}`)
	}))
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/tenant-a/v1", DB: pool, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux() // as cmd/onceflow mounts it (internal/httpapi's mux)
	mux.Handle("/v1/", g)
	gs := httptest.NewServer(mux)
	t.Cleanup(gs.Close)
	for i, p := range []string{"/v1/%2e%2e/%2e%2e/tenant-b/v1/chat/completions", "/v1/..%2f..%2fadmin"} {
		for _, keyed := range []bool{false, true} {
			h := http.Header{"Authorization": {"Bearer sk-alice"}}
			if keyed {
				h.Set("Idempotency-Key", "dot-segment-key-00000"+string(rune('0'+i)))
			}
			rawPost(t, gs.URL+p, chatBody, h)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, p := range paths {
		if !strings.HasPrefix(p, "/tenant-a/v1/") || strings.Contains(p, "..") {
			t.Errorf("the upstream was asked for %q, outside /tenant-a/v1/", p)
		}
	}
}

// vLLM, the usual self-hosted OpenAI-compatible upstream, reports a failure inside a
// started stream as an error event and still ends it with data: [DONE] (its
// serving_chat: `yield f"data: {error}"` then `yield "data: [DONE]"`). The gateway judges
// completeness by the last event only, so it records that failed generation as complete
// and replays the error to every retry of the key for ONCEFLOW_LEDGER_RETENTION: the
// caller can never get an answer with that key. A stream carrying an error event is not
// a complete answer.
func TestAttackStreamWithAnErrorEventBeforeDONEIsNotRecorded(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}`+"\n\n"+
			`data: {"error":{"object":"error","message":"CUDA out of memory","type":"InternalServerError","param":null,"code":500}}`+"\n\n"+
			"data: [DONE]\n\n")
	})
	url, _, _ := attackGateway(t, upstream)
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"Say one random word."}]}`
	h := http.Header{"Idempotency-Key": {"vllm-error-key-000001"}, "Authorization": {"Bearer sk-alice"}}
	rawPost(t, url+"/chat/completions", body, h)
	_, replayed, b := rawPost(t, url+"/chat/completions", body, h)
	if replayed == "true" || calls.Load() != 2 {
		t.Fatalf("the retry got the failed stream replayed (%d upstream calls): %.200s", calls.Load(), b)
	}
}
