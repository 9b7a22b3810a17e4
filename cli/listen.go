package cli

import (
	"log/slog"
	"net"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
)

// httpLimits are what one client can hold of any listener of the process
// (ONCEFLOW_HTTP_READ_HEADER_TIMEOUT, ONCEFLOW_HTTP_READ_TIMEOUT,
// ONCEFLOW_HTTP_IDLE_TIMEOUT, ONCEFLOW_HTTP_MAX_HEADER_BYTES).
func httpLimits(cfg *config.Config) httpapi.Limits {
	return httpapi.Limits{
		ReadHeaderTimeout: cfg.HTTPReadHeaderTimeout,
		ReadTimeout:       cfg.HTTPReadTimeout,
		IdleTimeout:       cfg.HTTPIdleTimeout,
		MaxHeaderBytes:    cfg.HTTPMaxHeaderBytes,
	}
}

// serveConfig is how every listener of the process serves: with cfg's limits, draining
// within ONCEFLOW_SHUTDOWN_TIMEOUT. ready, when not nil, gets the bound address.
func serveConfig(cfg *config.Config, log *slog.Logger, ready func(net.Addr)) httpapi.ServeConfig {
	return httpapi.ServeConfig{Limits: httpLimits(cfg), ShutdownTimeout: cfg.ShutdownTimeout, Logger: log, Ready: ready}
}
