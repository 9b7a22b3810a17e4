package cli

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"

	"github.com/onceflow/onceflow/cli/internal/listen"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/onceflowotel"
	"github.com/onceflow/onceflow/queue"
)

// runWork runs the workers of the program's queues (--queue selects them, default all)
// until SIGINT/SIGTERM, then finishes or hands back the jobs in flight within
// ONCEFLOW_SHUTDOWN_TIMEOUT and exits 0.
func runWork(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "work", strings.TrimSpace("[--queue NAME[,NAME...]] "+testHandlerUsage), config.GroupRedis, config.GroupPostgres,
		config.GroupJobs, config.GroupWorkers, config.GroupModel, config.GroupModelLanes, config.GroupModelCalls, config.GroupLimits, config.GroupLedger, config.GroupMetrics, config.GroupHTTP,
		config.GroupShutdown, config.GroupLogs)
	loader := config.Register(fs)
	queues := queueFlag(fs, "work only this queue (repeatable or comma-separated; default: every queue of the program)")
	testSpec := testHandlerFlag(fs) // test builds only (-tags onceflowtest)
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	if *testSpec != "" {
		return runTestWork(ctx, e, cfg, log, *queues, *testSpec)
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
	log.InfoContext(ctx, "starting work", "config", cfg, "queues", selected)
	warnTrialSettings(ctx, log, cfg, true, false)
	return runAll(ctx, d, d.httpServer(nil), cfg.MetricsAddr, func(ctx context.Context) error { return c.RunWorkers(ctx, selected...) })
}

// runTestWork is `work --test-handler=SPEC` (test builds only): a worker running the
// test handler on one queue of the program (--queue, or its only one), without
// PostgreSQL or a model.
func runTestWork(ctx context.Context, e *env, cfg *config.Config, log *slog.Logger, flagged queueList, spec string) error {
	wfs, err := e.workflows(e.host(cfg, log, nil))
	if err != nil {
		return err
	}
	known := workflowQueues(wfs)
	selected, err := selectQueues(flagged, known)
	if err != nil {
		return err
	}
	if len(selected) != 1 {
		return usageErrorf("--test-handler works one queue: give --queue, one of: %s", strings.Join(known, ", "))
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, false)
	if err != nil {
		return err
	}
	defer d.Close()
	keys := queue.Keys{Prefix: cfg.Prefix, Queue: selected[0]}
	h, err := newTestHandler(spec, d.rdb, keys)
	if err != nil {
		return err
	}
	if d.tp != nil {
		h = onceflowotel.QueueHandler(d.tp, keys.Queue, h)
	}
	w, err := d.buildWorker(keys, h)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting work", "config", cfg, "queues", selected, "consumer", w.Consumer(), "test_handler", spec)
	return runAll(ctx, d, d.httpServer(nil), cfg.MetricsAddr, w.Run)
}

// runAll runs the roles' Run functions and, when addr is set, srv on addr (the API under
// serve and run; /metrics and the health endpoints under work and relay with
// ONCEFLOW_METRICS_ADDR) until ctx is cancelled or one of them fails, which cancels the
// others. Each role drains within ONCEFLOW_SHUTDOWN_TIMEOUT on its own.
func runAll(ctx context.Context, d *deps, srv *httpapi.Server, addr string, roles ...func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	roles = append(roles, d.background...)
	if addr != "" {
		var h http.Handler = srv
		if d.tp != nil {
			h = onceflowotel.HTTPHandler(d.tp, srv)
		}
		roles = append(roles, func(ctx context.Context) error {
			return httpapi.Serve(ctx, addr, h, listen.ServeConfig(d.cfg, d.log, nil))
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
