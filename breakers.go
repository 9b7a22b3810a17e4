package onceflow

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/llm/ledger"
	"github.com/onceflow/onceflow/retry"
)

// setupBreakers creates the circuit breakers of Redis and, with Config.DB, PostgreSQL:
// Run and RunWorkers check each every HealthInterval (watchers), and PostgreSQL's also
// counts the jobs that found it unreachable (observeJob).
func (c *Client) setupBreakers() error {
	cfg := &c.cfg
	if cfg.BreakerThreshold < 0 {
		return fmt.Errorf("onceflow: Config.BreakerThreshold %d must not be negative", cfg.BreakerThreshold)
	}
	if cfg.HealthInterval < 0 {
		return fmt.Errorf("onceflow: Config.HealthInterval %v must not be negative", cfg.HealthInterval)
	}
	cfg.HealthInterval = cmp.Or(cfg.HealthInterval, DefaultHealthInterval)
	newBreaker := func(name string) (*breaker.Breaker, error) {
		return breaker.New(breaker.Config{Name: name, ProbeInterval: cfg.HealthInterval, Threshold: cfg.BreakerThreshold,
			Logger: c.log, Registerer: cfg.Registerer})
	}
	var err error
	if c.redisBreaker, err = newBreaker("redis"); err != nil {
		return fmt.Errorf("onceflow: %w", err)
	}
	if cfg.DB != nil {
		if c.pgBreaker, err = newBreaker("postgres"); err != nil {
			return fmt.Errorf("onceflow: %w", err)
		}
	}
	return nil
}

// Breakers returns the client's circuit breakers, for readiness reports (each one's Err
// says since when and why it is open) and for a queue.Gate of one's own (breaker.Set):
//
//   - "redis": opened by BreakerThreshold failing PINGs in a row;
//   - "postgres" (with Config.DB): opened by BreakerThreshold failures in a row of pool
//     pings, or of jobs that found PostgreSQL unreachable (Commit, CommitTx, the model
//     ledger, or a Worker's own PostgresError);
//   - "llm" (with Config.Model): opened by an exhausted quota, or by BreakerThreshold
//     model calls in a row that failed with a 5xx, a timeout or a lost connection
//     after their retries; while it is open model calls fail at once.
//
// Run and RunWorkers check Redis and PostgreSQL every HealthInterval; while one's
// breaker is open that check is its probe, and the first that passes closes it. The
// model's breaker is probed by one job's call every QuotaProbe. The queues take no work
// while a breaker is open (QueueConfig.Gate), so an outage spends no job's deliveries:
// a job that meets it is handed back (ErrUnavailable) and runs once the dependency is
// back. The slice is new on each call; the breakers are the client's.
func (c *Client) Breakers() []*breaker.Breaker {
	out := []*breaker.Breaker{c.redisBreaker}
	if c.pgBreaker != nil {
		out = append(out, c.pgBreaker)
	}
	if c.model != nil {
		out = append(out, c.model.breaker)
	}
	return out
}

// watchers are the health checks of Redis and PostgreSQL, which Run and RunWorkers run.
func (c *Client) watchers() []func(context.Context) error {
	every := c.cfg.HealthInterval
	parts := []func(context.Context) error{func(ctx context.Context) error {
		return c.redisBreaker.Watch(ctx, every, func(ctx context.Context) error { return c.rdb.Ping(ctx).Err() })
	}}
	if c.pgBreaker != nil {
		parts = append(parts, func(ctx context.Context) error { return c.pgBreaker.Watch(ctx, every, c.cfg.DB.Ping) })
	}
	return parts
}

// storeDown returns the *breaker.OpenError of Redis's or PostgreSQL's breaker when one
// is open and watched, else nil. The handler returns it instead of running a job that
// a read in flight when the breaker opened delivered (the gate holds back the reads
// after it): the job is handed back (the error matches ErrUnavailable) and runs once
// the store is back. An unwatched breaker lets the job run: it may be the probe.
func (c *Client) storeDown() error {
	for _, b := range [...]*breaker.Breaker{c.redisBreaker, c.pgBreaker} {
		if b == nil {
			continue
		}
		if err := b.Err(); err != nil && b.Watched() {
			return fmt.Errorf("onceflow: job not run: %w", err)
		}
	}
	return nil
}

// observeJob counts a job that failed because PostgreSQL is unreachable (an
// Unavailable error that postgresUnreachable says is PostgreSQL's: Commit's, the
// ledger's, a Worker's own PostgresError) as a failure of PostgreSQL's breaker. The
// error is already Unavailable, so the job spends no delivery.
func (c *Client) observeJob(err error) {
	if c.pgBreaker != nil && err != nil && errors.Is(err, ErrUnavailable) && postgresUnreachable(err) {
		c.pgBreaker.Failure(err)
	}
}

// postgresWorked tells PostgreSQL's breaker that a statement went through (a commit, a
// ledger call), ending its run of failures.
func (c *Client) postgresWorked() {
	if c.pgBreaker != nil {
		c.pgBreaker.Success()
	}
}

// callError maps the final error of a model step (after its in-process retries) onto
// the job's error vocabulary (modelError), counting a failure of the provider itself
// (providerFailure) in the model's breaker: the failure that opens it, and any while it
// is open, is Unavailable, so the job is handed back without spending a delivery.
func (m *model) callError(step string, err error) error {
	if providerFailure(err) && m.breaker.Failure(err) {
		if open := m.breaker.Err(); open != nil {
			return retry.Unavailable(fmt.Errorf("onceflow: model step %q: %w (%w)", step, err, open))
		}
		return retry.Unavailable(fmt.Errorf("onceflow: model step %q: %w", step, err))
	}
	return modelError(step, err)
}

// providerFailure reports whether err, a model step's final error, says the provider
// failed (a 5xx, a timeout, a lost connection, a 429, on the last attempt), rather
// than the job (a 4xx), the ledger (PostgreSQL), another delivery (a call in flight),
// the delivery's deadline before any call, an open breaker or shutdown.
func providerFailure(err error) bool {
	if err == nil || retry.Outage(err) || errors.Is(err, ledger.ErrUnavailable) || errors.Is(err, ledger.ErrInFlight) {
		return false
	}
	last := err
	var ex *retry.ExhaustedError
	var dl *retry.DeadlineExceededError
	switch {
	case errors.As(err, &ex):
		last = ex.Err
	case errors.As(err, &dl):
		if dl.Err == nil {
			return false // no call was made
		}
		last = dl.Err
	}
	switch retry.Classify(last).Class {
	case retry.ClassServerError, retry.ClassTimeout, retry.ClassConnection, retry.ClassRateLimited:
		return true
	}
	return false
}
