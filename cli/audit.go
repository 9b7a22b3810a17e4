package cli

import (
	"context"
	"errors"

	"github.com/onceflow/onceflow/config"
)

// runAudit checks the invariants of the program's workflows on live data and prints
// what it read and found: App.Audit's report when the program has one (the onceflow
// binary's: the summaries service's table, or its JSON object with --json), else
// onceflow's checks and each workflow's audit (runAuditReports). It exits 4 when an
// invariant is violated.
func runAudit(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "audit", "[--json]", config.GroupRedis, config.GroupPostgres, config.GroupJobs, config.GroupWorkers,
		config.GroupAudit, config.GroupLogs)
	loader := config.Register(fs)
	asJSON := fs.Bool("json", false, "print one JSON object on stdout")
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	d, err := newDeps(ctx, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	c, err := d.appClient(e, false)
	if err != nil {
		return err
	}
	if e.app.Audit == nil {
		return runAuditReports(ctx, e, c, *asJSON)
	}
	err = e.app.Audit(ctx, d.host(e), c, e.stdout, *asJSON)
	if errors.Is(err, ErrViolations) {
		return &exitError{code: 4, err: err}
	}
	return err
}
