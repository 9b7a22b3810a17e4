package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/onceflow/onceflow/cli/internal/listen"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
)

// runGateway serves gateway on ONCEFLOW_GATEWAY_ADDR, in front of
// ONCEFLOW_LLM_BASE_URL (docs/providers.md), with /healthz, /readyz and /metrics
// beside /v1/, and purges expired ledger rows. On SIGINT/SIGTERM it stops accepting and
// lets in-flight upstream calls finish and be recorded within ONCEFLOW_SHUTDOWN_TIMEOUT.
func runGateway(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "gateway", "", config.GroupRedis, config.GroupPostgres, config.GroupGateway, config.GroupModel,
		config.GroupLimits, config.GroupLedger, config.GroupHTTP, config.GroupShutdown, config.GroupLogs)
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	upstream := cfg.LLMBaseURL
	if upstream == "" {
		upstream = openAIBaseURL
	}
	// The limiter needs Redis: the gateway uses it when a limit is configured.
	lc := limitsConfig(cfg)
	limited := cfg.LLMAdmission && (!lc.Limits.IsZero() || len(lc.Models) > 0 || lc.TenantConcurrency > 0 || lc.TenantTokenBudget > 0)
	d, err := newDeps(ctx, cfg, log, limited, true)
	if err != nil {
		return err
	}
	defer d.Close()
	var lim *limiter.Limiter
	if limited {
		lc.Prefix, lc.Provider, lc.Logger, lc.Registerer = cfg.Prefix, cfg.LLM, log, d.reg
		lim, err = limiter.New(d.rdb, lc)
		if err != nil {
			return err
		}
	}
	derive := cfg.GatewayDeriveKeys
	if derive == "off" {
		derive = ""
	}
	g, err := gateway.New(gateway.Config{
		Upstream: upstream,
		DB:       d.pool,
		Ledger: ledger.Config{Lease: cfg.LedgerLease, Retention: cfg.LedgerRetention, RelaxedInsert: cfg.LedgerRelaxedInsert,
			GroupLinger: cfg.LedgerGroupLinger, Models: []string{cfg.LLMModel}},
		Timeout:           cfg.GatewayTimeout,
		JoinTimeout:       cfg.GatewayJoinTimeout,
		DeriveKeys:        derive,
		DeriveWindow:      cfg.GatewayDeriveWindow,
		Limiter:           lim,
		TenantHeader:      cfg.GatewayTenantHeader,
		MaxBodyBytes:      int64(cfg.GatewayMaxBody),
		CredentialHeaders: cfg.GatewayCredentialHeaders,
		Logger:            log,
		Registerer:        d.reg,
	})
	if err != nil { // config validated the header names: what is left is the upstream
		return &config.Error{Name: "ONCEFLOW_LLM_BASE_URL", Value: config.RedactURL(upstream), Err: err}
	}
	// /readyz checks the ledger's tables too: a gateway on a database nobody migrated
	// takes no traffic, and says why.
	s := d.httpServer(map[string]httpapi.Check{"ledger": g.Ready})
	if err := g.Ready(ctx); errors.Is(err, gateway.ErrNotMigrated) {
		log.ErrorContext(ctx, "gateway: not ready: every keyed request fails until the database is migrated", "err", err)
	}
	s.Handle("/v1/", "/v1/", g)
	log.InfoContext(ctx, "starting gateway", "config", cfg, "upstream", config.RedactURL(upstream))
	serve := func(ctx context.Context) error {
		err := httpapi.Serve(ctx, cfg.GatewayAddr, s, listen.ServeConfig(cfg, log, func(a net.Addr) {
			log.InfoContext(ctx, "gateway listening", "addr", a.String(), "base_url", fmt.Sprintf("http://%s/v1", a))
		}))
		// Calls that outlived the shutdown timeout are given up: record them as ambiguous
		// failures, so a retry sent to another gateway takes them over at once.
		// The records of streams already passed on whole are made after their handler
		// returned: Close waits for them too, as long as a shutdown may take.
		cctx, cancel := context.WithTimeout(context.Background(), max(cfg.ShutdownTimeout, 5*time.Second))
		defer cancel()
		if cerr := g.Close(cctx); cerr != nil {
			log.Warn("gateway: calls given up at shutdown not all recorded; their leases will run out", "err", cerr)
		}
		return err
	}
	roles := []func(context.Context) error{serve, g.Run}
	if lim != nil {
		roles = append(roles, lim.Run)
	}
	if err := runAll(ctx, d, s, "", roles...); err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	log.InfoContext(ctx, "gateway stopped")
	return nil
}
