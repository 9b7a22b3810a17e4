package onceflow_test

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow"
)

// TriageTicket is a job kind: triage a support ticket.
type TriageTicket struct {
	TicketID string `json:"ticket_id"`
}

func (TriageTicket) Kind() string { return "ticket.triage" }

// The ticket and the job that triages it commit together: if the transaction rolls
// back, there is no job; once it commits, Run's relay moves the job to its queue.
func ExampleClient_EnqueueTx() {
	rdb, prefix, db, done := exampleStores(`CREATE TABLE tickets (id text PRIMARY KEY, subject text, priority text)`)
	defer done()

	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[TriageTicket](func(ctx context.Context, job *onceflow.Job[TriageTicket]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`UPDATE tickets SET priority = 'high' WHERE id = $1`, job.Args.TicketID)
			c.Result(map[string]string{"priority": "high"})
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

	tx, err := db.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO tickets (id, subject) VALUES ($1, $2)`, "T-42", "Refund please"); err != nil {
		panic(err)
	}
	res, err := client.EnqueueTx(ctx, tx, TriageTicket{TicketID: "T-42"}, &onceflow.EnqueueOpts{Key: "T-42", Tenant: "acme"})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	st := waitDone(client, "acme", res.JobID)
	var priority string
	_ = db.QueryRow(ctx, `SELECT priority FROM tickets WHERE id = 'T-42'`).Scan(&priority)
	fmt.Println(st.Status, string(st.Result), priority)
	// Output: done {"priority": "high"} high
}
