package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/queue"
)

// serviceQueue is the queue the API enqueues summary jobs to and `work` consumes.
const serviceQueue = "summaries"

// serviceKeys names the service's queue keys under ONCEFLOW_PREFIX.
func serviceKeys(cfg *config.Config) queue.Keys {
	return queue.Keys{Prefix: cfg.Prefix, Queue: serviceQueue}
}

// jobHandler builds the handler `work` runs for the service's jobs. The summaries
// handler replaces this placeholder when it lands (issue 6); until then `work` runs
// only with --test-handler.
var jobHandler = func(_ context.Context, _ *config.Config, _ *slog.Logger, _ *redis.Client) (queue.Handler, error) {
	return nil, usageErrorf("no job handler is built in yet; run with --test-handler (a test aid, see `onceflow work -h`)")
}

// runWork runs a queue worker until SIGINT/SIGTERM, then finishes or hands back the jobs
// in flight within ONCEFLOW_SHUTDOWN_TIMEOUT and exits 0.
func runWork(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "work", "[--test-handler SPEC]")
	loader := config.Register(fs)
	testSpec := fs.String("test-handler", "", "TEST AID, not for production: run `"+testHandlerSpecs+"` instead of the service's handler")
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	rdb, err := connect.Redis(cfg.RedisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	keys := serviceKeys(cfg)
	var h queue.Handler
	if *testSpec != "" {
		h, err = newTestHandler(*testSpec, rdb, keys)
	} else {
		h, err = jobHandler(ctx, cfg, log, rdb)
	}
	if err != nil {
		return err
	}
	reg := newRegistry()
	w, err := queue.NewWorker(queue.WorkerConfig{
		Redis: rdb, Keys: keys, Handler: h,
		Concurrency:     cfg.WorkerConcurrency,
		ClaimIdle:       cfg.ClaimIdle,
		MaxDeliveries:   cfg.MaxDeliveries,
		ShutdownTimeout: cfg.ShutdownTimeout,
		Logger:          log,
		Registerer:      reg,
	})
	if err != nil {
		return usageErrorf("%v", err)
	}
	log.InfoContext(ctx, "starting work", "config", cfg, "consumer", w.Consumer(), "test_handler", *testSpec)

	metricsDone := make(chan error, 1)
	if cfg.MetricsAddr != "" {
		ln, err := net.Listen("tcp", cfg.MetricsAddr)
		if err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
		api := httpapi.New(httpapi.Config{Logger: log, Registry: reg, Checks: map[string]httpapi.Check{
			"redis": func(ctx context.Context) error { return rdb.Ping(ctx).Err() },
		}})
		go func() { metricsDone <- httpapi.ServeListener(ctx, ln, api, cfg.ShutdownTimeout, log, nil) }()
	} else {
		metricsDone <- nil
	}
	runErr := w.Run(ctx)
	if err := <-metricsDone; err != nil {
		runErr = errors.Join(runErr, err)
	}
	return runErr
}
