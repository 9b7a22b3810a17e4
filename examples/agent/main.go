// Command agent is a multi-turn order-support agent built on onceflow's public API:
// POST /v1/orders/{order}/support (with an Idempotency-Key) enqueues a customer's
// message; the worker runs a model loop with two tools, lookup_order (the orders API)
// and issue_refund (the payments API, keyed by the tool call's content; a refund above
// a threshold waits for an operator), streams its progress on
// GET /v1/jobs/{job_id}/events, and commits the reply with its email exactly once.
// See README.md.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// DefaultApprovalAbove is REFUND_APPROVAL_ABOVE's default, in cents.
const DefaultApprovalAbove = 10000

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, os.Getenv); err != nil {
		log.Error("agent failed", "err", err)
		os.Exit(1)
	}
}

// run serves the API and works the agent queue (AGENT_ROLE all), or does one of the
// three (api, work, relay), until ctx ends.
func run(ctx context.Context, log *slog.Logger, env func(string) string) error {
	var (
		durations = map[string]time.Duration{}
		threshold = DefaultApprovalAbove
	)
	for _, name := range []string{"ONCEFLOW_CLAIM_IDLE", "ONCEFLOW_RELAY_LEASE", "ONCEFLOW_LEDGER_LEASE"} {
		if v := env(name); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return fmt.Errorf("invalid %s=%q: want a positive duration", name, v)
			}
			durations[name] = d
		}
	}
	role := cmp.Or(env("AGENT_ROLE"), "all")
	if role != "all" && role != "api" && role != "work" && role != "relay" {
		return fmt.Errorf("invalid AGENT_ROLE=%q: want all, api, work or relay", role)
	}
	if v := env("REFUND_APPROVAL_ABOVE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return fmt.Errorf("invalid REFUND_APPROVAL_ABOVE=%q: want cents, 0 or more", v)
		}
		threshold = n
	}
	maxDeliveries := 0 // onceflow's default
	if v := env("ONCEFLOW_MAX_DELIVERIES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			return fmt.Errorf("invalid ONCEFLOW_MAX_DELIVERIES=%q: want a positive count", v)
		}
		maxDeliveries = n
	}
	for _, name := range []string{"ORDERS_URL", "PAYMENTS_URL"} {
		if u, err := url.Parse(env(name)); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("invalid %s=%q: want an http or https URL", name, env(name))
		}
	}
	rdb, err := onceflow.NewRedis(env("ONCEFLOW_REDIS_URL"))
	if err != nil {
		return err
	}
	db, err := onceflow.NewPostgres(ctx, env("ONCEFLOW_DATABASE_URL"))
	if err != nil {
		return err
	}
	mailer, err := webhook.New(webhook.Config{URL: env("MAILER_URL"), Body: webhook.PayloadOnly})
	if err != nil {
		return err
	}
	shop := &Shop{HTTP: &http.Client{Timeout: 10 * time.Second},
		OrdersURL: strings.TrimSuffix(env("ORDERS_URL"), "/"), PaymentsURL: env("PAYMENTS_URL")}
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: env("ONCEFLOW_PREFIX"), Logger: log,
		Model: openai.New(openai.Config{BaseURL: env("OPENAI_BASE_URL"), APIKey: env("OPENAI_API_KEY")}), Provider: "openai",
		Relay:  outbox.Config{Lease: durations["ONCEFLOW_RELAY_LEASE"]},
		Ledger: ledger.Config{Lease: durations["ONCEFLOW_LEDGER_LEASE"]},
		Workflows: []onceflow.Workflow{Workflow(Options{Tenant: bearer(env("AGENT_API_KEYS")), Operator: bearer(env("AGENT_ADMIN_KEYS")),
			Model: env("AGENT_MODEL"), Shop: shop, Mailer: mailer, ApprovalAbove: threshold,
			Queue: onceflow.QueueConfig{ClaimIdle: durations["ONCEFLOW_CLAIM_IDLE"], MaxDeliveries: maxDeliveries}})}})
	if err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, env("ONCEFLOW_DATABASE_URL"), log, client.Migrations()...); err != nil {
		return err
	}
	switch role {
	case "work":
		log.Info("agent working", "approval_above", threshold)
		return client.RunWorkers(ctx)
	case "relay":
		log.Info("agent relaying")
		return client.RunRelay(ctx)
	}
	mux := http.NewServeMux()
	if err := client.Mount(mux); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cmp.Or(env("ONCEFLOW_HTTP_ADDR"), "127.0.0.1:8080"))
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second}
	shutdown := make(chan struct{})
	go func() {
		defer close(shutdown)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("http server", "err", err)
		}
	}()
	log.Info("agent listening", "addr", ln.Addr().String(), "approval_above", threshold, "role", role)
	if role == "api" {
		<-shutdown // the requests in flight answered
		return nil
	}
	return client.Run(ctx)
}

// bearer returns the tenant func of keys ("key1=tenant1,key2=tenant2", the value of
// AGENT_API_KEYS or AGENT_ADMIN_KEYS): the tenant of the request's bearer token, or
// idempotency.ErrUnauthenticated.
func bearer(keys string) func(*http.Request) (string, error) {
	tenants := map[string]string{}
	for _, kv := range strings.Split(keys, ",") {
		if k, t, ok := strings.Cut(strings.TrimSpace(kv), "="); ok && k != "" {
			tenants[k] = t
		}
	}
	return func(r *http.Request) (string, error) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if t, known := tenants[token]; ok && known {
			return t, nil
		}
		return "", idempotency.ErrUnauthenticated
	}
}
