package adminuitest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
)

// Ticket is the job kind of an AgentApp: a customer's message, whose agent asks to
// refund an order. A Legacy ticket's refund goes through an API that honours no
// idempotency key, at most once.
type Ticket struct {
	Text   string `json:"text"`
	Legacy bool   `json:"legacy,omitempty"`
}

// Kind is "ticket".
func (Ticket) Kind() string { return "ticket" }

// RefundArgs are the arguments of an AgentApp's tools, lookup_order and issue_refund.
type RefundArgs struct {
	Order string `json:"order"`
	Cents int    `json:"cents,omitempty"`
}

// AgentApp is a client of its own stores whose ticket jobs run a support agent on a
// scripted model: the model looks Order up (lookup_order), then asks to refund it
// (issue_refund, 1250 cents), which needs an operator's approval; once the call is
// decided, the model answers "Refunded." A Legacy ticket's refund instead runs at most
// once (AgentTool.AtMostOnce), and its first try times out without knowing whether it
// happened: the job goes in doubt, and an operator resolves it.
type AgentApp struct {
	Client *onceflow.Client
	Redis  *redis.Client
	DB     *pgxpool.Pool
	// Prefix and DatabaseURL are the client's Redis key prefix and the URL of its
	// PostgreSQL schema, for a process (or command) of the same deployment.
	Prefix, DatabaseURL string
	// Order is the order the model asks about (its tool calls' arguments).
	Order string

	mu      sync.Mutex
	refunds map[string]int // calls of the refund, by the call's key
}

// NewAgentApp returns an AgentApp whose model asks to refund order.
func NewAgentApp(t testing.TB, order string) *AgentApp {
	t.Helper()
	a := &AgentApp{Order: order, refunds: map[string]int{}}
	a.Redis, a.Prefix = testenv.Redis(t)
	a.DB, a.DatabaseURL = testenv.Postgres(t)
	model := &onceflowtest.ScriptedModel{RandomIDs: true, Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{{Name: "lookup_order", Arguments: rawJSON(t, RefundArgs{Order: order})}}},
		{ToolCalls: []llm.ToolCall{{Name: "issue_refund", Arguments: rawJSON(t, RefundArgs{Order: order, Cents: 1250})}}},
		{Text: "Refunded."},
	}}
	lookup := onceflow.MustTool("lookup_order", "Look an order up.", func(ctx context.Context, key string, args RefundArgs) (string, error) {
		return rawJSON(t, map[string]string{"order": args.Order, "status": "lost in transit"}), nil
	})
	refund := onceflow.MustTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args RefundArgs) (string, error) {
		return a.refund(key, false)
	})
	approved := onceflow.NeedsApproval(refund, func(RefundArgs) bool { return true })
	legacy := onceflow.MustTool("issue_refund", "Refund an order.", func(ctx context.Context, key string, args RefundArgs) (string, error) {
		return a.refund(key, true)
	})
	legacy.AtMostOnce = true
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Ticket](func(ctx context.Context, job *onceflow.Job[Ticket]) error {
		req := &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{
			{Role: llm.RoleSystem, Content: "You are a support agent. Refunds need an operator's approval."},
			{Role: llm.RoleUser, Content: job.Args.Text},
		}}
		tools := []onceflow.AgentTool{lookup, approved}
		if job.Args.Legacy {
			tools[1] = legacy
		}
		_, err := onceflow.RunAgent(ctx, job, onceflow.AgentConfig{Request: req, Tools: tools})
		return err
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: a.Redis, DB: a.DB, Prefix: a.Prefix, Workers: workers, Model: model, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Second, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	a.Client = c
	return a
}

// rawJSON encodes v as a model writes JSON: markup in a string stays as it is.
func rawJSON(t testing.TB, v any) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(b.String())
}

// refund counts a call of the refund with key; the legacy API's first call times out.
func (a *AgentApp) refund(key string, legacy bool) (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.refunds[key]++
	if legacy && a.refunds[key] == 1 {
		return "", fmt.Errorf("legacy refunds API: no answer within 30s: %w", onceflow.ErrInDoubt)
	}
	return `{"refund":"re_1","status":"succeeded"}`, nil
}

// Refunds returns how many times the refund was called with the key of a call
// (Approval.Key, InDoubtCall.Key).
func (a *AgentApp) Refunds(key string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.refunds[key]
}

// Run runs the app's client until the test ends.
func (a *AgentApp) Run(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- a.Client.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-stopped })
}

// Ask enqueues a ticket of tenant with text and waits until its refund waits for an
// approval, which it returns. The app must be running.
func (a *AgentApp) Ask(t testing.TB, tenant, text string) onceflow.Approval {
	t.Helper()
	res, err := a.Client.Enqueue(context.Background(), Ticket{Text: text}, &onceflow.EnqueueOpts{Tenant: tenant})
	if err != nil {
		t.Fatal(err)
	}
	var found onceflow.Approval
	testenv.WaitFor(t, 15*time.Second, "the refund's approval to be asked", func() bool {
		list, err := a.Client.Inspector().Approvals(context.Background(), tenant, false, 100)
		for _, ap := range list {
			if ap.JobID == res.JobID {
				found = ap
			}
		}
		return err == nil && found.JobID != ""
	})
	return found
}

// InDoubt enqueues a Legacy ticket of tenant with text and waits until its job is in
// doubt; it returns the job id and its call in doubt. The app must be running.
func (a *AgentApp) InDoubt(t testing.TB, tenant, text string) (string, onceflow.InDoubtCall) {
	t.Helper()
	res, err := a.Client.Enqueue(context.Background(), Ticket{Text: text, Legacy: true}, &onceflow.EnqueueOpts{Tenant: tenant})
	if err != nil {
		t.Fatal(err)
	}
	var st *onceflow.JobState
	testenv.WaitFor(t, 15*time.Second, "the job to be in doubt", func() bool {
		st, err = a.Client.JobState(context.Background(), tenant, res.JobID)
		return err == nil && st.Status == onceflow.StatusInDoubt && len(st.InDoubt) == 1
	})
	return res.JobID, st.InDoubt[0]
}

// WaitStatus waits until tenant's job id has status.
func (a *AgentApp) WaitStatus(t testing.TB, tenant, id string, status onceflow.Status) {
	t.Helper()
	testenv.WaitFor(t, 15*time.Second, "job "+id+" "+string(status), func() bool {
		st, err := a.Client.JobState(context.Background(), tenant, id)
		return err == nil && st.Status == status
	})
}
