package fake_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

func req(text string) *llm.Request {
	return &llm.Request{Messages: []llm.Message{{Role: llm.RoleSystem, Content: "be brief"}, {Role: llm.RoleUser, Content: text}}}
}

func TestFakeAnswersTheSameRequestAlikeAndAnotherDifferently(t *testing.T) {
	t.Parallel()
	c := fake.New()
	ctx := context.Background()
	a, err := c.Complete(ctx, req("Summarise for the account team:\n\nThe March invoice was charged twice and the customer wants a refund."))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := c.Complete(ctx, req("Summarise for the account team:\n\nThe March invoice was charged twice and the customer wants a refund."))
	other, _ := c.Complete(ctx, req("Something else entirely."))
	if a.ID != b.ID || a.Content != b.Content || string(a.Raw) != string(b.Raw) {
		t.Fatalf("same request, different answers: %+v / %+v", a, b)
	}
	if other.ID == a.ID || other.Content == a.Content {
		t.Fatal("different requests, same answer")
	}
	if !strings.HasPrefix(a.Content, "Summary ") || !strings.Contains(a.Content, "The March invoice") || strings.Contains(a.Content, "Summarise") {
		t.Fatalf("summary %q", a.Content)
	}
	var raw struct {
		ID      string `json:"id"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(a.Raw, &raw); err != nil || raw.ID != a.ID || raw.Choices[0].Message.Content != a.Content {
		t.Fatalf("Raw is not the OpenAI JSON of the answer: %s (%v)", a.Raw, err)
	}
	if c.Calls() != 3 || len(c.Requests()) != 3 {
		t.Fatalf("calls %d", c.Calls())
	}
}

func TestStreamMatchesComplete(t *testing.T) {
	t.Parallel()
	c := fake.New()
	r := req("one two three four five")
	want, _ := c.Complete(context.Background(), r)
	got, err := llm.Collect(c.Stream(context.Background(), r))
	if err != nil || got.Content != want.Content || got.ID != want.ID || got.FinishReason != llm.FinishStop || got.Usage != want.Usage {
		t.Fatalf("stream %+v (%v), complete %+v", got, err, want)
	}
}

func TestFakeCallsTheFirstToolWithArgumentsFittingItsSchema(t *testing.T) {
	t.Parallel()
	r := req("Refund order 42 for jane@example.com")
	r.Tools = []llm.Tool{{Name: "issue_refund", Parameters: json.RawMessage(`{"type":"object","properties":{"order":{"type":"integer"},"email":{"type":"string"},"notify":{"type":"boolean"}}}`)},
		{Name: "other"}}
	resp := fake.Answer(r)
	if resp.FinishReason != llm.FinishToolCalls || len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Name != "issue_refund" || resp.ToolCalls[0].ID == "" {
		t.Fatalf("answer %+v", resp)
	}
	var args map[string]any
	if err := json.Unmarshal([]byte(resp.ToolCalls[0].Arguments), &args); err != nil {
		t.Fatal(err)
	}
	if args["order"] != float64(5) || args["notify"] != true || !strings.HasPrefix(args["email"].(string), "Summary ") {
		t.Fatalf("arguments %v", args)
	}
	if again := fake.Answer(r); again.ToolCalls[0] != resp.ToolCalls[0] {
		t.Fatal("tool call not deterministic")
	}
}

func TestScriptedErrorsAndContext(t *testing.T) {
	t.Parallel()
	c := fake.New()
	boom := errors.New("boom")
	c.FailNext(boom, nil)
	if _, err := c.Complete(context.Background(), req("x")); !errors.Is(err, boom) {
		t.Fatalf("first call: %v", err)
	}
	if _, err := c.Complete(context.Background(), req("x")); err != nil {
		t.Fatalf("second call: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Complete(ctx, req("x")); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	if _, err := llm.Collect(c.Stream(ctx, req("x"))); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled stream: %v", err)
	}
}

func TestSummaryEdges(t *testing.T) {
	t.Parallel()
	if s := fake.Summary(""); !strings.Contains(s, "(empty text)") {
		t.Fatalf("empty: %q", s)
	}
	long := strings.Repeat("word ", 100)
	if s := fake.Summary(long); !strings.Contains(s, "…") || !strings.Contains(s, "(100 words)") {
		t.Fatalf("long: %q", s)
	}
	if fake.ToolArguments(json.RawMessage(`not json`), "x") != "{}" {
		t.Fatal("bad schema should give {}")
	}
}
