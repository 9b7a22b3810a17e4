package cli

import (
	"context"
	"fmt"
	"net/http"
	"slices"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
)

// runServe runs the HTTP API until SIGINT/SIGTERM, then drains in-flight requests within
// ONCEFLOW_SHUTDOWN_TIMEOUT: the workflows' routes (Client.Mount) beside /healthz,
// /readyz and /metrics, on a Client without the model (serve runs no jobs).
func runServe(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "serve", "", config.GroupRedis, config.GroupPostgres, config.GroupAPI, config.GroupUI, config.GroupJobs,
		config.GroupHTTP, config.GroupShutdown, config.GroupLogs)
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	c, err := d.appClient(e, false)
	if err != nil {
		return err
	}
	s, err := d.appServer(c)
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

// appServer returns the HTTP server of serve and run: d's health, readiness and metrics
// endpoints, and every workflow's routes (Client.Mount), each counted under its
// pattern's path ("/v1/summaries/{job_id}"), and the operator UI under /ui/ when
// ONCEFLOW_ADMIN_KEYS is set. ONCEFLOW_API_KEYS is required when a workflow has routes
// (Host.Tenant authenticates with it).
func (d *deps) appServer(c *onceflow.Client) (*httpapi.Server, error) {
	if slices.ContainsFunc(c.Inspector().Workflows(), func(wf onceflow.Workflow) bool { return wf.Routes != nil }) {
		if err := d.cfg.RequireAPIKeys(); err != nil {
			return nil, err
		}
	}
	mux := http.NewServeMux()
	if err := c.Mount(mux); err != nil {
		return nil, &config.Error{Name: "workflows", Err: err}
	}
	if len(d.cfg.AdminKeys) > 0 {
		ui, err := adminui.New(adminui.Config{Client: c, AdminKeys: d.cfg.AdminKeys, SecureCookies: d.cfg.UISecureCookies,
			JobTTL: d.cfg.ResultTTL, Logger: d.log})
		if err != nil {
			return nil, &config.Error{Name: "ONCEFLOW_ADMIN_KEYS", Err: err}
		}
		mux.Handle(adminui.DefaultBase, ui)
		d.background = append(d.background, ui.Run)
		mux.Handle("GET /ui", http.RedirectHandler(adminui.DefaultBase, http.StatusMovedPermanently))
	}
	// Optional: the first accept then costs one round trip rather than two.
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.IdempotencyTimeout)
	defer cancel()
	if err := c.LoadScripts(ctx); err != nil {
		d.log.Warn("cannot load the accept script; it is sent with the first accept", "err", err)
	}
	s := d.httpServer(nil)
	s.Mount(mux)
	for pattern, codes := range d.routeStatuses {
		s.Statuses(pattern, codes...)
	}
	return s, nil
}
