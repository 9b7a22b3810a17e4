package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/queue"
)

const approvalsUsage = "list [--tenant T|--all] [--json] [--limit N] | approve|reject JOB KEY [--tenant T] [--note N] [--by B] [--queue NAME]\n\n" +
	"list shows the tool calls waiting for an operator's decision (NeedsApproval, Job.Approval),\n" +
	"oldest first: of every tenant (the default, or --all) or of --tenant T. approve lets the call\n" +
	"JOB KEY (the job id and the call's key, as list shows them) run, once; reject says it must not,\n" +
	"and the model reads --note. Either wakes the job at once. --tenant defaults to the tenant of\n" +
	"the pending call; --by (default cli:$USER) is recorded as who decided. The job is woken on the\n" +
	"program's queues (the onceflow binary's: summaries) and those --queue names."

// maxLookup bounds the pending calls (or jobs in doubt) read to find a call's tenant when
// --tenant is not given.
const maxLookup = 10000

// runApprovals lists and decides the tool calls waiting for an operator's decision.
func runApprovals(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "approvals", approvalsUsage, args); err != nil {
		return err
	}
	switch args[0] {
	case "list":
		return approvalsList(ctx, e, args[1:])
	case "approve", "reject":
		return approvalsDecide(ctx, e, args[0], args[1:])
	default:
		return usageErrorf("approvals: unknown subcommand %q; want list, approve or reject", args[0])
	}
}

func approvalsList(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "approvals list", "[--tenant T|--all] [--json] [--limit N]", config.GroupRedis, config.GroupPostgres, config.GroupLogs)
	loader := config.Register(fs)
	tenant := fs.String("tenant", "", "only this tenant's calls (--tenant '' for jobs without a tenant)")
	all := fs.Bool("all", false, "every tenant's calls (the default)")
	asJSON := fs.Bool("json", false, "print a JSON array on stdout, each call with its conversation so far")
	limit := fs.Int("limit", 100, "at most this many calls, oldest first")
	cfg, _, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	oneTenant := flagSet(fs, "tenant")
	switch {
	case fs.NArg() > 0:
		return usageErrorf("approvals list takes no arguments, got %q", fs.Args())
	case oneTenant && *all:
		return usageErrorf("approvals list: give --tenant T or --all, not both")
	case oneTenant && *tenant != "" && !queue.ValidTenant(*tenant):
		return usageErrorf("approvals list: invalid tenant %q (up to 64 characters of A-Z a-z 0-9 . _ -)", *tenant)
	case *limit < 1:
		return usageErrorf("approvals list: --limit must be at least 1")
	}
	c, _, done, err := jobsClient(ctx, e, cfg, nil)
	if err != nil {
		return err
	}
	defer done()
	list, err := c.Inspector().Approvals(ctx, *tenant, !oneTenant, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		if list == nil {
			list = []onceflow.Approval{}
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(list)
	}
	if len(list) == 0 {
		fmt.Fprintln(e.stdout, "no tool call waits for a decision")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tJOB\tKEY\tTOOL\tASKED\tDEADLINE\tARGUMENTS")
	for _, a := range list {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", dash(a.Tenant), a.JobID, a.Key, a.Tool,
			a.AskedAt.UTC().Format(time.RFC3339), a.Deadline.UTC().Format(time.RFC3339), outboxCell(a.Arguments, 80))
	}
	return tw.Flush()
}

