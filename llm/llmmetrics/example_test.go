package llmmetrics_test

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/llmmetrics"
	"github.com/onceflow/onceflow/retry"
)

// Count a program's model calls and retries on its own registry: wrap the provider's
// client, and give OnRetry to the retry policy.
func ExampleMetrics_Instrument() {
	reg := prometheus.NewRegistry() // or prometheus.DefaultRegisterer
	m := llmmetrics.New(reg)
	model := m.Instrument("openai", fake.New()) // a fixed provider name: bounded labels

	req := &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise: numbers are up."}}}
	_, err := retry.Do(context.Background(), retry.Policy{OnRetry: m.OnRetry}, retry.After(time.Minute),
		func(ctx context.Context) (*llm.Response, error) { return model.Complete(ctx, req) })
	if err != nil {
		panic(err)
	}
	families, _ := reg.Gather()
	for _, f := range families {
		if f.GetName() != "onceflow_llm_calls_total" {
			continue
		}
		for _, s := range f.GetMetric() {
			if v := s.GetCounter().GetValue(); v > 0 {
				fmt.Println(f.GetName(), s.GetLabel()[0].GetValue(), s.GetLabel()[1].GetValue(), v)
			}
		}
	}
	// Output: onceflow_llm_calls_total ok openai 1
}
