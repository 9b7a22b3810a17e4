package onceflow_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
)

// exampleTenant is the examples' authentication: the API key decides the tenant.
func exampleTenant(r *http.Request) (string, error) {
	if r.Header.Get("Authorization") == "Bearer acme-api-key" {
		return "acme", nil
	}
	return "", idempotency.ErrUnauthenticated
}

// exampleCall sends method url with acme's API key and a JSON body (none for "") and
// returns the status and the body.
func exampleCall(method, url, body string) (int, string) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer acme-api-key")
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// A payment provider's webhook (or the app's own backend) signals the job that waits for
// the payment: the POST's body is the payload WaitSignal returns. The same POST again is
// answered as the first; another tenant's job is a 404.
func ExampleSignalHandler() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	got := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		payment, err := onceflow.WaitSignal(ctx, job, "payment", 24*time.Hour)
		if err != nil {
			return err // while the signal has not come: the job parks, holding no worker
		}
		got <- string(payment)
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/jobs/{job_id}/signals/{name}", onceflow.SignalHandler(client, exampleTenant))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	defer runExample(client)()
	res, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, &onceflow.EnqueueOpts{Tenant: "acme", JobID: "order-a-1"})
	if err != nil {
		log.Fatal(err)
	}
	url := srv.URL + "/v1/jobs/" + res.JobID + "/signals/payment"
	fmt.Println(exampleCall("POST", url, `{"cents": 1250, "card": "visa"}`))
	fmt.Println("the job got:", <-got)
	fmt.Println(exampleCall("POST", url, `{"cents": 1250, "card": "visa"}`))
	fmt.Println(exampleCall("POST", srv.URL+"/v1/jobs/order-b-2/signals/payment", `{}`))
	// Output:
	// 202 {"job_id":"order-a-1","signal":"payment","status":"signalled"}
	// the job got: {"cents":1250,"card":"visa"}
	// 202 {"job_id":"order-a-1","signal":"payment","status":"signalled"}
	// 404 {"detail":"no such job"}
}

// An app shows its users the refunds their agent asks to make, and lets them decide:
// GET lists the tenant's pending calls, POST approves one, and the job runs the refund
// once.
func ExampleApprovalsHandler() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("issue_refund", orderRef{Order: "A-1"})}},
		{Text: "Refunded."},
	}}
	refund := onceflow.NeedsApproval(
		onceflow.MustTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args orderRef) (string, error) {
			return `{"status":"succeeded"}`, nil
		}),
		func(orderRef) bool { return true },
	)
	answers := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[supportTicket](func(ctx context.Context, job *onceflow.Job[supportTicket]) error {
		res, err := onceflow.RunAgent(ctx, job, onceflow.AgentConfig{
			Request: &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Refund order " + job.Args.Order}}},
			Tools:   []onceflow.AgentTool{refund},
		})
		if err != nil {
			return err
		}
		answers <- res.Answer
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers, Model: model})
	if err != nil {
		log.Fatal(err)
	}
	approvals := onceflow.ApprovalsHandler(client, exampleTenant)
	mux := http.NewServeMux()
	mux.Handle("GET /v1/approvals", approvals)
	mux.Handle("POST /v1/jobs/{job_id}/approvals/{key}/{decision}", approvals)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	defer runExample(client)()
	if _, err := client.Enqueue(context.Background(), supportTicket{Order: "A-1"}, &onceflow.EnqueueOpts{Tenant: "acme"}); err != nil {
		log.Fatal(err)
	}
	var list struct {
		Approvals []onceflow.Approval `json:"approvals"`
	}
	for len(list.Approvals) == 0 {
		time.Sleep(20 * time.Millisecond)
		_, body := exampleCall("GET", srv.URL+"/v1/approvals", "")
		if err := json.Unmarshal([]byte(body), &list); err != nil {
			log.Fatal(err)
		}
	}
	a := list.Approvals[0]
	fmt.Println("asked:", a.Tool, a.Arguments)
	status, body := exampleCall("POST", srv.URL+"/v1/jobs/"+a.JobID+"/approvals/"+a.Key+"/approve", `{"by": "ann@acme.example"}`)
	var d onceflow.Decision
	_ = json.Unmarshal([]byte(body), &d)
	fmt.Println(status, "approved:", d.Approved, "by", d.By)
	fmt.Println(<-answers)
	// Output:
	// asked: issue_refund {"order":"A-1"}
	// 200 approved: true by ann@acme.example
	// Refunded.
}

// CheckDecision applies the bounds every surface applies to who decided and the note.
func ExampleCheckDecision() {
	fmt.Println(onceflow.CheckDecision("ann@acme.example", "the customer called"))
	fmt.Println(onceflow.CheckDecision("ann\nroot", ""))
	fmt.Println(onceflow.CheckDecision("ann", strings.Repeat("x", onceflow.MaxDecisionNote+1)))
	// Output:
	// <nil>
	// by: must be text without control characters
	// note: too long: 2001 characters, at most 2000
}
