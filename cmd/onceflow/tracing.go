package main

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/internal/tracing"
)

// tracingFlushTimeout bounds the flush of the last spans at exit (never more than
// ONCEFLOW_SHUTDOWN_TIMEOUT).
const tracingFlushTimeout = 5 * time.Second

// startTracing starts OpenTelemetry tracing when OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, and hands its provider to the roles d
// builds; otherwise it does nothing. The stop function flushes the last spans; call it
// once the roles have stopped.
func (d *deps) startTracing(ctx context.Context, e *env) (stop func(), err error) {
	s, err := tracing.FromEnv(e.getenv)
	if err != nil || !s.Enabled {
		return func() {}, err
	}
	v, _, _ := buildInfo()
	t, err := tracing.Start(ctx, s, v, d.log)
	if err != nil {
		return nil, err
	}
	d.tp = t.Provider()
	d.log.InfoContext(ctx, "tracing on: OTLP over HTTP", "endpoint", s.Endpoint)
	return func() {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(tracingFlushTimeout, d.cfg.ShutdownTimeout))
		defer cancel()
		if err := t.Shutdown(fctx); err != nil {
			d.log.Warn("tracing: the last spans were not all exported", "err", err)
		}
	}, nil
}
