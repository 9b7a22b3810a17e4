package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/queue"
)

const inDoubtUsage = "list [--json] [--limit N] | resolve JOB KEY [--tenant T] (--happened --result R | --not-happened) [--queue NAME]\n\n" +
	"list shows the jobs in doubt, oldest first: dead-lettered because a tool call they run at most\n" +
	"once (Job.ToolAtMostOnce) was started and its outcome never recorded; each with its calls.\n" +
	"Check the system the call reaches, then resolve it: --happened --result R records R as the\n" +
	"tool's result (the model reads it, and the tool is not called again); --not-happened removes\n" +
	"the intent, and the job calls the tool again. Once no call of a job is in doubt, the job goes\n" +
	"back on its queue from the dead-letter queue, with the same id. --tenant defaults to the\n" +
	"tenant of the job in doubt; the job is put back on the program's queues (the onceflow\n" +
	"binary's: summaries) and those --queue names."

// runInDoubt lists the jobs in doubt and resolves their calls.
func runInDoubt(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "indoubt", inDoubtUsage, args); err != nil {
		return err
	}
	switch args[0] {
	case "list":
		return inDoubtList(ctx, e, args[1:])
	case "resolve":
		return inDoubtResolve(ctx, e, args[1:])
	default:
		return usageErrorf("indoubt: unknown subcommand %q; want list or resolve", args[0])
	}
}

func inDoubtList(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "indoubt list", "[--json] [--limit N]", config.GroupRedis, config.GroupPostgres, config.GroupLogs)
	loader := config.Register(fs)
	asJSON := fs.Bool("json", false, "print a JSON array of jobs, each with its calls, on stdout")
	limit := fs.Int("limit", 100, "at most this many jobs, oldest first")
	cfg, _, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return usageErrorf("indoubt list takes no arguments, got %q", fs.Args())
	case *limit < 1:
		return usageErrorf("indoubt list: --limit must be at least 1")
	}
	c, _, done, err := jobsClient(ctx, e, cfg, nil)
	if err != nil {
		return err
	}
	defer done()
	jobs, err := c.Inspector().InDoubt(ctx, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		if jobs == nil {
			jobs = []onceflow.InDoubtJob{}
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(jobs)
	}
	if len(jobs) == 0 {
		fmt.Fprintln(e.stdout, "no job in doubt")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tJOB\tKEY\tTOOL\tSTARTED\tARGUMENTS")
	for _, j := range jobs {
		for _, call := range j.Calls {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", dash(j.Tenant), j.JobID, call.Key, call.Tool,
				call.StartedAt.UTC().Format(time.RFC3339), outboxCell(call.Arguments, 80))
		}
	}
	return tw.Flush()
}

func inDoubtResolve(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "indoubt resolve", "JOB KEY [--tenant T] (--happened --result R | --not-happened) [--queue NAME]",
		config.GroupRedis, config.GroupPostgres, config.GroupJobs, config.GroupLogs)
	loader := config.Register(fs)
	tenant := fs.String("tenant", "", "the job's tenant (default: the tenant of the job in doubt JOB)")
	happened := fs.Bool("happened", false, "the call's effect took place: record --result as the tool's result")
	notHappened := fs.Bool("not-happened", false, "it did not: the job calls the tool again")
	result := fs.String("result", "", "with --happened: what the call returned, as the model will read it")
	queues := queueFlag(fs, "a queue the job may be on besides the program's (repeatable, or comma-separated)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	job, key, err := callArgs("indoubt resolve", pos)
	if err != nil {
		return err
	}
	switch {
	case *happened == *notHappened:
		return usageErrorf("indoubt resolve: give --happened --result R or --not-happened")
	case *happened && strings.TrimSpace(*result) == "":
		return usageErrorf("indoubt resolve: --happened needs --result R, what the call returned (the model reads it)")
	case *notHappened && flagSet(fs, "result"):
		return usageErrorf("indoubt resolve: --result is for --happened")
	case flagSet(fs, "tenant") && *tenant != "" && !queue.ValidTenant(*tenant):
		return usageErrorf("indoubt resolve: invalid tenant %q (up to 64 characters of A-Z a-z 0-9 . _ -)", *tenant)
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
		return usageErrorf("indoubt resolve: give --queue NAME, the job's queue (this program hosts no queues)")
	}
	in := c.Inspector()
	if !flagSet(fs, "tenant") {
		jobs, err := in.InDoubt(ctx, maxLookup)
		if err != nil {
			return err
		}
		i := slices.IndexFunc(jobs, func(j onceflow.InDoubtJob) bool {
			return j.JobID == job && slices.ContainsFunc(j.Calls, func(c onceflow.InDoubtCall) bool { return c.Key == key })
		})
		if i < 0 {
			return fmt.Errorf("indoubt resolve: call %s of job %s is not in doubt (resolved already, or never started)", key, job)
		}
		*tenant = jobs[i].Tenant
	}
	err = in.ResolveInDoubt(ctx, *tenant, job, key, onceflow.Resolution{Happened: *happened, Result: *result})
	switch {
	case errors.Is(err, onceflow.ErrNotInDoubt):
		return fmt.Errorf("indoubt resolve: call %s of job %s (tenant %s) is not in doubt (resolved already, another tenant's, or never started)", key, job, dash(*tenant))
	case err != nil:
		return fmt.Errorf("indoubt resolve: %w", err)
	}
	what := "it happened: the job goes on from your result, without calling the tool"
	if *notHappened {
		what = "it did not happen: the job calls the tool again"
	}
	fmt.Fprintf(e.stdout, "resolved call %s of job %s (tenant %s): %s, once no call of it is in doubt (then it is back on its queue)\n", key, job, dash(*tenant), what)
	return nil
}
