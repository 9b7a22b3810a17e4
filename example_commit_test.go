package onceflow_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow"
)

// Refund is a job kind: refund an order and tell the customer.
type Refund struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
	Email       string `json:"email"`
}

func (Refund) Kind() string { return "refund" }

// The job's row, the payment and the email commit in one transaction, once per job
// however often it is delivered: no ON CONFLICT to write, and a redelivered job's
// Commit returns nil, so the Worker just returns it.
func ExampleJob_Commit() {
	rdb, prefix, db, done := exampleStores(`CREATE TABLE refunds (job_id text PRIMARY KEY, order_id text, amount_cents int)`)
	defer done()

	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(ctx context.Context, job *onceflow.Job[Refund]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO refunds (job_id, order_id, amount_cents) VALUES ($1, $2, $3)`,
				job.ID, job.Args.OrderID, job.Args.AmountCents)
			c.Emit("payments.refund", "refund:"+job.ID, job.Args) // sent by Config.Senders
			c.Emit("email.reply", "reply:"+job.ID, map[string]string{"to": job.Args.Email})
			c.Result(map[string]int{"refunded_cents": job.Args.AmountCents})
			return nil
		})
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	res, err := client.Enqueue(ctx, Refund{OrderID: "order-9", AmountCents: 1250, Email: "ann@example.com"},
		&onceflow.EnqueueOpts{Key: "ticket-42", Tenant: "acme"})
	if err != nil {
		panic(err)
	}
	st := waitDone(client, "acme", res.JobID)
	fmt.Println(st.Status, string(st.Result))
	// Output: done {"refunded_cents": 1250}
}

// A job that must read inside its transaction uses CommitTx: fn runs only for the
// delivery whose completion record won, with the transaction open.
func ExampleJob_CommitTx() {
	rdb, prefix, db, done := exampleStores(`CREATE TABLE accounts (id text PRIMARY KEY, balance int);
		INSERT INTO accounts VALUES ('acme', 5000)`)
	defer done()

	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(ctx context.Context, job *onceflow.Job[Refund]) error {
		return job.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
			var balance int
			if err := tx.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = $1 FOR UPDATE`, job.Tenant).Scan(&balance); err != nil {
				return err
			}
			if balance < job.Args.AmountCents {
				return onceflow.Permanent(fmt.Errorf("balance %d is below the refund", balance))
			}
			c.Exec(`UPDATE accounts SET balance = balance - $1 WHERE id = $2`, job.Args.AmountCents, job.Tenant)
			c.Emit("payments.refund", "refund:"+job.ID, job.Args)
			c.Result(map[string]int{"balance": balance - job.Args.AmountCents})
			return nil
		})
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	res, err := client.Enqueue(ctx, Refund{OrderID: "order-9", AmountCents: 1250}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		panic(err)
	}
	st := waitDone(client, "acme", res.JobID)
	fmt.Println(st.Status, string(st.Result))
	// Output: done {"balance": 3750}
}
