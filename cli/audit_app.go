package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/onceflow/onceflow"
)

// runAuditReports is audit without an App.Audit: onceflow's own checks over every kind
// and queue (Client.Audit), then each workflow's Workflow.Audit. It prints, per report, what
// was read, the counts and the violations, and says "all hold" only for what a report
// read; a workflow without an audit of its own is named as such. With --json it prints
// {"reports": [...]}, one onceflow.AuditReport each ("workflow": "" is onceflow's). It
// exits 4 when any report has a violation.
func runAuditReports(ctx context.Context, e *env, c *onceflow.Client, asJSON bool) error {
	own, err := c.Audit(ctx)
	if err != nil {
		return err
	}
	reports := []*onceflow.AuditReport{own}
	for _, wf := range c.Inspector().Workflows() {
		r := &onceflow.AuditReport{}
		if wf.Audit != nil {
			if r, err = wf.Audit(ctx, c); err != nil {
				return fmt.Errorf("audit of workflow %q: %w", wf.Name, err)
			}
			if r == nil {
				r = &onceflow.AuditReport{}
			}
		}
		r.Workflow = wf.Name
		if r.Checked == nil {
			r.Checked = []string{}
		}
		if r.Violations == nil {
			r.Violations = []string{}
		}
		reports = append(reports, r)
	}
	violations := 0
	for _, r := range reports {
		violations += len(r.Violations)
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(map[string]any{"reports": reports}); err != nil {
			return err
		}
	} else {
		for i, r := range reports {
			if i > 0 {
				fmt.Fprintln(e.stdout)
			}
			printAuditReport(e, r)
		}
	}
	if violations > 0 {
		return &exitError{code: 4, err: fmt.Errorf("%w: %d", ErrViolations, violations)}
	}
	return nil
}

// printAuditReport prints one report: its title, what it read, its counts and its
// verdict, which names what it covers.
func printAuditReport(e *env, r *onceflow.AuditReport) {
	title := "onceflow (every kind and queue)"
	if r.Workflow != "" {
		title = "workflow " + r.Workflow
	}
	if len(r.Checked) == 0 {
		fmt.Fprintf(e.stdout, "%s: checked nothing (no audit of its own; only onceflow's checks apply)\n", title)
		return
	}
	fmt.Fprintf(e.stdout, "%s: checked %s\n", title, strings.Join(r.Checked, ", "))
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	for _, name := range slices.Sorted(maps.Keys(r.Counts)) {
		fmt.Fprintf(tw, "  %s\t%d\n", name, r.Counts[name])
	}
	_ = tw.Flush()
	if len(r.Violations) == 0 {
		fmt.Fprintf(e.stdout, "  invariants: all hold for %s\n", strings.Join(r.Checked, ", "))
	}
	for _, v := range r.Violations {
		fmt.Fprintln(e.stdout, "  VIOLATION:", v)
	}
}
