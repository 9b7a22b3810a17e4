package cli

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/migrations"
)

// runMigrate applies pending migrations. Several concurrent runs against one database
// are safe: they serialise on an advisory lock and the schema is created once. In a
// program with App.Workflows, the workflows' own migrations (Workflow.Migrations) run
// after onceflow's, in order.
func runMigrate(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "migrate", "", config.GroupPostgres, config.GroupLogs)
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	var extra []migrations.Source
	wfs, err := e.workflows(e.host(cfg, log, nil))
	if err != nil {
		return err
	}
	for _, wf := range wfs {
		if wf.Migrations != nil {
			extra = append(extra, *wf.Migrations)
		}
	}
	v, err := migrations.Up(ctx, cfg.DatabaseURL, log, extra...)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "schema at version %d\n", v)
	return nil
}
