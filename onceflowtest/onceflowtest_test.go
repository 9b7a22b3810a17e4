package onceflowtest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
)

// The fake model counts every request, held or answered, and calls the tool it is
// told to call.
func TestFakeLLMHoldsCountsAndCallsTheScriptedTool(t *testing.T) {
	t.Parallel()
	f := onceflowtest.NewFakeLLM(t, fakeserver.Config{ToolChoice: fakeserver.CallTool("issue_refund", json.RawMessage(`{"order_id":"A-1","amount_cents":500}`))})
	req := &llm.Request{Model: "gpt-4.1-mini", MaxTokens: 50, Messages: []llm.Message{{Role: llm.RoleUser, Content: "refund A-1"}},
		Tools: []llm.Tool{{Name: "issue_refund", Parameters: json.RawMessage(`{"type":"object"}`)}}}
	f.Hold()
	got := make(chan *llm.Response, 1)
	go func() {
		resp, err := f.Client().Complete(context.Background(), req)
		if err != nil {
			t.Error(err)
		}
		got <- resp
	}()
	f.WaitRequests(t, 1, 10*time.Second)
	select {
	case <-got:
		t.Fatal("a held request was answered")
	case <-time.After(50 * time.Millisecond):
	}
	f.Release()
	resp := <-got
	if resp == nil || len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Name != "issue_refund" || resp.ToolCalls[0].Arguments != `{"order_id":"A-1","amount_cents":500}` {
		t.Fatalf("answer %+v, want the scripted call", resp)
	}
	if n := f.Requests(); n != 1 {
		t.Fatalf("%d requests counted, want 1", n)
	}
}

// The sink counts POSTs per key; a repeated key is two deliveries of one key.
func TestSinkCountsDeliveriesPerKey(t *testing.T) {
	t.Parallel()
	s := onceflowtest.NewSink(t)
	for _, key := range []string{"a", "b", "a"} {
		req, _ := http.NewRequest(http.MethodPost, s.URL, bytes.NewReader([]byte(`{"n":1}`)))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if s.Total() != 3 || s.Count("a") != 2 || s.Count("b") != 1 || len(s.Keys()) != 2 || len(s.Deliveries()) != 3 {
		t.Fatalf("total %d, a %d, b %d, keys %v", s.Total(), s.Count("a"), s.Count("b"), s.Keys())
	}
}

// PauseWrites holds writes on a private Redis until resumed; reads go on.
func TestPrivateRedisPauseWrites(t *testing.T) {
	t.Parallel()
	r := onceflowtest.PrivateRedis(t)
	ctx := context.Background()
	resume := r.PauseWrites(t)
	done := make(chan error, 1)
	go func() { done <- r.Client.Set(ctx, "k", "v", 0).Err() }()
	select {
	case err := <-done:
		t.Fatalf("a write went through the pause: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	resume()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v, err := r.Client.Get(ctx, "k").Result(); err != nil || v != "v" {
		t.Fatalf("get: %q %v", v, err)
	}
}
