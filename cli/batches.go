package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
)

const batchesUsage = "list [--limit N] [--json] | cancel ID\n\n" +
	"list shows the batch lane (ONCEFLOW_SUMMARIES_LANE=batch, Config.Batch): the requests\n" +
	"waiting for a batch, by model, then the newest batches with their state, their\n" +
	"requests and how many were answered or fell back to the synchronous lane.\n" +
	"cancel ID asks the provider to cancel the batch ID (the lane's submission id or the\n" +
	"provider's batch id): what it answered before is recorded, the rest is asked in the\n" +
	"synchronous lane, once."

// runBatches lists the batch lane or cancels one of its batches.
func runBatches(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "batches", batchesUsage, args); err != nil {
		return err
	}
	switch args[0] {
	case "list":
		return runBatchesList(ctx, e, args[1:])
	case "cancel":
		return runBatchesCancel(ctx, e, args[1:])
	}
	return usageErrorf("batches: unknown subcommand %q; want list or cancel", args[0])
}

func runBatchesList(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "batches list", "[--limit N] [--json]", config.GroupRedis, config.GroupPostgres, config.GroupLogs)
	loader := config.Register(fs)
	limit := fs.Int("limit", 20, "show this many of the newest batches (1 to 1000)")
	asJSON := fs.Bool("json", false, "print the lane as JSON on stdout")
	cfg, _, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return usageErrorf("batches list takes no arguments, got %q", fs.Args())
	case *limit < 1 || *limit > 1000:
		return usageErrorf("batches list: --limit must be 1 to 1000")
	}
	c, _, done, err := jobsClient(ctx, e, cfg, nil)
	if err != nil {
		return err
	}
	defer done()
	lane, err := c.Inspector().Batches(ctx, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(lane)
	}
	models := make([]string, 0, len(lane.Pending))
	for m := range lane.Pending {
		models = append(models, m)
	}
	slices.Sort(models)
	for _, m := range models {
		fmt.Fprintf(e.stdout, "%d requests of %s wait for a batch\n", lane.Pending[m], m)
	}
	if len(lane.Batches) == 0 {
		fmt.Fprintln(e.stdout, "no batches")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SUBMISSION\tBATCH\tMODEL\tSTATE\tITEMS\tTOKENS\tDONE\tFAILED OVER\tCREATED")
	for _, b := range lane.Batches {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%s\n", b.Submission, dash(b.BatchID), b.Model, b.State, b.Items, b.Tokens,
			b.Done, b.Failed, b.CreatedAt.UTC().Format(time.RFC3339))
	}
	return tw.Flush()
}

func runBatchesCancel(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "batches cancel", "ID", config.GroupRedis, config.GroupPostgres, config.GroupModel, config.GroupLogs)
	loader := config.Register(fs)
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	if fs.NArg() != 1 || fs.Arg(0) == "" {
		return usageErrorf("batches cancel takes one batch id (the submission's or the provider's), got %q", fs.Args())
	}
	d, err := newDeps(ctx, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	oc, err := d.clientConfig(e.app, true)
	if err != nil {
		return err
	}
	if oc.Batch.API == nil {
		if oc.Batch.API, err = e.app.newBatchAPI(cfg); err != nil {
			return err
		}
	}
	c, err := onceflow.NewClient(oc)
	if err != nil {
		return &config.Error{Name: "batch lane", Err: err}
	}
	b, err := c.CancelBatch(ctx, fs.Arg(0))
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "asked %s to cancel batch %s (submission %s, %d requests of %s): what it answered is recorded, the rest is asked in the synchronous lane\n",
		cfg.LLM, b.BatchID, b.Submission, b.Items, b.Model)
	return nil
}
