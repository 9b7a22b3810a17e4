package cli

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/onceflow/onceflow/config"
)

// runRun runs serve, work and relay in one process, with one /metrics for all three
// (on ONCEFLOW_HTTP_ADDR, beside the API). SIGINT/SIGTERM drains each within
// ONCEFLOW_SHUTDOWN_TIMEOUT. In a program with App.Workflows it serves their routes,
// works their queues (--queue selects them, default all) and relays their effects.
func runRun(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "run", "[--queue NAME[,NAME...]]")
	loader := config.Register(fs)
	queues := queueFlag(fs, "work only this queue (repeatable or comma-separated; default: every queue of the program)")
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	if e.hosted() {
		return runRunHosted(ctx, e, cfg, log, *queues)
	}
	if _, err := selectQueues(*queues, []string{serviceKeys(cfg).Queue}); err != nil {
		return err
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	if _, err := d.modelBreaker(); err != nil { // before the server, so /readyz reports it
		return err
	}
	s, err := d.apiServer()
	if err != nil {
		return err
	}
	h, err := d.buildHandler()
	if err != nil {
		return err
	}
	w, err := d.buildWorker(h)
	if err != nil {
		return err
	}
	relay, err := d.buildRelay()
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting run: serve, work and relay", "config", cfg, "consumer", w.Consumer(), "relay", relay.Name())
	if err := runAll(ctx, d, s, cfg.HTTPAddr, append(d.background(), w.Run, relay.Run)...); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	log.InfoContext(ctx, "run stopped")
	return nil
}

// runRunHosted is run for App.Workflows: one Client serving the routes, working the
// selected queues and relaying the effects.
func runRunHosted(ctx context.Context, e *env, cfg *config.Config, log *slog.Logger, flagged queueList) error {
	d, err := newRoleDeps(ctx, e, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	c, err := d.appClient(e, true)
	if err != nil {
		return err
	}
	queues, err := selectQueues(flagged, c.Queues())
	if err != nil {
		return err
	}
	s, err := d.appServer(c)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting run: serve, work and relay", "config", cfg, "queues", queues)
	err = runAll(ctx, d, s, cfg.HTTPAddr, func(ctx context.Context) error { return c.RunWorkers(ctx, queues...) }, c.RunRelay)
	if err != nil {
		return fmt.Errorf("run: %w", err)
	}
	log.InfoContext(ctx, "run stopped")
	return nil
}
