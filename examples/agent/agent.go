package main

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"net/http"
	"net/mail"
	"regexp"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// SupportRequest is a customer's message about an order, the job's arguments: Order
// from the path of POST /v1/orders/{order}/support, Message and Email from its body.
type SupportRequest struct {
	Order   string `json:"order"`
	Message string `json:"message"`
	Email   string `json:"email"`
}

// Kind routes requests to the agent; EnqueueOpts puts them on the agent queue.
func (SupportRequest) Kind() string                      { return "agent.support" }
func (SupportRequest) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "agent"} }

// LookupArgs are lookup_order's arguments.
type LookupArgs struct {
	Order string `json:"order" jsonschema:"the order id"`
}

// RefundArgs are issue_refund's arguments and the payments API's body.
type RefundArgs struct {
	Order  string `json:"order" jsonschema:"the order id"`
	Amount int    `json:"amount" jsonschema:"the amount to refund, in cents"`
}

// Reply is the email the mailer sends.
type Reply struct {
	To   string `json:"to"`
	Body string `json:"body"`
}

// Options is what the host gives the workflow.
type Options struct {
	Tenant        func(*http.Request) (string, error) // a customer's API key: its tenant; required
	Operator      func(*http.Request) (string, error) // an admin key: the tenant it decides for; required
	Model         string                              // default: the model client's
	Shop          *Shop                               // the orders and payments APIs the tools call; required
	Mailer        outbox.Sender                       // receives "email.reply"
	ApprovalAbove int                                 // a refund of more cents waits for an operator
	Queue         onceflow.QueueConfig                // the agent queue's settings
}

//go:embed migrations/*.sql
var sqlFiles embed.FS

const prompt = "You are a shop's support agent: look the order up first; refund at most what was paid, and only when asked."

var orderID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// Workflow is the support agent: its queue, worker, sender, table and routes.
func Workflow(o Options) onceflow.Workflow {
	return onceflow.Workflow{
		Name:   "agent",
		Queues: map[string]onceflow.QueueConfig{"agent": o.Queue},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[SupportRequest](o.work))
		},
		Senders:    map[string]outbox.Sender{"email.reply": o.Mailer},
		Migrations: &migrations.Source{FS: sqlFiles, Dir: "migrations", Table: "agent_migrations"},
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			post, err := onceflow.Route(c, onceflow.RouteConfig[SupportRequest]{Tenant: o.Tenant, Args: orderFromPath, Validate: validate,
				Location: func(_ *http.Request, id string) string { return "/v1/jobs/" + id }})
			if err != nil {
				return err
			}
			mux.Handle("POST /v1/orders/{order}/support", post)
			mux.Handle("GET /v1/jobs/{job_id}", onceflow.StateHandler(c, o.Tenant))
			mux.Handle("GET /v1/jobs/{job_id}/events", onceflow.EventsHandler(c, o.Tenant, onceflow.EventsConfig{}))
			approvals := onceflow.ApprovalsHandler(c, o.Operator) // admin keys: list, approve, reject
			mux.Handle("GET /v1/approvals", approvals)
			mux.Handle("POST /v1/jobs/{job_id}/approvals/{key}/{decision}", approvals)
			return nil
		},
	}
}

func orderFromPath(r *http.Request, s *SupportRequest) error {
	if s.Order != "" {
		return errors.New("order: named by the path, not the body")
	}
	if s.Order = r.PathValue("order"); !orderID.MatchString(s.Order) {
		return errors.New("order: 1 to 64 characters of A-Z a-z 0-9 _ -")
	}
	return nil
}

func validate(s *SupportRequest) error {
	if _, err := mail.ParseAddress(s.Email); err != nil {
		return errors.New("email: not an email address")
	}
	if s.Message == "" || len(s.Message) > 8000 {
		return errors.New("message: 1 to 8000 characters")
	}
	return nil
}

// work runs the agent (its turns streamed, each turn and tool call recorded, so a
// redelivery replays them), then commits the reply row and the reply email at once.
func (o Options) work(ctx context.Context, job *onceflow.Job[SupportRequest]) error {
	a := job.Args
	res, err := onceflow.RunAgent(ctx, job, onceflow.AgentConfig{Stream: true, Tools: o.tools(job.Tenant, a.Order),
		Request: &llm.Request{Model: o.Model, MaxTokens: 600, Messages: []llm.Message{{Role: llm.RoleSystem, Content: prompt},
			{Role: llm.RoleUser, Content: fmt.Sprintf("Order %s. %s", a.Order, a.Message)}}}})
	if err != nil {
		return err // as it is: a refund waiting for approval parks the job
	}
	return job.Commit(ctx, func(c *onceflow.Commit) error {
		c.Exec(`INSERT INTO replies (job_id, tenant, order_id, to_addr, body) VALUES ($1, $2, $3, $4, $5)`,
			job.ID, job.Tenant, a.Order, a.Email, res.Answer)
		c.Emit("email.reply", "reply:"+job.ID, Reply{To: a.Email, Body: res.Answer})
		c.Result(map[string]any{"reply": res.Answer, "tool_calls": res.ToolCalls})
		return nil
	})
}

// tools are the agent's tools for customer's (the tenant's) order: any other order is
// refused (the model reads why); a refund above ApprovalAbove waits for an operator.
func (o Options) tools(customer, order string) []onceflow.AgentTool {
	lookup := onceflow.MustTool("lookup_order", "Look an order up: its items, amount paid and status.",
		func(ctx context.Context, _ string, args LookupArgs) (string, error) {
			if args.Order != order {
				return "error: this conversation is about order " + order + " only", nil
			}
			return o.Shop.Order(ctx, customer, order)
		})
	refund := onceflow.MustTool("issue_refund", "Refund an order, in cents.",
		func(ctx context.Context, key string, args RefundArgs) (string, error) {
			if args.Order != order || args.Amount <= 0 {
				return "error: refunds are of order " + order + " only, by a positive amount", nil
			}
			return o.Shop.Refund(ctx, customer, key, args) // key: the payments API's Idempotency-Key
		})
	return []onceflow.AgentTool{lookup, onceflow.NeedsApproval(refund, func(a RefundArgs) bool { return a.Amount > o.ApprovalAbove })}
}
