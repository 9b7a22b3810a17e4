package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// App is a program built on the onceflow command: its name and the workflows it hosts.
// `onceflow work`, `run`, `serve`, `relay`, `dlq` and `audit` host and inspect those
// workflows (their queues, routes, senders and audits) with every ONCEFLOW_* setting.
// The onceflow binary is one such program: it hosts the summaries service
// (package service). A program of one's own is
//
//	func main() {
//		cli.Main(cli.App{Name: "notesd", Workflows: func(h cli.Host) ([]onceflow.Workflow, error) {
//			return []onceflow.Workflow{notes.Workflow(h.Tenant)}, nil
//		}})
//	}
//
// where notes.Workflow is the program's own (see ExampleRun).
type App struct {
	// Name is the command's name in its usage text and messages. Default: "onceflow".
	Name string
	// Workflows returns the workflows the program hosts, built from what the command
	// read from the environment (h). It is called once per command, after the
	// settings are loaded. Default: nil, no workflows: the operator commands (migrate,
	// dlq --queue, outbox, tenants, probe, gateway, and Commands) work, and the
	// commands that host workflows (serve, work, relay, run, audit) exit 2.
	Workflows func(h Host) ([]onceflow.Workflow, error)
	// Audit, when set, is what `audit` checks and prints in place of its reports: it
	// gets the command's Client (c.Workflows() are the program's), writes what it found
	// on w, as JSON when asJSON, and returns an error wrapping ErrViolations when an
	// invariant does not hold (exit 4). The onceflow binary's is the summaries
	// service's (service.Audit). Default: nil, onceflow's checks (Client.Audit), then
	// each workflow's Workflow.Audit, one report each.
	Audit func(ctx context.Context, h Host, c *onceflow.Client, w io.Writer, asJSON bool) error
	// Commands are the program's commands beyond the built-in ones, which `help` lists
	// after them. The onceflow binary has fake-llm and webhook-sink, the demos' and
	// tests' model server and webhook receiver: list fakellm.Command() (package
	// cli/fakellm) and webhooksink.Command() (package cli/webhooksink) for them.
	// Default: none; before they were Commands, every program had those two.
	Commands []Command
	// Providers are the model providers ONCEFLOW_LLM may select besides the built-in
	// fake. The onceflow binary's are openaiprovider.Provider() (package
	// cli/openaiprovider: ONCEFLOW_LLM=openai, OpenAI and any OpenAI-compatible
	// endpoint) and anthropicprovider.Provider() (cli/anthropicprovider: anthropic); a
	// program links a provider's SDK only when it lists the provider. ONCEFLOW_LLM
	// naming a provider the program does not list stops every command with a
	// configuration error that names the package to import (exit 2). Default: none,
	// the fake only; before Providers, every program had openai and anthropic: list
	// both for that.
	Providers []Provider
}

// ErrViolations is matched by the error of `audit` when an invariant does not hold (exit
// status 4); an App.Audit wraps it for the same.
var ErrViolations = errors.New("invariants violated")

// Host is what the command built from the environment for the workflows: App.Workflows
// gets it.
type Host struct {
	// Config holds every ONCEFLOW_* setting (the model's name, the timeouts...).
	Config *config.Config
	// Getenv reads the environment (the program's own variables).
	Getenv func(string) string
	// Logger is the process's logger (ONCEFLOW_LOG_FORMAT, on stderr).
	Logger *slog.Logger
	// Registerer is the process's metrics registry, which /metrics serves: a workflow's
	// own metrics. Nil for the commands that serve none (dlq, migrate).
	Registerer prometheus.Registerer
	// Tenant authenticates a request by its `Authorization: Bearer KEY` against
	// ONCEFLOW_API_KEYS and returns the key's tenant, or idempotency.ErrUnauthenticated
	// (401): the RouteConfig.Tenant of the workflows' routes.
	Tenant func(r *http.Request) (string, error)
	// Unauthorized answers a request Tenant refused as the command does: 401 with
	// `WWW-Authenticate: Bearer realm="onceflow"` and {"detail": "missing or unknown API
	// key (Authorization: Bearer KEY)"}, for a workflow route's own 401.
	Unauthorized http.Handler
	// Sender returns the sender ONCEFLOW_SENDER selects (webhook, smtp or log, with their
	// settings), for a workflow's Senders.
	Sender func() (outbox.Sender, error)
	// RouteStatuses declares the statuses a workflow's route answers, by the pattern it
	// mounts ("POST /v1/summaries"), so that /metrics shows their
	// onceflow_http_requests_total series at zero before the first request (every
	// route's requests are counted under its pattern's path, declared or not).
	// Optional; a no-op in the commands that serve no routes.
	RouteStatuses func(pattern string, codes ...int)
}