func approvalsDecide(ctx context.Context, e *env, sub string, args []string) error {
	fs := flags(e, "approvals "+sub, "JOB KEY [--tenant T] [--note N] [--by B] [--queue NAME]", config.GroupRedis, config.GroupPostgres, config.GroupJobs, config.GroupLogs)
	loader := config.Register(fs)
	tenant := fs.String("tenant", "", "the job's tenant (default: the tenant of the pending call JOB KEY)")
	note := fs.String("note", "", "why (recorded; the model reads it when the call is rejected)")
	by := fs.String("by", "", "who decides (default: cli:$USER)")
	queues := queueFlag(fs, "a queue the job may be on besides the program's (repeatable, or comma-separated)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	job, key, err := callArgs("approvals "+sub, pos)
	if err != nil {
		return err
	}
	if !flagSet(fs, "by") {
		*by = "cli:" + cmp.Or(e.getenv("USER"), "unknown")
	}
	*note = strings.TrimSpace(*note)
	if err := onceflow.CheckDecision(*by, *note); err != nil {
		return usageErrorf("approvals %s: --%v", sub, err)
	}
	if flagSet(fs, "tenant") && *tenant != "" && !queue.ValidTenant(*tenant) {
		return usageErrorf("approvals %s: invalid tenant %q (up to 64 characters of A-Z a-z 0-9 . _ -)", sub, *tenant)
	}
	cfg, err := settings(e, loader)
	if err != nil {
		return err
	}
	c, known, done, err := jobsClient(ctx, e, cfg, *queues)
	if err != nil {
		return err
	}
	defer done()
	if len(known) == 0 {
		return usageErrorf("approvals %s: give --queue NAME, the job's queue (this program hosts no queues)", sub)
	}
	if !flagSet(fs, "tenant") {
		list, err := c.Inspector().Approvals(ctx, "", true, maxLookup)
		if err != nil {
			return err
		}
		i := slices.IndexFunc(list, func(a onceflow.Approval) bool { return a.JobID == job && a.Key == key })
		if i < 0 {
			return fmt.Errorf("approvals %s: no call %s of job %s waits for a decision (decided already, its time ran out, or never asked)", sub, key, job)
		}
		*tenant = list[i].Tenant
	}
	decide := c.Reject
	if sub == "approve" {
		decide = c.Approve
	}
	if err := decide(ctx, *tenant, job, key, *by, *note); err != nil {
		if errors.Is(err, onceflow.ErrNotWaiting) {
			return fmt.Errorf("approvals %s: no call %s of job %s (tenant %s) waits for a decision (decided already, its time ran out, another tenant's, or never asked)", sub, key, job, dash(*tenant))
		}
		return fmt.Errorf("approvals %s: %w", sub, err)
	}
	if sub == "approve" {
		fmt.Fprintf(e.stdout, "approved call %s of job %s (tenant %s) as %s: the job runs it now\n", key, job, dash(*tenant), *by)
	} else {
		fmt.Fprintf(e.stdout, "rejected call %s of job %s (tenant %s) as %s: the job goes on without it, and the model reads the note\n", key, job, dash(*tenant), *by)
	}
	return nil
}

// callArgs checks the positional arguments JOB KEY of a decision or a resolution.
func callArgs(cmd string, pos []string) (job, key string, err error) {
	switch {
	case len(pos) != 2:
		return "", "", usageErrorf("%s: give JOB KEY (the job id and the call's key), got %d arguments", cmd, len(pos))
	case !queue.ValidJobID(pos[0]):
		return "", "", usageErrorf("%s: %q is not a job id (printable ASCII without spaces)", cmd, pos[0])
	case !strings.HasPrefix(pos[1], "tool-") || len(pos[1]) > 128 || strings.ContainsFunc(pos[1], func(r rune) bool { return r <= ' ' || r > '~' }):
		return "", "", usageErrorf("%s: %q is not a tool call's key (tool- and 64 hex digits)", cmd, pos[1])
	}
	return pos[0], pos[1], nil
}

// jobsClient returns a Client on cfg's stores that knows the program's queues and the
// extra ones (--queue): where a decided or resolved job is woken or put back. It runs
// nothing; done releases it. It returns the queues it knows.
func jobsClient(ctx context.Context, e *env, cfg *config.Config, extra []string) (*onceflow.Client, []string, func(), error) {
	log := newLogger(e.stderr, cfg.LogFormat)
	d, err := newDeps(ctx, cfg, log, true, true)
	if err != nil {
		return nil, nil, nil, err
	}
	oc, err := d.clientConfig(e.app, false)
	if err != nil {
		d.Close()
		return nil, nil, nil, err
	}
	wfs, err := e.workflows(d.host(e))
	if err != nil {
		d.Close()
		return nil, nil, nil, err
	}
	oc.Workflows, oc.QueueDefaults = wfs, queueDefaults(cfg)
	known := workflowQueues(wfs)
	for _, q := range extra {
		if !slices.Contains(known, q) {
			if oc.Queues == nil {
				oc.Queues = map[string]onceflow.QueueConfig{}
			}
			oc.Queues[q] = onceflow.QueueConfig{}
			known = append(known, q)
		}
	}
	c, err := onceflow.NewClient(oc)
	if err != nil {
		d.Close()
		return nil, nil, nil, &config.Error{Name: "workflows", Err: err}
	}
	return c, known, d.Close, nil
}

// flagSet reports whether the flag name was given.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
