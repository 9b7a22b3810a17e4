package cli

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow/config"
)

// runRun runs serve, work and relay in one process, on one Client (with the model) and
// with one /metrics for all three (on ONCEFLOW_HTTP_ADDR, beside the API): the
// workflows' routes, the workers of their queues (--queue selects them, default all)
// and the relay of their effects. SIGINT/SIGTERM drains each within
// ONCEFLOW_SHUTDOWN_TIMEOUT.
func runRun(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "run", "[--queue NAME[,NAME...]]", config.GroupRedis, config.GroupPostgres, config.GroupAPI, config.GroupUI,
		config.GroupJobs, config.GroupWorkers, config.GroupModel, config.GroupModelLanes, config.GroupModelCalls, config.GroupLimits, config.GroupLedger, config.GroupSender, config.GroupRelay,
		config.GroupHTTP, config.GroupShutdown, config.GroupLogs)
	loader := config.Register(fs)
	queues := queueFlag(fs, "work only this queue (repeatable or comma-separated; default: every queue of the program)")
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	c, err := d.appClient(e, true) // before the server, so /readyz reports its model breaker
	if err != nil {
		return err
	}
	selected, err := selectQueues(*queues, c.Inspector().Queues())
	if err != nil {
		return err
	}
	s, err := d.appServer(c)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting run: serve, work and relay", "config", cfg, "queues", selected)
	warnTrialSettings(ctx, log, cfg, true, true)
	err = runAll(ctx, d, s, cfg.HTTPAddr, func(ctx context.Context) error { return c.RunWorkers(ctx, selected...) }, c.RunRelay)
	if err != nil {
		return fmt.Errorf("run: %w", err)
	}
	log.InfoContext(ctx, "run stopped")
	return nil
}