// Main runs app's subcommand named by os.Args[1:] with the process's environment and
// exits with its status (ExitCode). SIGINT and SIGTERM shut it down gracefully; a
// second one exits at once.
func Main(app App) {
	ctx, stop := signalContext(os.Stderr)
	err := Run(ctx, app, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(ExitCode(err))
}

// Run runs app's subcommand args[0] with the flags args[1:], writing to stdout and
// stderr and reading the environment with getenv, until it is done or ctx is cancelled
// (the long-running roles then shut down gracefully). An error other than -h's is
// also printed on stderr; ExitCode maps it to the command's exit status.
func Run(ctx context.Context, app App, args []string, stdout, stderr io.Writer, getenv func(string) string) error {
	app.Name = cmp.Or(app.Name, "onceflow")
	err := run(ctx, args, &env{stdout: stdout, stderr: stderr, getenv: getenv, app: app})
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintf(stderr, "%s: %v\n", app.Name, err)
	}
	return err
}

// ExitCode returns the exit status of Run's error: 0 for nil (and -h), 2 for a usage or
// configuration error (a program without workflows among them), 4 when audit found a
// violation (ErrViolations), 3 when probe found the provider ignoring Idempotency-Key, 1
// otherwise.
func ExitCode(err error) int { return exitCode(err) }

// host returns what the workflows get from the environment; reg is the process's
// metrics registry (nil for the commands without /metrics).
func (e *env) host(cfg *config.Config, log *slog.Logger, reg prometheus.Registerer) Host {
	auth := httpapi.NewAuthenticator(cfg.APIKeys)
	return Host{
		Config: cfg, Getenv: e.getenv, Logger: log, Registerer: reg,
		Unauthorized: http.HandlerFunc(httpapi.Unauthorized),
		Tenant: func(r *http.Request) (string, error) {
			if t, ok := auth.Tenant(r); ok {
				return t, nil
			}
			return "", idempotency.ErrUnauthenticated
		},
		Sender:        func() (outbox.Sender, error) { return newOutboxSender(cfg, log) },
		RouteStatuses: func(string, ...int) {},
	}
}

// workflows returns App.Workflows' workflows (none when it is nil). Their queues take
// the ONCEFLOW_* settings through the Client's QueueDefaults (see queueDefaults).
func (e *env) workflows(h Host) ([]onceflow.Workflow, error) {
	if e.app.Workflows == nil {
		return nil, nil
	}
	wfs, err := e.app.Workflows(h)
	if err != nil {
		return nil, fmt.Errorf("workflows: %w", err)
	}
	return wfs, nil
}

// queueDefaults are the ONCEFLOW_* queue settings, the Client's QueueDefaults: every
// queue it works (the workflows' and their kinds') takes them where its own
// QueueConfig leaves a setting zero.
func queueDefaults(cfg *config.Config) onceflow.QueueConfig {
	return onceflow.QueueConfig{
		Concurrency: cfg.WorkerConcurrency, ClaimIdle: cfg.ClaimIdle, MaxDeliveries: cfg.MaxDeliveries,
		ShutdownTimeout: cfg.ShutdownTimeout, StatsInterval: cfg.StatsInterval, DeadLetterRetention: dlqRetention(cfg),
		RetryBase: cfg.RetryBase, RetryMax: cfg.RetryMax, MaxRunTime: cfg.MaxRunTime, RecordSuccesses: cfg.RecordSuccesses,
		Partitions: cfg.QueuePartitions,
	}
}

