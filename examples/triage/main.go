// Command triage is a support-ticket triage agent built on onceflow's public API: POST
// /v1/tickets (with an Idempotency-Key) enqueues a ticket; the worker asks the model,
// which may call issue_refund(order_id, amount_cents); the refund goes to a payments
// webhook and a reply email to a mailer webhook, each exactly once. A refund over
// TRIAGE_HOLD_REFUNDS_OVER_CENTS is held for an operator (TRIAGE_ADMIN_KEYS) first.
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
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, os.Getenv); err != nil {
		log.Error("triage failed", "err", err)
		os.Exit(1)
	}
}

// run serves the API and works the triage queue until ctx ends.
func run(ctx context.Context, log *slog.Logger, env func(string) string) error {
	rdb, err := onceflow.NewRedis(env("ONCEFLOW_REDIS_URL"))
	if err != nil {
		return err
	}
	db, err := onceflow.NewPostgres(ctx, env("ONCEFLOW_DATABASE_URL"))
	if err != nil {
		return err
	}
	payments, err := webhook.New(webhook.Config{URL: env("PAYMENTS_URL"), Body: webhook.PayloadOnly})
	if err != nil {
		return err
	}
	mailer, err := webhook.New(webhook.Config{URL: env("MAILER_URL"), Body: webhook.PayloadOnly})
	if err != nil {
		return err
	}
	claimIdle, _ := time.ParseDuration(env("ONCEFLOW_CLAIM_IDLE")) // "" or invalid: the default
	lease, _ := time.ParseDuration(env("ONCEFLOW_RELAY_LEASE"))    // likewise
	holdOver, err := cents(env("TRIAGE_HOLD_REFUNDS_OVER_CENTS"))
	if err != nil {
		return err
	}
	opts := Options{Tenant: bearer(env("TRIAGE_API_KEYS")), Operator: bearer(env("TRIAGE_ADMIN_KEYS")), Model: env("TRIAGE_MODEL"),
		Payments: payments, Mailer: mailer, Queue: onceflow.QueueConfig{ClaimIdle: claimIdle}, HoldRefundsOverCents: holdOver}
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: env("ONCEFLOW_PREFIX"), Logger: log,
		Model: openai.New(openai.Config{BaseURL: env("OPENAI_BASE_URL"), APIKey: env("OPENAI_API_KEY")}), Provider: "openai",
		Relay: outbox.Config{Lease: lease}, Workflows: []onceflow.Workflow{Workflow(opts)}, Gates: opts.Gates()})
	if err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, env("ONCEFLOW_DATABASE_URL"), log, client.Migrations()...); err != nil {
		return err
	}
	mux := http.NewServeMux()
	if err := client.Mount(mux); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cmp.Or(env("TRIAGE_ADDR"), "127.0.0.1:8080"))
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second}
	go func() {
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
	log.Info("triage listening", "addr", ln.Addr().String())
	return client.Run(ctx)
}

// cents parses TRIAGE_HOLD_REFUNDS_OVER_CENTS: "" is 0 (no refund held).
func cents(v string) (int, error) {
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("TRIAGE_HOLD_REFUNDS_OVER_CENTS=%q: want a whole number of cents: %w", v, err)
	}
	if n < 0 {
		return 0, fmt.Errorf("TRIAGE_HOLD_REFUNDS_OVER_CENTS=%d: want 0 (hold none) or more", n)
	}
	return n, nil
}

// bearer returns the tenant func of TRIAGE_API_KEYS ("key1=tenant1,key2=tenant2"):
// the tenant of the request's bearer token.
func bearer(keys string) func(*http.Request) (string, error) {
	tenants := map[string]string{}
	for _, kv := range strings.Split(keys, ",") {
		if k, t, ok := strings.Cut(kv, "="); ok {
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
