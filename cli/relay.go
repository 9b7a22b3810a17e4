package cli

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/smtp"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// runRelay drains the outbox until SIGINT/SIGTERM, then lets the sends in flight finish
// within ONCEFLOW_SHUTDOWN_TIMEOUT, marks what was sent and releases the rest. It sends
// the workflows' effects with their senders, by topic (Client.RunRelay), and claims only
// those topics; EnqueueTx's jobs go to Redis, which /readyz reports without failing on.
func runRelay(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "relay", "", config.GroupRedis, config.GroupPostgres, config.GroupJobs, config.GroupSender, config.GroupRelay,
		config.GroupMetrics, config.GroupHTTP, config.GroupShutdown, config.GroupLogs)
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	d, err := newRoleDeps(ctx, e, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	d.redisDegraded = true
	c, err := d.appClient(e, false)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "starting relay", "config", cfg)
	warnTrialSettings(ctx, log, cfg, false, true)
	if err := runAll(ctx, d, d.httpServer(nil), cfg.MetricsAddr, c.RunRelay); err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	log.InfoContext(ctx, "relay stopped")
	return nil
}

// relayConfig maps the service settings onto the relay library's configuration.
func relayConfig(cfg *config.Config, log *slog.Logger, reg prometheus.Registerer) outbox.Config {
	return outbox.Config{
		BatchSize:       cfg.RelayBatchSize,
		Concurrency:     cfg.RelayConcurrency,
		PollInterval:    cfg.RelayInterval,
		Lease:           cfg.RelayLease,
		MaxAttempts:     cfg.RelayMaxAttempts,
		Retention:       cfg.OutboxRetention,
		ShutdownTimeout: cfg.ShutdownTimeout,
		SampleInterval:  cfg.StatsInterval,
		Logger:          log,
		Registerer:      reg,
	}
}

// newOutboxSender builds the outbox sender ONCEFLOW_SENDER selects: webhook
// (ONCEFLOW_WEBHOOK_URL), smtp (ONCEFLOW_SMTP_URL, ONCEFLOW_SMTP_FROM) or log.
func newOutboxSender(cfg *config.Config, log *slog.Logger) (outbox.Sender, error) {
	switch cfg.Sender {
	case "webhook":
		s, err := webhook.New(webhook.Config{URL: cfg.WebhookURL})
		if err != nil {
			return nil, &config.Error{Name: "ONCEFLOW_WEBHOOK_URL", Value: config.RedactURL(cfg.WebhookURL), Err: err}
		}
		return s, nil
	case "smtp":
		s, err := smtp.New(smtp.Config{URL: cfg.SMTPURL, From: cfg.SMTPFrom})
		if err != nil {
			return nil, &config.Error{Name: "ONCEFLOW_SMTP_URL", Value: config.RedactURL(cfg.SMTPURL), Err: err}
		}
		return s, nil
	default:
		return outbox.LogSender{Logger: log}, nil
	}
}
