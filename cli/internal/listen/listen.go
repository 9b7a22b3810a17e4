// Package listen is how every HTTP listener of the onceflow command serves (the API,
// the gateway, the metrics listener, fake-llm, webhook-sink): with the limits of the
// ONCEFLOW_HTTP_* settings, draining within ONCEFLOW_SHUTDOWN_TIMEOUT.
package listen

import (
	"log/slog"
	"net"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
)

// Limits are what one client can hold of any listener of the process
// (ONCEFLOW_HTTP_READ_HEADER_TIMEOUT, ONCEFLOW_HTTP_READ_TIMEOUT,
// ONCEFLOW_HTTP_IDLE_TIMEOUT, ONCEFLOW_HTTP_MAX_HEADER_BYTES).
func Limits(cfg *config.Config) httpapi.Limits {
	return httpapi.Limits{
		ReadHeaderTimeout: cfg.HTTPReadHeaderTimeout,
		ReadTimeout:       cfg.HTTPReadTimeout,
		IdleTimeout:       cfg.HTTPIdleTimeout,
		MaxHeaderBytes:    cfg.HTTPMaxHeaderBytes,
	}
}

// ServeConfig is how every listener of the process serves: with cfg's Limits, draining
// within ONCEFLOW_SHUTDOWN_TIMEOUT. ready, when not nil, gets the bound address.
func ServeConfig(cfg *config.Config, log *slog.Logger, ready func(net.Addr)) httpapi.ServeConfig {
	return httpapi.ServeConfig{Limits: Limits(cfg), ShutdownTimeout: cfg.ShutdownTimeout, Logger: log, Ready: ready}
}
