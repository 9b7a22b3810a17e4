package summaries_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/summaries"
)

// The summaries service is one workflow on an onceflow.Client: its queue, its worker,
// its routes (Mount) and its audit. The host supplies the authentication; here every
// request is tenant acme's.
func ExampleWorkflow() {
	rdb, prefix, db, done := exampleStores()
	defer done()

	emails := make(chan string, 1)
	client, err := onceflow.NewClient(onceflow.Config{
		Redis: rdb, DB: db, Prefix: prefix, Model: fake.New(), Provider: "fake",
		Senders: map[string]outbox.Sender{summaries.TopicSummaryReady: outbox.SenderFunc(
			func(_ context.Context, m outbox.Message) error { emails <- m.DedupeKey; return nil })},
		Workflows: []onceflow.Workflow{summaries.Workflow(summaries.Options{
			Tenant: func(*http.Request) (string, error) { return "acme", nil },
		})},
	})
	must(err)
	mux := http.NewServeMux()
	must(client.Mount(mux))
	api := httptest.NewServer(mux)
	defer api.Close()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	req, _ := http.NewRequest("POST", api.URL+"/v1/summaries",
		strings.NewReader(`{"text": "Q3 review: revenue grew 12%.", "notify": "team@example.com"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "order-7f3c2a91-0001")
	resp, err := http.DefaultClient.Do(req)
	must(err)
	resp.Body.Close()
	loc := resp.Header.Get("Location")
	fmt.Println(resp.StatusCode, loc)
	fmt.Println(<-emails == summaries.DedupeKey(strings.TrimPrefix(loc, "/v1/summaries/")))

	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		resp, err := http.Get(api.URL + loc)
		must(err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(body), `"done"`) {
			fmt.Println(resp.StatusCode, strings.Contains(string(body), `"summary":`))
			break
		}
	}
	// Output:
	// 202 /v1/summaries/939491ce-6447-51a8-8a71-a625fd0a16a4
	// true
	// 200 true
}
