package onceflow_test

import (
	"fmt"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
)

// ONCEFLOW_SHADOW's form: a share of a step's production calls also made to a
// candidate model.
func ExampleParseShadows() {
	shadows, err := onceflow.ParseShadows("summary=gpt-4.1-nano@0.25,agent.turn-1=claude-haiku-4-5@1")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, s := range shadows {
		fmt.Printf("%s on %s at %v\n", s.Step, s.Model, s.Rate)
	}
	_, err = onceflow.ParseShadows("summary=gpt-4.1-nano@2")
	fmt.Println(err)
	// Output:
	// summary on gpt-4.1-nano at 0.25
	// agent.turn-1 on claude-haiku-4-5 at 1
	// shadow of step "summary": rate 2: want 0 to 1
}

// The default comparison: the same text and the same tool calls, whatever the
// providers' call ids.
func ExampleExactMatch() {
	production := &llm.Response{ToolCalls: []llm.ToolCall{{ID: "call_a", Name: "refund", Arguments: `{"order":"A-1","cents":500}`}}}
	candidate := &llm.Response{ToolCalls: []llm.ToolCall{{ID: "toolu_b", Name: "refund", Arguments: `{"cents":500,"order":"A-1"}`}}}
	fmt.Println(onceflow.ExactMatch(production, candidate).Agree)
	fmt.Println(onceflow.ExactMatch(&llm.Response{Content: "yes"}, &llm.Response{Content: "no"}).Detail)
	// Output:
	// true
	// the text differs
}

// Structured answers compared field by field: the score is the share of the fields
// that agree.
func ExampleJSONFieldsMatch() {
	compare := onceflow.JSONFieldsMatch("label", "priority")
	c := compare(&llm.Response{Content: `{"label":"bug","priority":2,"why":"crash"}`},
		&llm.Response{Content: `{"priority":2,"label":"feature","why":"asks for more"}`})
	fmt.Println(c.Agree, c.Score, c.Detail)
	// Output: false 0.5 fields differ: label
}
