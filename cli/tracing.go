package cli

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/cli/internal/tracing"
)

// tracingFlushTimeout bounds the flush of the last spans at exit (never more than
// ONCEFLOW_SHUTDOWN_TIMEOUT).
const tracingFlushTimeout = 5 * time.Second

// startTracing starts OpenTelemetry tracing when OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, and hands its provider to the roles d
// builds; otherwise it does nothing. d.Close flushes the last spans.
func (d *deps) startTracing(ctx context.Context, e *env) error {
	s, err := tracing.FromEnv(e.getenv)
	if err != nil || !s.Enabled {
		return err
	}
	v, _, _ := buildInfo()
	t, err := tracing.Start(ctx, s, v, d.log)
	if err != nil {
		return err
	}
	d.tp = t.Provider()
	d.log.InfoContext(ctx, "tracing on: OTLP over HTTP", "endpoint", s.Endpoint)
	d.stopTracing = func() {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(tracingFlushTimeout, d.cfg.ShutdownTimeout))
		defer cancel()
		if err := t.Shutdown(fctx); err != nil {
			d.log.Warn("tracing: the last spans were not all exported", "err", err)
		}
	}
	return nil
}
