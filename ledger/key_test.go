package ledger_test

import (
	"strings"
	"testing"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

func TestKeyIsDerivedFromTheWorkAndTheRequest(t *testing.T) {
	t.Parallel()
	base := func() *llm.Request {
		return &llm.Request{Model: "gpt-4.1-mini", Temperature: llm.Float(0.2), MaxTokens: 100,
			Messages: []llm.Message{{Role: llm.RoleUser, Content: "refund order A-17"},
				{Role: llm.RoleAssistant, ToolCalls: []llm.ToolCall{{ID: "c1", Name: "refund", Arguments: `{"order":"A-17","amount":10}`}}}},
			Tools: []llm.Tool{{Name: "refund", Parameters: []byte(`{"type":"object","properties":{"order":{"type":"string"}}}`)}}}
	}
	work := ledger.Work("job-1", "refund")
	key := ledger.Key(work, base())
	if !strings.HasPrefix(key, "llm-") || len(key) != 68 {
		t.Fatalf("key %q", key)
	}
	same := base()
	same.IdempotencyKey = "attempt-7" // the attempt never enters the key
	same.Tools[0].Parameters = []byte("{ \"properties\": {\"order\": {\"type\": \"string\"}}, \"type\": \"object\" }")
	same.Messages[1].ToolCalls[0].Arguments = `{"amount":10.0,"order":"A-17"}`
	if ledger.Key(work, same) != key {
		t.Error("re-encoded JSON inside the request, or the IdempotencyKey, changed the key")
	}
	for name, change := range map[string]func(r *llm.Request){
		"model":       func(r *llm.Request) { r.Model = "gpt-4.1" },
		"message":     func(r *llm.Request) { r.Messages[0].Content += "!" },
		"role":        func(r *llm.Request) { r.Messages[0].Role = llm.RoleSystem },
		"temperature": func(r *llm.Request) { r.Temperature = llm.Float(0.3) },
		"no temp":     func(r *llm.Request) { r.Temperature = nil },
		"max tokens":  func(r *llm.Request) { r.MaxTokens = 101 },
		"tool":        func(r *llm.Request) { r.Tools[0].Name = "charge" },
		"tool args":   func(r *llm.Request) { r.Messages[1].ToolCalls[0].Arguments = `{"order":"A-18","amount":10}` },
	} {
		r := base()
		change(r)
		if ledger.Key(work, r) == key {
			t.Errorf("changing the %s kept the key", name)
		}
	}
	if ledger.Key(ledger.Work("job-2", "refund"), base()) == key || ledger.Key(ledger.Work("job-1", "refund2"), base()) == key {
		t.Error("another job or step has the same key")
	}
	if ledger.Work("a/b", "c") == ledger.Work("b", "c/a") || ledger.Work("x", "a/b") == ledger.Work("b/x", "a") {
		t.Error("Work is ambiguous")
	}
}
