// Package service is the onceflow binary's built-in service: the summaries workflow
// (package summaries) as the onceflow command (package cli) hosts it, its options read
// from the ONCEFLOW_* settings, and the audit the binary prints. cmd/onceflow is
//
//	cli.Main(cli.App{Workflows: service.Workflows, Audit: service.Audit, Providers: ..., Commands: ...})
//
// with every model provider and command (see cmd/onceflow), and a program of one's own
// hosts the service beside its workflows by listing Workflow(h) among them.
//
// The dependencies run one way: service imports cli and summaries; summaries is a
// library on the public API that knows neither, and cli hosts any workflow without
// knowing this one.
package service

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/summaries"
)

// Workflow returns the summaries workflow as the onceflow binary hosts it: routes
// authenticated by h.Tenant (ONCEFLOW_API_KEYS) answering the command's 401, their
// statuses declared (h.RouteStatuses), the model
// ONCEFLOW_LLM_MODEL, the queue settings ONCEFLOW_WORKER_CONCURRENCY, CLAIM_IDLE,
// MAX_DELIVERIES, SHUTDOWN_TIMEOUT and STATS_INTERVAL, the route settings
// ONCEFLOW_IDEMPOTENCY_TIMEOUT, LOCK_TTL and IDEMPOTENCY_RESPONSE_LIMIT, the audit's
// ONCEFLOW_AUDIT_MAX_AGE and OUTBOX_RETENTION, and the emails sent with the sender
// ONCEFLOW_SENDER selects. Its error is the sender's settings'.
func Workflow(h cli.Host) (onceflow.Workflow, error) {
	sender, err := h.Sender()
	if err != nil {
		return onceflow.Workflow{}, err
	}
	h.RouteStatuses("POST /v1/summaries", postStatuses...)
	h.RouteStatuses("GET /v1/summaries/{job_id}", getStatuses...)
	h.RouteStatuses("GET /v1/summaries/{job_id}/events", eventsStatuses...)
	cfg := h.Config
	var batch time.Duration
	if cfg.SummariesLane == "batch" {
		batch = BatchWait
	}
	return summaries.Workflow(summaries.Options{
		Tenant: h.Tenant, Unauthorized: h.Unauthorized, Sender: sender,
		Model: cfg.LLMModel, Batch: batch,
		Queue: onceflow.QueueConfig{
			Concurrency: cfg.WorkerConcurrency, ClaimIdle: cfg.ClaimIdle, MaxDeliveries: cfg.MaxDeliveries,
			ShutdownTimeout: cfg.ShutdownTimeout, StatsInterval: cfg.StatsInterval, RecordSuccesses: cfg.RecordSuccesses,
		},
		Timeout: cfg.IdempotencyTimeout, LockTTL: cfg.LockTTL, MaxResponseBytes: cfg.IdempotencyResponseLimit,
		AuditMaxAge: cfg.AuditMaxAge, AuditRetention: cfg.OutboxRetention,
		Logger: h.Logger, Registerer: h.Registerer,
	}), nil
}

// BatchWait is how long a summary waits for its batch with ONCEFLOW_SUMMARIES_LANE=batch
// before it is asked in the synchronous lane: longer than the provider's 24-hour
// completion window, so that a batch that expires is answered by the poller first (its
// items then take the synchronous lane) and no request is paid for in both lanes.
const BatchWait = 25 * time.Hour

// The statuses each summaries route answers (docs/api.md), whose series /metrics shows at
// zero from the start.
var (
	postStatuses = []int{http.StatusAccepted, http.StatusBadRequest, http.StatusUnauthorized, http.StatusRequestTimeout,
		http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity, http.StatusServiceUnavailable}
	getStatuses    = []int{http.StatusOK, http.StatusUnauthorized, http.StatusNotFound, http.StatusServiceUnavailable}
	eventsStatuses = []int{http.StatusOK, http.StatusBadRequest, http.StatusUnauthorized, http.StatusNotFound, http.StatusServiceUnavailable}
)

// Workflows is the onceflow binary's cli.App.Workflows: the summaries workflow alone
// (Workflow).
func Workflows(h cli.Host) ([]onceflow.Workflow, error) {
	wf, err := Workflow(h)
	if err != nil {
		return nil, err
	}
	return []onceflow.Workflow{wf}, nil
}

// Audit is the onceflow binary's cli.App.Audit: summaries.Audit over the Client's
// stores with ONCEFLOW_CLAIM_IDLE, ONCEFLOW_AUDIT_MAX_AGE and ONCEFLOW_OUTBOX_RETENTION,
// printed as a table of counts, the llm_calls ledger's accounting and the verdict
// ("invariants: all hold", or a VIOLATION line each), or with asJSON as the
// summaries.Report object. Its error wraps cli.ErrViolations when an invariant does not
// hold.
func Audit(ctx context.Context, h cli.Host, c *onceflow.Client, w io.Writer, asJSON bool) error {
	cfg := h.Config
	parts, err := c.Inspector().QueuePartitions(ctx, summaries.QueueName)
	if err != nil {
		return err
	}
	r, err := summaries.Audit(ctx, summaries.AuditConfig{
		DB: c.Inspector().DB(), Redis: c.Inspector().Redis(), Keys: c.Inspector().QueueKeys(summaries.QueueName), Partitions: parts,
		ClaimIdle: cfg.ClaimIdle, MaxAge: cfg.AuditMaxAge, Retention: cfg.OutboxRetention,
	})
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			return err
		}
	} else {
		printReport(w, r)
	}
	if len(r.Violations) > 0 {
		return fmt.Errorf("%w: %d", cli.ErrViolations, len(r.Violations))
	}
	return nil
}

// printReport prints r as `onceflow audit` does: the counts, the ledger's accounting,
// then the verdict.
func printReport(w io.Writer, r *summaries.Report) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, row := range []struct {
		name string
		n    int64
	}{
		{"summaries", r.Summaries}, {"outbox rows", r.OutboxTotal}, {"  sent", r.OutboxSent},
		{"  unsent", r.OutboxUnsent}, {"  exhausted", r.OutboxExhausted}, {"dead-lettered jobs", r.DLQ},
		{"stream entries", r.StreamLength}, {"  pending", r.StreamPending},
	} {
		fmt.Fprintf(tw, "%s\t%d\n", row.name, row.n)
	}
	_ = tw.Flush()
	if len(r.LLMCalls) > 0 {
		fmt.Fprintln(w, "\nmodel calls (llm_calls ledger):")
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "provider\tmodel\tcalls\tsucceeded\tfailed\tin flight\tabandoned\tattempts\tambiguous\t")
		for _, c := range r.LLMCalls {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", c.Provider, c.Model, c.Calls, c.Succeeded, c.Failed,
				c.InFlight, c.Abandoned, c.Attempts, c.Ambiguous)
		}
		_ = tw.Flush()
	}
	if len(r.Violations) == 0 {
		fmt.Fprintln(w, "invariants: all hold")
	}
	for _, v := range r.Violations {
		fmt.Fprintln(w, "VIOLATION:", v)
	}
}
