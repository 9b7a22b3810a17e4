package anthropic_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"slices"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// Send two requests as a message batch to fake-llm (here in-process; `onceflow
// fake-llm` serves the same API), wait until it has ended, and read its results, which
// come in any order. onceflow's batch lane does this for the steps that ask for it
// (onceflow.InBatch), with the batch API in onceflow.Config.Batch.API.
func ExampleClient_Batches() {
	fakeLLM, _ := fakeserver.New(fakeserver.Config{BatchDelay: 100 * time.Millisecond})
	srv := httptest.NewServer(fakeLLM)
	defer srv.Close()
	defer fakeLLM.Close()

	ctx := context.Background()
	batches := anthropic.New(anthropic.Config{BaseURL: srv.URL, APIKey: "sk-ant-anything", Model: "claude-haiku-4-5"}).Batches()
	sub := llm.BatchSubmission{Model: "claude-haiku-4-5"}
	for i, text := range []string{"The March invoice was charged twice.", "The export times out after a minute."} {
		sub.Items = append(sub.Items, llm.BatchItem{CustomID: fmt.Sprint("ticket-", i),
			Request: &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise: " + text}}}})
	}
	info, err := batches.Submit(ctx, sub)
	for err == nil && !info.Ended {
		time.Sleep(50 * time.Millisecond)
		info, err = batches.Get(ctx, info.ID)
	}
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	var lines []string
	for r, err := range batches.Results(ctx, info.ID) {
		if err != nil {
			fmt.Println("error:", err)
			return
		}
		text := r.Error // errored, expired, canceled: made in the synchronous lane instead
		if r.Outcome == llm.BatchSucceeded {
			text = r.Response.Content
		}
		lines = append(lines, fmt.Sprintf("%s %s: %s", r.CustomID, r.Outcome, text))
	}
	slices.Sort(lines)
	fmt.Println(info.Status, info.Items)
	for _, l := range lines {
		fmt.Println(l)
	}
	// Output:
	// ended 2
	// ticket-0 succeeded: Summary e5c3f687: Summarise: The March invoice was charged twice. (7 words)
	// ticket-1 succeeded: Summary 1f8dc92d: Summarise: The export times out after a minute. (8 words)
}
