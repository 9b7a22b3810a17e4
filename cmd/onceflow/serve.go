package main

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/httpapi"
)

// runServe runs the HTTP API until SIGINT/SIGTERM, then drains in-flight requests within
// ONCEFLOW_SHUTDOWN_TIMEOUT.
func runServe(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "serve", "")
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	if err := cfg.RequireAPIKeys(); err != nil {
		return err
	}
	log.InfoContext(ctx, "starting serve", "config", cfg)
	rdb, err := connect.Redis(cfg.RedisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	pool, err := connect.Postgres(ctx, cfg.DatabaseURL, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	api := httpapi.New(httpapi.Config{
		Logger:   log,
		Registry: newRegistry(),
		Checks: map[string]httpapi.Check{
			"redis":    func(ctx context.Context) error { return rdb.Ping(ctx).Err() },
			"postgres": pool.Ping,
		},
	})
	if err := httpapi.Serve(ctx, cfg.HTTPAddr, api, cfg.ShutdownTimeout, log, nil); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log.InfoContext(ctx, "serve stopped")
	return nil
}