// workflowQueues returns the names of the queues of wfs, sorted.
func workflowQueues(wfs []onceflow.Workflow) []string {
	set := map[string]bool{}
	for _, wf := range wfs {
		for q := range wf.Queues {
			set[q] = true
		}
	}
	return slices.Sorted(maps.Keys(set))
}

// queueFlag registers --queue NAME (repeatable, or comma-separated) on fs.
func queueFlag(fs *flag.FlagSet, usage string) *queueList {
	q := &queueList{}
	fs.Var(q, "queue", usage)
	return q
}

// queueList is the value of --queue.
type queueList []string

func (q *queueList) String() string { return strings.Join(*q, ",") }

func (q *queueList) Set(v string) error {
	for _, name := range strings.Split(v, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			return errors.New("empty queue name")
		}
		if err := (queue.Keys{Prefix: "p", Queue: name}).Validate(); err != nil {
			return err
		}
		if !slices.Contains(*q, name) {
			*q = append(*q, name)
		}
	}
	return nil
}

// selectQueues returns the queues --queue names, all of known when none; a name not in
// known is a usage error.
func selectQueues(flagged queueList, known []string) ([]string, error) {
	if len(flagged) == 0 {
		return known, nil
	}
	for _, q := range flagged {
		if !slices.Contains(known, q) {
			return nil, usageErrorf("--queue %q: no such queue; this program's queues: %s", q, strings.Join(known, ", "))
		}
	}
	return flagged, nil
}

// appClient returns the process's onceflow.Client, hosting App.Workflows on d's
// connections, configured from the ONCEFLOW_* settings; withModel gives it the model
// (the roles that run jobs). `onceflow run` makes one, with the model, for its API,
// workers and relay; serve alone one without. It registers its metrics on d's registry
// and, with withModel, makes d's readiness report the Client's breakers. A program without workflows is a
// configuration error.
func (d *deps) appClient(e *env, withModel bool) (*onceflow.Client, error) {
	cfg := d.cfg
	wfs, err := e.workflows(d.host(e))
	if err != nil {
		return nil, err
	}
	if len(wfs) == 0 {
		return nil, &usageError{errNoWorkflows}
	}
	if d.tp != nil {
		// A span per job run (the middleware below) and per send.
		for i, wf := range wfs {
			senders := make(map[string]outbox.Sender, len(wf.Senders))
			for topic, s := range wf.Senders {
				senders[topic] = onceflowotel.Sender(d.tp, s)
			}
			wfs[i].Senders = senders
		}
	}
	oc, err := d.clientConfig(e.app, withModel && d.pool != nil)
	if err != nil {
		return nil, err
	}
	oc.Workflows, oc.Relay, oc.AuditMaxAge = wfs, relayConfig(cfg, d.log, d.reg), cfg.AuditMaxAge
	oc.QueueDefaults = queueDefaults(cfg)
	if d.tp != nil {
		oc.Middleware = []onceflow.Middleware{onceflowotel.Middleware(d.tp)}
	}
	c, err := onceflow.NewClient(oc)
	if err != nil {
		return nil, &config.Error{Name: "workflows", Err: err}
	}
	if withModel {
		// This process runs the Client's workers (run, work): its readiness reports
		// their breakers, which RunWorkers checks.
		d.breakers = map[string]*breaker.Breaker{}
		for _, b := range c.Inspector().Breakers() {
			d.breakers[b.Name()] = b
		}
	}
	return c, nil
}

// errNoWorkflows is the error of a command that hosts workflows in a program that has
// none.
var errNoWorkflows = errors.New("this program hosts no workflows (cli.App.Workflows is nil or returned none)")

// host returns what the workflows get from d's settings, logger and registry; the
// routes' statuses they declare are kept for appServer.
func (d *deps) host(e *env) Host {
	h := e.host(d.cfg, d.log, d.reg)
	h.RouteStatuses = func(pattern string, codes ...int) {
		if d.routeStatuses == nil {
			d.routeStatuses = map[string][]int{}
		}
		d.routeStatuses[pattern] = append(d.routeStatuses[pattern], codes...)
	}
	return h
}
