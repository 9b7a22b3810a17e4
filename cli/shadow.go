package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
)

const shadowUsage = "report [--step S] [--since D] [--worst N] [--json]\n\n" +
	"report summarises the shadow runs (ONCEFLOW_SHADOW, Config.Shadows): for each step and\n" +
	"candidate, how often the candidate's answer agreed with production's, the mean score, the\n" +
	"mean latencies and the total costs of both; then the worst disagreements, both answers side\n" +
	"by side. --since D counts the runs of the last D (for example 24h); --worst N shows N\n" +
	"disagreements (default 5, 0 for none)."

// runShadow reports on the shadow runs.
func runShadow(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "shadow", shadowUsage, args); err != nil {
		return err
	}
	if args[0] != "report" {
		return usageErrorf("shadow: unknown subcommand %q; want report", args[0])
	}
	fs := flags(e, "shadow report", "[--step S] [--since D] [--worst N] [--json]", config.GroupRedis, config.GroupPostgres, config.GroupLogs)
	loader := config.Register(fs)
	step := fs.String("step", "", "only this step's shadows")
	since := fs.Duration("since", 0, "only the runs of this last while (0: all)")
	worst := fs.Int("worst", 5, "show this many of the worst disagreements")
	asJSON := fs.Bool("json", false, "print the report as JSON on stdout")
	cfg, _, err := load(e, fs, loader, args[1:])
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return usageErrorf("shadow report takes no arguments, got %q", fs.Args())
	case *since < 0:
		return usageErrorf("shadow report: --since must not be negative")
	case *worst < 0 || *worst > 1000:
		return usageErrorf("shadow report: --worst must be 0 to 1000")
	}
	c, _, done, err := jobsClient(ctx, e, cfg, nil)
	if err != nil {
		return err
	}
	defer done()
	q := onceflow.ShadowQuery{Step: *step, Worst: *worst}
	if *worst == 0 {
		q.Worst = -1
	}
	if *since > 0 {
		q.Since = time.Now().Add(-*since)
	}
	rep, err := c.Inspector().ShadowReport(ctx, q)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return printShadowReport(e, rep)
}

// printShadowReport prints rep as a table, then its worst disagreements.
func printShadowReport(e *env, rep *onceflow.ShadowReport) error {
	if len(rep.Summaries) == 0 {
		fmt.Fprintln(e.stdout, "no shadow runs")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tCANDIDATE\tRUNS\tAGREED\tSCORE\tLATENCY MS (PROD -> CAND)\tCOST USD (PROD -> CAND)")
	for _, s := range rep.Summaries {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d (%.1f%%)\t%.2f\t%.0f -> %.0f\t%.4f -> %.4f\n", s.Step, s.Candidate, s.Runs, s.Agreed,
			100*s.Agreement, s.Score, s.ProdLatencyMS, s.CandLatencyMS, s.ProdCostUSD, s.CandCostUSD)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for i, d := range rep.Disagreements {
		if i == 0 {
			fmt.Fprintln(e.stdout, "\nworst disagreements:")
		}
		fmt.Fprintf(e.stdout, "\n%s / %s, job %s (tenant %s), score %.2f: %s\n  production: %s\n  candidate:  %s\n", d.Step, d.Candidate,
			d.JobID, dash(d.Tenant), d.Score, outboxCell(d.Detail, 500), answerCell(d.Production), answerCell(d.Shadow))
	}
	return nil
}

// answerCell is a model answer on one line: its text, or its tool calls.
func answerCell(r *llm.Response) string {
	if r == nil {
		return "-"
	}
	if r.Content == "" && len(r.ToolCalls) > 0 {
		calls := make([]string, len(r.ToolCalls))
		for i, c := range r.ToolCalls {
			calls[i] = c.Name + " " + c.Arguments
		}
		return outboxCell("tool calls: "+strings.Join(calls, "; "), 160)
	}
	return outboxCell(r.Content, 160)
}
