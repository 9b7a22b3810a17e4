package cli

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
)

// runServe runs the HTTP API until SIGINT/SIGTERM, then drains in-flight requests within
// ONCEFLOW_SHUTDOWN_TIMEOUT. In a program with App.Workflows it serves their routes
// (Client.Mount) beside /healthz, /readyz and /metrics.
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
	var s *httpapi.Server
	if e.hosted() {
		var c *onceflow.Client
		if c, err = d.appClient(e, false); err == nil {
			s, err = d.appServer(c)
		}
	} else {
		s, err = d.apiServer()
	}
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

// appServer returns the HTTP server of serve and run for App.Workflows: d's health,
// readiness and metrics endpoints, and every workflow's routes (Client.Mount), counted
// under the route label "workflows". ONCEFLOW_API_KEYS is required when a workflow has
// routes (Host.Tenant authenticates with it).
func (d *deps) appServer(c *onceflow.Client) (*httpapi.Server, error) {
	s := d.httpServer()
	mux := http.NewServeMux()
	if err := c.Mount(mux); err != nil {
		return nil, &config.Error{Name: "workflows", Err: err}
	}
	if slices.ContainsFunc(c.Workflows(), func(wf onceflow.Workflow) bool { return wf.Routes != nil }) {
		if err := d.cfg.RequireAPIKeys(); err != nil {
			return nil, err
		}
	}
	s.Handle("/", "workflows", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, pattern := mux.Handler(r); pattern == "" {
			// No workflow route: answer as the server does, {"detail": ...} in JSON,
			// with net/http's status (404, or 405 with Allow).
			rec := &statusOnly{header: http.Header{}}
			mux.ServeHTTP(rec, r)
			if allow := rec.header.Get("Allow"); allow != "" {
				w.Header().Set("Allow", allow)
			}
			code := cmp.Or(rec.status, http.StatusNotFound)
			httpapi.WriteError(w, code, strings.ToLower(http.StatusText(code)))
			return
		}
		mux.ServeHTTP(w, r)
	}), http.StatusOK, http.StatusAccepted, http.StatusNotFound)
	return s, nil
}

// statusOnly records the status and headers of an answer, discarding its body.
type statusOnly struct {
	header http.Header
	status int
}

func (u *statusOnly) Header() http.Header         { return u.header }
func (u *statusOnly) Write(b []byte) (int, error) { return len(b), nil }
func (u *statusOnly) WriteHeader(code int) {
	if u.status == 0 {
		u.status = code
	}
}
