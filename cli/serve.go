package cli

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow/config"
)

// runServe runs the HTTP API until SIGINT/SIGTERM, then drains in-flight requests within
// ONCEFLOW_SHUTDOWN_TIMEOUT.
func runServe(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "serve", "")
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	s, err := d.apiServer()
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting serve", "config", cfg)
	if err := runAll(ctx, d, s, cfg.HTTPAddr); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log.InfoContext(ctx, "serve stopped")
	return nil
}
