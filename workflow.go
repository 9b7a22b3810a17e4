package onceflow

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"

	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// A Workflow bundles what one of a program's workflows brings to a Client and to the
// host that runs it (the user's own main, or package cli's subcommands): its queues, its
// workers, its senders, its tables, its HTTP routes and its audit. Pass it in
// Config.Workflows; the fields are all optional, except Name.
//
// The two phases follow River and asynq: what the Client needs to run jobs (Queues,
// Workers, Senders) is merged into its Config by NewClient; what needs the Client
// (Routes) is called by Client.Mount once it exists.
type Workflow struct {
	// Name identifies the workflow in logs, in `onceflow audit` and in errors: 1 to 64
	// characters of a-z 0-9 _ . - ("summaries", "triage"). Required.
	Name string
	// Queues are the queues the workflow's kinds run on, with their settings, merged
	// into Config.Queues (a queue both name must have the same settings, or NewClient
	// fails).
	Queues map[string]QueueConfig
	// Workers registers the workflow's workers (AddWorker) into ws, before the Client
	// is built. A kind registered twice, by two workflows or by a workflow and
	// Config.Workers, is an error.
	Workers func(ws *Workers) error
	// Senders deliver the workflow's effects by topic (as Config.Senders, into which
	// they are merged; a topic both set is an error).
	Senders map[string]outbox.Sender
	// Migrations are the workflow's own tables (migrations.Up runs them after
	// onceflow's; see Migrations).
	Migrations *migrations.Source
	// Routes mounts the workflow's HTTP routes (Route, StateHandler) on mux; called by
	// Client.Mount.
	Routes func(c *Client, mux *http.ServeMux) error
	// Audit checks the workflow's own invariants over its tables (beyond the checks
	// onceflow makes of every kind's completions and effects) and reports what it
	// looked at; called by `onceflow audit`.
	Audit func(ctx context.Context, c *Client) (*AuditReport, error)
}

// AuditReport is what an audit found. Checked lists every table or key space the audit
// looked at, so a report never claims that invariants hold for data it did not read.
type AuditReport struct {
	// Workflow is the name of the audited workflow ("" for onceflow's own checks).
	Workflow string `json:"workflow"`
	// Checked names what was read: tables ("summaries", "job_completions",
	// "outbox") and Redis key spaces ("queue summaries").
	Checked []string `json:"checked"`
	// Counts are the totals the audit found, by name ("summaries": 12, "dlq": 0).
	Counts map[string]int64 `json:"counts,omitempty"`
	// Violations describe each broken invariant, one line each; none when all hold.
	Violations []string `json:"violations"`
}

// OK reports whether the audit looked at something and found no violation.
func (r *AuditReport) OK() bool { return r != nil && len(r.Checked) > 0 && len(r.Violations) == 0 }

// mergeWorkflows adds each of cfg.Workflows' queues, workers and senders to cfg.
func mergeWorkflows(cfg *Config) error {
	if len(cfg.Workflows) == 0 {
		return nil
	}
	// A registry of its own: the caller's Config.Workers is not modified.
	ws := NewWorkers()
	for kind, kw := range cfg.Workers.snapshot() {
		ws.byKind[kind] = kw
	}
	cfg.Workers = ws
	queues := maps.Clone(cfg.Queues)
	if queues == nil {
		queues = map[string]QueueConfig{}
	}
	senders := maps.Clone(cfg.Senders)
	if senders == nil {
		senders = map[string]outbox.Sender{}
	}
	names := map[string]bool{}
	for _, wf := range cfg.Workflows {
		if !validName(wf.Name) {
			return fmt.Errorf("onceflow: workflow name %q: want 1 to 64 characters of a-z 0-9 _ . -", wf.Name)
		}
		if names[wf.Name] {
			return fmt.Errorf("onceflow: workflow %q listed twice", wf.Name)
		}
		names[wf.Name] = true
		for _, q := range slices.Sorted(maps.Keys(wf.Queues)) {
			qc := wf.Queues[q]
			if have, ok := queues[q]; ok && !sameQueueConfig(have, qc) {
				return fmt.Errorf("onceflow: workflow %q: queue %q is configured differently elsewhere", wf.Name, q)
			}
			queues[q] = qc
		}
		if wf.Workers != nil {
			if err := wf.Workers(cfg.Workers); err != nil {
				return fmt.Errorf("onceflow: workflow %q: %w", wf.Name, err)
			}
		}
		for _, topic := range slices.Sorted(maps.Keys(wf.Senders)) {
			if _, ok := senders[topic]; ok {
				return fmt.Errorf("onceflow: workflow %q: topic %q already has a sender", wf.Name, topic)
			}
			senders[topic] = wf.Senders[topic]
		}
	}
	cfg.Queues, cfg.Senders = queues, senders
	return nil
}

// sameQueueConfig reports whether a and b configure a queue alike (Gate compared by
// presence: two workflows may share a queue only with the same settings).
func sameQueueConfig(a, b QueueConfig) bool {
	ag, bg := a.Gate != nil, b.Gate != nil
	a.Gate, b.Gate = nil, nil
	return a == b && ag == bg
}

// validName reports whether s is a workflow name: 1 to 64 of a-z 0-9 _ . -.
func validName(s string) bool {
	if len(s) < 1 || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_' || r == '.' || r == '-') {
			return false
		}
	}
	return true
}

// Mount mounts every workflow's routes on mux (Workflow.Routes), in order.
func (c *Client) Mount(mux *http.ServeMux) error {
	var errs []error
	for _, wf := range c.cfg.Workflows {
		if wf.Routes == nil {
			continue
		}
		if err := wf.Routes(c, mux); err != nil {
			errs = append(errs, fmt.Errorf("onceflow: workflow %q routes: %w", wf.Name, err))
		}
	}
	return errors.Join(errs...)
}

// Migrations returns the migrations of every workflow that has tables, in order, for
// migrations.Up.
func (c *Client) Migrations() []migrations.Source {
	var out []migrations.Source
	for _, wf := range c.cfg.Workflows {
		if wf.Migrations != nil {
			out = append(out, *wf.Migrations)
		}
	}
	return out
}
