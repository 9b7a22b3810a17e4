package cli

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/queue"
)

// runWork runs a queue worker with the summaries job handler (or, in a program with
// App.Workflows, the workers of its queues: --queue selects them, default all) until
// SIGINT/SIGTERM, then finishes or hands back the jobs in flight within
// ONCEFLOW_SHUTDOWN_TIMEOUT and exits 0.
func runWork(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "work", strings.TrimSpace("[--queue NAME[,NAME...]] "+testHandlerUsage))
	loader := config.Register(fs)
	queues := queueFlag(fs, "work only this queue (repeatable or comma-separated; default: every queue of the program)")
	testSpec := testHandlerFlag(fs) // test builds only (-tags onceflowtest)
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	if e.hosted() && *testSpec == "" {
		return runWorkHosted(ctx, e, cfg, log, *queues)
	}
	if _, err := selectQueues(*queues, []string{serviceKeys(cfg).Queue}); err != nil {
		return err
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, *testSpec == "")
	if err != nil {
		return err
	}
	defer d.Close()
	var h queue.Handler
	if *testSpec != "" {
		h, err = newTestHandler(*testSpec, d.rdb, d.keys())
		h = d.traceJobs(h)
	} else {
		h, err = d.buildHandler()
	}
	if err != nil {
		return err
	}
	w, err := d.buildWorker(h)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting work", "config", cfg, "consumer", w.Consumer(), "test_handler", *testSpec)
	return runAll(ctx, d, d.httpServer(), cfg.MetricsAddr, append(d.background(), w.Run)...)
}

// runWorkHosted is work for App.Workflows: the Client's workers of the selected queues.
func runWorkHosted(ctx context.Context, e *env, cfg *config.Config, log *slog.Logger, flagged queueList) error {
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
	log.InfoContext(ctx, "starting work", "config", cfg, "queues", queues)
	return runAll(ctx, d, d.httpServer(), cfg.MetricsAddr, func(ctx context.Context) error { return c.RunWorkers(ctx, queues...) })
}

// runAll runs the roles' Run functions and, when addr is set, srv on addr (the API under
// serve and run; /metrics and the health endpoints under work and relay with
// ONCEFLOW_METRICS_ADDR) until ctx is cancelled or one of them fails, which cancels the
// others. Each role drains within ONCEFLOW_SHUTDOWN_TIMEOUT on its own.
func runAll(ctx context.Context, d *deps, srv *httpapi.Server, addr string, roles ...func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if addr != "" {
		var h http.Handler = srv
		if d.tp != nil {
			h = onceflowotel.HTTPHandler(d.tp, srv)
		}
		roles = append(roles, func(ctx context.Context) error {
			return httpapi.Serve(ctx, addr, h, serveConfig(d.cfg, d.log, nil))
		})
	}
	errs := make(chan error, len(roles))
	for _, run := range roles {
		go func() {
			err := run(ctx)
			if err != nil {
				cancel() // one role failed: stop the others
			}
			errs <- err
		}()
	}
	var all error
	for range roles {
		all = errors.Join(all, <-errs)
	}
	return all
}
