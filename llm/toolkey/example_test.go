package toolkey_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
)

// A model answer asks for a refund; the step that executes it is retried (its first
// run died after the refund went out), and the model, asked again, returns the same
// call with a new id, as most providers do. Keyed with ArgsKey, the downstream payment
// service sees one key twice and refunds once.
func ExampleArgsKey() {
	// The downstream service honours Idempotency-Key: one effect per key.
	var mu sync.Mutex
	refunds := map[string]int{}
	payments := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		key := r.Header.Get("Idempotency-Key")
		if refunds[key] > 0 {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		refunds[key]++
		w.WriteHeader(http.StatusOK)
	}))
	defer payments.Close()

	// The model request's key, derived from the work (ledger.Key does this).
	requestKey := "llm-job-42-refund-step"
	answers := []llm.ToolCall{
		{ID: "call_Yx81", Name: "refund", Arguments: `{"order": "A-17", "amount": 10}`},
		{ID: "call_Q2rM", Name: "refund", Arguments: `{"amount":10.0,"order":"A-17"}`}, // the retry's answer
	}
	for _, call := range answers {
		key := toolkey.ArgsKey(requestKey, call)
		req, _ := http.NewRequest(http.MethodPost, payments.URL+"/refunds", strings.NewReader(call.Arguments))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		resp.Body.Close()
		fmt.Println("replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("distinct refunds:", len(refunds))
	fmt.Println("ids stable:", toolkey.Compare(answers[:1], answers[1:]))
	// Output:
	// replayed: false
	// replayed: true
	// distinct refunds: 1
	// ids stable: unstable
}
