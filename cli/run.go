package cli

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow/config"
)

// runRun runs serve, work and relay in one process, with one /metrics for all three
// (on ONCEFLOW_HTTP_ADDR, beside the API). SIGINT/SIGTERM drains each within
// ONCEFLOW_SHUTDOWN_TIMEOUT.
func runRun(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "run", "")
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
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
