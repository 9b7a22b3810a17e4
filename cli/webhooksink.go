package cli

import (
	"context"
	"fmt"
	"net"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/webhooksink"
)

// runWebhookSink serves a webhook receiver that records every delivery and reports the
// counts per Idempotency-Key on GET: the email provider of `make demo` and of the chaos
// suite, and a way to try ONCEFLOW_SENDER=webhook without a real provider.
func runWebhookSink(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "webhook-sink", "[--addr ADDR] [--latency D] [--fail-rate P] [--fail-status N] [--retry-after D] [--seed N]",
		config.GroupHTTP, config.GroupLogs)
	addr := fs.String("addr", "127.0.0.1:8099", "listen address (port 0: any free port; the log line names it)")
	latency := fs.Duration("latency", 0, "delay of every answer (the delivery is recorded on arrival)")
	failRate := fs.Float64("fail-rate", 0, "probability from 0 to 1 of answering --fail-status instead of recording")
	failStatus := fs.Int("fail-status", 503, "status of injected failures")
	retryAfter := fs.Duration("retry-after", 0, "Retry-After sent with injected failures (0: none)")
	seed := fs.Uint64("seed", 0, "seed of injected failures (0: random)")
	cfg, log, err := load(e, fs, config.Register(fs), args) // ONCEFLOW_HTTP_* and ONCEFLOW_LOG_FORMAT apply
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return usageErrorf("webhook-sink takes no arguments")
	case *failRate < 0 || *failRate > 1:
		return usageErrorf("--fail-rate must be between 0 and 1")
	case *failStatus < 100 || *failStatus > 599:
		return usageErrorf("--fail-status must be an HTTP status")
	case *latency < 0 || *retryAfter < 0:
		return usageErrorf("durations must not be negative")
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	sink := webhooksink.New(webhooksink.Options{Latency: *latency, FailRate: *failRate, FailStatus: *failStatus,
		RetryAfter: *retryAfter, Seed: *seed})
	if err := webhooksink.Serve(ctx, ln, sink, httpLimits(cfg), log); err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	st := sink.Stats()
	log.InfoContext(ctx, "webhook sink stopped", "deliveries", st.Deliveries, "distinct_keys", st.DistinctKeys,
		"duplicated_keys", len(st.Duplicates), "failed", st.Failed)
	return nil
}
