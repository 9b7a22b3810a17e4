package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
)

const evalUsage = "--step S --candidate MODEL [--name N] [--since D] [--tenant T] [--limit N] [--max-cost USD]\n" +
	"    [--concurrency N] [--fields F,F | --judge MODEL [--criteria TEXT] [--threshold X]] [--json]\n\n" +
	"eval replays the step's recorded production calls (their requests, kept in the ledger for\n" +
	"ONCEFLOW_LEDGER_RETENTION when ONCEFLOW_LEDGER_KEEP_REQUESTS=true) against the candidate model,\n" +
	"once per input, compares each answer\n" +
	"with production's and records it as a shadow run named eval:NAME (NAME defaults to MODEL), then\n" +
	"prints the candidate's report, as `shadow report` does. The calls go through the ledger (an\n" +
	"eval run again asks only what is new) and the limiter, as background calls of the tenant\n" +
	"onceflow.eval. --fields compares those JSON fields (default: the exact answer); --judge has a\n" +
	"model grade the agreement from 0 to 1 (agreeing at --threshold, default 0.7). --max-cost stops\n" +
	"once the calls cost that much by the price table (ONCEFLOW_LLM_PRICES)."

// runEval evaluates a candidate model on a step's recorded production inputs.
func runEval(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "eval", evalUsage, config.GroupRedis, config.GroupPostgres,
		config.GroupModel, config.GroupModelCalls, config.GroupLimits, config.GroupLedger, config.GroupLogs)
	loader := config.Register(fs)
	step := fs.String("step", "", "the production step whose recorded calls are replayed (required)")
	candidate := fs.String("candidate", "", "the candidate model (required)")
	name := fs.String("name", "", "the candidate's name in the report (default: the model)")
	since := fs.Duration("since", 0, "the recorded calls of this last while (default 24h)")
	tenant := fs.String("tenant", "", "only this tenant's calls")
	limit := fs.Int("limit", 100, fmt.Sprintf("at most this many inputs, oldest first (1 to %d)", onceflow.MaxEvalInputs))
	maxCost := fs.Float64("max-cost", 0, "stop once the calls cost this many USD (0: no bound)")
	concurrency := fs.Int("concurrency", 4, "inputs asked at once (1 to 32)")
	fields := fs.String("fields", "", "compare these top-level fields of JSON answers, comma-separated")
	judge := fs.String("judge", "", "a model that grades the candidate's agreement with production")
	criteria := fs.String("criteria", "", "the judge's criteria (default: the same in substance)")
	threshold := fs.Float64("threshold", 0, "the judge's score that agrees, 0 to 1 (default 0.7)")
	worst := fs.Int("worst", 5, "show this many of the worst disagreements")
	asJSON := fs.Bool("json", false, "print the result as JSON on stdout")
	cfg, _, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return usageErrorf("eval takes no arguments, got %q", fs.Args())
	case *step == "" || *candidate == "":
		return usageErrorf("eval: --step and --candidate are required; usage: %s eval %s", e.app.Name, strings.SplitN(evalUsage, "\n\n", 2)[0])
	case *fields != "" && *judge != "":
		return usageErrorf("eval: --fields or --judge, not both")
	case (*criteria != "" || flagSet(fs, "threshold")) && *judge == "":
		return usageErrorf("eval: --criteria and --threshold are the judge's: give --judge MODEL")
	case *limit < 1 || *limit > onceflow.MaxEvalInputs:
		return usageErrorf("eval: --limit must be 1 to %d", onceflow.MaxEvalInputs)
	case *concurrency < 1 || *concurrency > 32:
		return usageErrorf("eval: --concurrency must be 1 to 32")
	case *since < 0 || *maxCost < 0:
		return usageErrorf("eval: --since and --max-cost must not be negative")
	case *worst < 0 || *worst > 1000:
		return usageErrorf("eval: --worst must be 0 to 1000")
	}
	ev := onceflow.Eval{Step: *step, Since: *since, Tenant: *tenant, Limit: *limit, MaxCostUSD: *maxCost, Concurrency: *concurrency,
		Candidate: onceflow.Shadow{Model: *candidate, Name: *name}}
	if *fields != "" {
		var fl []string
		for f := range strings.SplitSeq(*fields, ",") {
			if f = strings.TrimSpace(f); f != "" {
				fl = append(fl, f)
			}
		}
		if len(fl) == 0 {
			return usageErrorf("eval: --fields names no field")
		}
		ev.Candidate.Compare = onceflow.JSONFieldsMatch(fl...)
	}
	if *judge != "" {
		ev.Candidate.Judge = &onceflow.Judge{Model: *judge, Criteria: *criteria, Threshold: *threshold}
	}
	c, done, err := modelClient(ctx, e, cfg)
	if err != nil {
		return err
	}
	defer done()
	res, err := c.Eval(ctx, ev)
	switch {
	case err != nil && res == nil && ctx.Err() == nil && !errors.Is(err, onceflow.ErrUnavailable):
		return &config.Error{Name: "eval", Err: err} // its settings: nothing was asked
	case err != nil && res != nil:
		return fmt.Errorf("%w (%d inputs recorded before it stopped; eval again goes on from there)", err, res.Recorded)
	case err != nil:
		return err
	}
	// Eval's report holds the default few disagreements: report again with --worst's.
	q := onceflow.ShadowQuery{Step: *step, Candidate: res.Candidate, Worst: *worst}
	if *worst == 0 {
		q.Worst = -1 // none (0 is the report's default)
	}
	if res.Report, err = c.Inspector().ShadowReport(ctx, q); err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	fmt.Fprintf(e.stdout, "%s: %d new inputs of step %s, %d recorded, %d failed, %.4f USD\n", res.Candidate, res.Inputs, *step,
		res.Recorded, res.Failed, res.CostUSD)
	if res.Inputs == 0 {
		fmt.Fprintln(e.stdout, "(the inputs are the step's calls recorded with their requests: ONCEFLOW_LEDGER_KEEP_REQUESTS=true)")
	}
	if res.Stopped != "" {
		fmt.Fprintf(e.stdout, "stopped: %s\n", res.Stopped)
	}
	for _, msg := range res.Errors {
		fmt.Fprintf(e.stdout, "failed: %s\n", msg)
	}
	fmt.Fprintln(e.stdout)
	return printShadowReport(e, res.Report)
}

// modelClient returns a Client on cfg's stores with the model of ONCEFLOW_LLM (its
// ledger, limiter and retry policy); it runs nothing; done releases it.
func modelClient(ctx context.Context, e *env, cfg *config.Config) (*onceflow.Client, func(), error) {
	d, err := newDeps(ctx, cfg, newLogger(e.stderr, cfg.LogFormat), true, true)
	if err != nil {
		return nil, nil, err
	}
	// An evaluation's calls are made at once, neither shadowed nor batched: eval reads
	// none of the lanes' settings (config.GroupModelLanes).
	lanes := *cfg
	lanes.Shadows, lanes.SummariesLane = nil, "sync"
	d.cfg = &lanes
	oc, err := d.clientConfig(e.app, true)
	if err != nil {
		d.Close()
		return nil, nil, err
	}
	c, err := onceflow.NewClient(oc)
	if err != nil {
		d.Close()
		return nil, nil, &config.Error{Name: "model", Err: err}
	}
	return c, d.Close, nil
}
