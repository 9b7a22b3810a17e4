package onceflow_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// A sender per topic: refunds go to the payments API as their payload alone, with the
// dedupe key as Idempotency-Key; every "email." topic goes to the mailer. An effect
// whose topic has no sender here waits in the outbox for a process that has one.
func ExampleConfig_senders() {
	rdb, prefix, db, done := exampleStores(`SELECT 1`)
	defer done()

	received := make(chan string, 1)
	payments := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		received <- r.Header.Get("Idempotency-Key") + " " + string(body)
	}))
	defer payments.Close()
	paymentsAPI, err := webhook.New(webhook.Config{URL: payments.URL, Body: webhook.PayloadOnly})
	if err != nil {
		panic(err)
	}
	mailer := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error { return nil }) // your SMTP sender

	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(ctx context.Context, job *onceflow.Job[Refund]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("payments.refund", "refund:"+job.Args.OrderID, map[string]any{"order": job.Args.OrderID, "cents": job.Args.AmountCents})
			c.Emit("email.reply", "reply:"+job.Args.OrderID, map[string]string{"to": job.Args.Email})
			return nil
		})
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers,
		Senders: map[string]outbox.Sender{"payments.refund": paymentsAPI, "email.*": mailer}})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	if _, err := client.Enqueue(ctx, Refund{OrderID: "order-9", AmountCents: 1250, Email: "ann@example.com"}, nil); err != nil {
		panic(err)
	}
	fmt.Println(<-received)
	// Output: refund:order-9 {"cents": 1250, "order": "order-9"}
}
