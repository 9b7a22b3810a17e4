// Package webhooksink is the `webhook-sink` command of the onceflow binary: a webhook
// receiver that records every delivery and reports the counts per Idempotency-Key on
// GET (internal/webhooksink), the email provider of `make demo` and of the chaos suite,
// and a way to try ONCEFLOW_SENDER=webhook without a real provider. A program of one's
// own built on package cli has it only when it lists Command in cli.App.Commands.
package webhooksink

import (
	"context"
	"fmt"
	"net"

	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/internal/listen"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/webhooksink"
)

// Command returns the `webhook-sink` command, for cli.App.Commands.
func Command() cli.Command {
	return cli.Command{
		Name:    "webhook-sink",
		Summary: "a webhook receiver counting deliveries per Idempotency-Key (make demo's email provider; GET shows duplicates)",
		Run:     run,
	}
}

// run serves the sink on --addr until SIGINT/SIGTERM, then logs its counts.
func run(ctx context.Context, e cli.Env, args []string) error {
	fs := e.Flags("webhook-sink", "[--addr ADDR] [--latency D] [--fail-rate P] [--fail-status N] [--retry-after D] [--seed N]",
		config.GroupHTTP, config.GroupLogs)
	addr := fs.String("addr", "127.0.0.1:8099", "listen address (port 0: any free port; the log line names it)")
	latency := fs.Duration("latency", 0, "delay of every answer (the delivery is recorded on arrival)")
	failRate := fs.Float64("fail-rate", 0, "probability from 0 to 1 of answering --fail-status instead of recording")
	failStatus := fs.Int("fail-status", 503, "status of injected failures")
	retryAfter := fs.Duration("retry-after", 0, "Retry-After sent with injected failures (0: none)")
	seed := fs.Uint64("seed", 0, "seed of injected failures (0: random)")
	cfg, log, err := e.Load(fs, config.Register(fs), args) // ONCEFLOW_HTTP_* and ONCEFLOW_LOG_FORMAT apply
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return cli.UsageErrorf("webhook-sink takes no arguments")
	case *failRate < 0 || *failRate > 1:
		return cli.UsageErrorf("--fail-rate must be between 0 and 1")
	case *failStatus < 100 || *failStatus > 599:
		return cli.UsageErrorf("--fail-status must be an HTTP status")
	case *latency < 0 || *retryAfter < 0:
		return cli.UsageErrorf("durations must not be negative")
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	sink := webhooksink.New(webhooksink.Options{Latency: *latency, FailRate: *failRate, FailStatus: *failStatus,
		RetryAfter: *retryAfter, Seed: *seed})
	if err := webhooksink.Serve(ctx, ln, sink, listen.Limits(cfg), log); err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	st := sink.Stats()
	log.InfoContext(ctx, "webhook sink stopped", "deliveries", st.Deliveries, "distinct_keys", st.DistinctKeys,
		"duplicated_keys", len(st.Duplicates), "failed", st.Failed)
	return nil
}
