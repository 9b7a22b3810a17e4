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

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
)

// App is a program built on the onceflow command: its name and the workflows it hosts.
// `onceflow work`, `run`, `serve`, `relay`, `dlq` and `audit` then host and inspect
// those workflows (their queues, routes, senders and audits) with every ONCEFLOW_*
// setting, as the onceflow binary hosts its built-in summaries service. A program of
// one's own is
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
	// settings are loaded. Default: nil, the built-in summaries service.
	Workflows func(h Host) ([]onceflow.Workflow, error)
}

// Host is what the command built from the environment for the workflows: App.Workflows
// gets it.
type Host struct {
	// Config holds every ONCEFLOW_* setting (the model's name, the timeouts...).
	Config *config.Config
	// Getenv reads the environment (the program's own variables).
	Getenv func(string) string
	// Logger is the process's logger (ONCEFLOW_LOG_FORMAT, on stderr).
	Logger *slog.Logger
	// Tenant authenticates a request by its `Authorization: Bearer KEY` against
	// ONCEFLOW_API_KEYS and returns the key's tenant, or idempotency.ErrUnauthenticated
	// (401): the RouteConfig.Tenant of the workflows' routes.
	Tenant func(r *http.Request) (string, error)
	// Sender returns the sender ONCEFLOW_SENDER selects (webhook, smtp or log, with their
	// settings), for a workflow's Senders.
	Sender func() (outbox.Sender, error)
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
// configuration error, 4 when audit found a violation, 3 when probe found the provider
// ignoring Idempotency-Key, 1 otherwise.
func ExitCode(err error) int { return exitCode(err) }

// hosted reports whether the command hosts App.Workflows (else the built-in summaries
// service).
func (e *env) hosted() bool { return e.app.Workflows != nil }

// host returns what the workflows get from the environment.
func (e *env) host(cfg *config.Config, log *slog.Logger) Host {
	auth := httpapi.NewAuthenticator(cfg.APIKeys)
	return Host{
		Config: cfg, Getenv: e.getenv, Logger: log,
		Tenant: func(r *http.Request) (string, error) {
			if t, ok := auth.Tenant(r); ok {
				return t, nil
			}
			return "", idempotency.ErrUnauthenticated
		},
		Sender: func() (outbox.Sender, error) { return newOutboxSender(cfg, log) },
	}
}

// workflows returns App.Workflows' workflows, each queue's zero settings taking the
// ONCEFLOW_* ones (a workflow's own settings win).
func (e *env) workflows(cfg *config.Config, log *slog.Logger) ([]onceflow.Workflow, error) {
	wfs, err := e.app.Workflows(e.host(cfg, log))
	if err != nil {
		return nil, fmt.Errorf("workflows: %w", err)
	}
	out := slices.Clone(wfs)
	for i, wf := range out {
		qs := make(map[string]onceflow.QueueConfig, len(wf.Queues))
		for name, qc := range wf.Queues {
			qc.Concurrency = cmp.Or(qc.Concurrency, cfg.WorkerConcurrency)
			qc.ClaimIdle = cmp.Or(qc.ClaimIdle, cfg.ClaimIdle)
			qc.MaxDeliveries = cmp.Or(qc.MaxDeliveries, cfg.MaxDeliveries)
			qc.ShutdownTimeout = cmp.Or(qc.ShutdownTimeout, cfg.ShutdownTimeout)
			qc.StatsInterval = cmp.Or(qc.StatsInterval, cfg.StatsInterval)
			qs[name] = qc
		}
		out[i].Queues = qs
	}
	return out, nil
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

// appClient returns the onceflow.Client of App.Workflows on d's connections, configured
// from the ONCEFLOW_* settings; withModel gives it the model (the roles that run jobs).
// It registers its metrics on d's registry and makes d's readiness report its model
// breaker.
func (d *deps) appClient(e *env, withModel bool) (*onceflow.Client, error) {
	cfg := d.cfg
	wfs, err := e.workflows(cfg, d.log)
	if err != nil {
		return nil, err
	}
	if d.tp != nil {
		// Traced as the built-in service: a span per job run and per send.
		for i, wf := range wfs {
			senders := make(map[string]outbox.Sender, len(wf.Senders))
			for topic, s := range wf.Senders {
				senders[topic] = onceflowotel.Sender(d.tp, s)
			}
			wfs[i].Senders = senders
		}
	}
	oc, err := d.clientConfig(withModel && d.pool != nil)
	if err != nil {
		return nil, err
	}
	oc.Workflows, oc.Relay, oc.AuditMaxAge = wfs, relayConfig(cfg, d.log, d.reg), cfg.AuditMaxAge
	if d.tp != nil {
		oc.Middleware = []onceflow.Middleware{onceflowotel.Middleware(d.tp)}
	}
	c, err := onceflow.NewClient(oc)
	if err != nil {
		return nil, &config.Error{Name: "workflows", Err: err}
	}
	if b := c.ModelBreaker(); b != nil {
		d.llmBreaker = b
	}
	return c, nil
}
