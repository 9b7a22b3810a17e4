package main

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/mail"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// Ticket is a support ticket, the job's arguments and the POST /v1/tickets body.
type Ticket struct {
	Customer string `json:"customer"` // the customer's email address
	OrderID  string `json:"order_id"`
	Message  string `json:"message"`
}

// Kind routes tickets to the triage worker; EnqueueOpts puts them on the triage queue.
func (Ticket) Kind() string                      { return "triage.ticket" }
func (Ticket) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "triage"} }

// Refund is the arguments of the issue_refund tool and the payments API's body.
type Refund struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
}

// Reply is the email the mailer sends.
type Reply struct {
	To   string `json:"to"`
	Body string `json:"body"`
}

// Options is what the host gives the workflow.
type Options struct {
	Tenant   func(*http.Request) (string, error) // authentication; required
	Model    string                              // default: the model client's
	Payments outbox.Sender                       // receives "payments.refund", keyed by the tool-call key
	Mailer   outbox.Sender                       // receives "email.reply"
	Queue    onceflow.QueueConfig                // the triage queue's settings
	// HoldRefundsOverCents, when above 0, holds a ticket whose refund is over it for an
	// operator before anything is written or sent (an eval gate: put Gates() in
	// Config.Gates); 0: no ticket is held. See hold.go.
	HoldRefundsOverCents int
	// Operator is the authentication of operators' admin keys (the tenant whose held
	// tickets they list and decide); required with HoldRefundsOverCents; without it the
	// operators' routes are not mounted.
	Operator func(*http.Request) (string, error)
}

//go:embed migrations/*.sql
var sqlFiles embed.FS

var refundTool = llm.Tool{Name: "issue_refund", Description: "Refund an order, in cents.",
	Parameters: json.RawMessage(`{"type":"object","properties":{"order_id":{"type":"string"},"amount_cents":{"type":"integer","minimum":1}},"required":["order_id","amount_cents"]}`)}

// triageStep is the model step's name, which the refund limit's gate checks.
const triageStep = "triage"

const prompt = "You triage support tickets. Call issue_refund only when the customer asks for their money back for the order named; otherwise answer the question."

// Workflow is the triage agent: its queue, worker, senders, tables and routes.
func Workflow(o Options) onceflow.Workflow {
	return onceflow.Workflow{
		Name:   "triage",
		Queues: map[string]onceflow.QueueConfig{"triage": o.Queue},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Ticket](o.work))
		},
		Senders:    map[string]outbox.Sender{"payments.refund": o.Payments, "email.reply": o.Mailer},
		Migrations: &migrations.Source{FS: sqlFiles, Dir: "migrations", Table: "triage_migrations"},
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			post, err := onceflow.Route(c, onceflow.RouteConfig[Ticket]{Tenant: o.Tenant, Validate: validate})
			if err != nil {
				return err
			}
			mux.Handle("POST /v1/tickets", post)
			mux.Handle("GET /v1/tickets/{job_id}", onceflow.StateHandler(c, o.Tenant))
			switch {
			case o.Operator != nil:
				o.holdRoutes(c, mux)
			case o.HoldRefundsOverCents > 0:
				return errors.New("triage: Options.Operator is required with HoldRefundsOverCents: operators decide the held tickets")
			}
			return nil
		},
	}
}

func validate(t *Ticket) error {
	if _, err := mail.ParseAddress(t.Customer); err != nil {
		return errors.New("customer: not an email address")
	}
	if t.OrderID == "" || len(t.OrderID) > 64 {
		return errors.New("order_id: 1 to 64 characters")
	}
	if t.Message == "" || len(t.Message) > 8000 {
		return errors.New("message: 1 to 8000 characters")
	}
	return nil
}

// work asks the model (once per ticket, through the ledger), then commits the triage,
// the refund (unless the order was refunded already) and the reply with their effects
// in one transaction. A refund over the limit holds the job in Job.Complete (its error,
// returned as it is, parks the job) until an operator decides.
func (o Options) work(ctx context.Context, job *onceflow.Job[Ticket]) error {
	t := job.Args
	step, err := job.Complete(ctx, triageStep, &llm.Request{Model: o.Model, MaxTokens: 400, Tools: []llm.Tool{refundTool},
		Messages: []llm.Message{{Role: llm.RoleSystem, Content: prompt},
			{Role: llm.RoleUser, Content: fmt.Sprintf("Order %s. %s", t.OrderID, t.Message)}}})
	if err != nil {
		return err
	}
	category, reply, calls := "question", step.Response.Content, step.Response.ToolCalls
	var refund Refund
	if len(calls) > 1 {
		return onceflow.Permanent(fmt.Errorf("model made %d tool calls; a ticket gets at most one refund", len(calls)))
	}
	for _, call := range calls {
		if err := decodeStrict(call.Arguments, &refund); err != nil || call.Name != refundTool.Name || refund.OrderID != t.OrderID || refund.AmountCents <= 0 {
			return onceflow.Permanent(fmt.Errorf("model called %s(%s): not a refund of order %s", call.Name, call.Arguments, t.OrderID))
		}
		category, reply = "refund", fmt.Sprintf("We refunded %d.%02d for order %s.", refund.AmountCents/100, refund.AmountCents%100, refund.OrderID)
	}
	return job.CommitTx(ctx, func(ctx context.Context, tx pgx.Tx, c *onceflow.Commit) error {
		if len(calls) == 1 { // one refund per order: another ticket's may have come first
			var refunded bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM refunds WHERE tenant = $1 AND order_id = $2)`,
				job.Tenant, refund.OrderID).Scan(&refunded); err != nil {
				return onceflow.PostgresError(err)
			}
			if refunded {
				calls, category, reply = nil, "question", fmt.Sprintf("Order %s was refunded already.", refund.OrderID)
			}
		}
		c.Exec(`INSERT INTO tickets (job_id, tenant, customer, order_id, category) VALUES ($1, $2, $3, $4, $5)`,
			job.ID, job.Tenant, t.Customer, t.OrderID, category)
		if len(calls) == 1 {
			key := step.ToolKey(calls[0]) // the same for every delivery and retried request of the step
			c.Exec(`INSERT INTO refunds (refund_key, job_id, tenant, order_id, amount_cents) VALUES ($1, $2, $3, $4, $5)`,
				key, job.ID, job.Tenant, refund.OrderID, refund.AmountCents) // a concurrent refund of the order: retried, then refunded already
			c.Emit("payments.refund", key, refund)
		}
		c.Exec(`INSERT INTO replies (job_id, to_addr, body) VALUES ($1, $2, $3)`, job.ID, t.Customer, reply)
		c.Emit("email.reply", "reply:"+job.ID, Reply{To: t.Customer, Body: reply})
		c.Result(map[string]string{"category": category, "reply": reply})
		return nil
	})
}

func decodeStrict(s string, v any) error {
	d := json.NewDecoder(bytes.NewReader([]byte(s)))
	d.DisallowUnknownFields()
	return d.Decode(v)
}
