package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
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

// watchers are the health checks of Redis and PostgreSQL, and the sharing of the
// model's breaker with the other processes (shareModelBreaker), which Run and
// RunWorkers run. The model's breaker is synchronised once before they return, so that
// a process started during a provider outage takes no job before it knows of it.
func (c *Client) watchers() []func(context.Context) error {
	every := c.cfg.HealthInterval
	parts := []func(context.Context) error{func(ctx context.Context) error {
		nodes := newNodeGauge(c.cfg.Registerer)
		return c.redisBreaker.Watch(ctx, every, func(ctx context.Context) error {
			up, err := pingNodes(ctx, c.rdb)
			nodes.set(up)
			if errors.Is(err, ErrSomeRedisNodesDown) {
				return nil // the partitions on the others work; a job on a silent node fails and is retried
			}
			return err
		})
	}}
	if c.pgBreaker != nil {
		parts = append(parts, func(ctx context.Context) error { return c.pgBreaker.Watch(ctx, every, c.cfg.DB.Ping) })
	}
	if c.model != nil {
		s := &fleetBreaker{c: c}
		ctx, cancel := context.WithTimeout(context.Background(), max(every, 2*time.Second))
		s.sync(ctx)
		cancel()
		parts = append(parts, s.run)
	}
	return parts
}

// fleetReason starts the reason of a trip learnt from another process.
const fleetReason = "another process stopped calling the model: "

// fleetState is what the fleet key of the model's breaker holds.
type fleetState struct {
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
	Until  time.Time `json:"until"`
}

// fleetBreaker shares the model's breaker across the processes of a deployment through
// one Redis key (Prefix:breaker:llm): a process whose breaker opened on its own (a
// quota answer, a run of 5xx) publishes it, with a TTL until its next probe, refreshed
// while it stays open and deleted when a probe closes it; a process whose breaker is
// closed and finds the key opens its own until then. So a 503 window that one process
// noticed stops the others, and a process started (a rolling restart) during it takes
// no job that would spend an attempt on it. One Redis round trip per HealthInterval per
// process, off the jobs' path.
type fleetBreaker struct {
	c         *Client
	published bool // this process's own trip is in the key
}

func (f *fleetBreaker) key() string { return f.c.cfg.Prefix + ":breaker:llm" }

// run syncs every HealthInterval until ctx ends.
func (f *fleetBreaker) run(ctx context.Context) error {
	t := time.NewTicker(f.c.cfg.HealthInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		sctx, cancel := context.WithTimeout(ctx, f.c.cfg.HealthInterval)
		f.sync(sctx)
		cancel()
	}
}

// sync publishes this process's open breaker, or adopts the fleet's. Redis errors are
// ignored: the local breaker works on its own.
func (f *fleetBreaker) sync(ctx context.Context) {
	b := f.c.model.breaker
	var open *breaker.OpenError
	if errors.As(b.Err(), &open) {
		if strings.HasPrefix(open.Reason, fleetReason) {
			return // learnt from the fleet: the publisher refreshes it
		}
		v, err := json.Marshal(fleetState{Reason: open.Reason, Since: open.Since, Until: open.NextProbe})
		if err != nil {
			return
		}
		if f.c.rdb.Set(ctx, f.key(), v, max(time.Until(open.NextProbe), time.Second)).Err() == nil {
			f.published = true
		}
		return
	}
	if f.published {
		if f.c.rdb.Del(ctx, f.key()).Err() == nil {
			f.published = false
		}
		return
	}
	raw, err := f.c.rdb.Get(ctx, f.key()).Bytes()
	if err != nil {
		return
	}
	var st fleetState
	if json.Unmarshal(raw, &st) != nil {
		return
	}
	if wait := time.Until(st.Until); wait > 0 {
		b.Trip(errors.New(fleetReason+st.Reason), wait)
	}
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

// callError maps the final error of a model step (after its in-process
// retries) onto the job's error vocabulary (modelError), counting a failure of the
// provider itself (providerFailure) in the model's breaker. Only a failure right after a
// call that worked spends a delivery of the job; the failure that opens the breaker, any
// while it is open, and any that continues a run of failing calls (this job's or
// others') are the provider's outage, not the job's: Unavailable, so the job is handed
// back (with a growing delay) without spending a delivery. So an outage, however many
// processes meet it and however fast, dead-letters no job; a job whose own input makes
// the provider fail spends a delivery each time it fails after another job's success,
// and is dead-lettered after its deliveries (with no other traffic it holds the breaker
// open, visibly, until another job's call closes it). A failure is judged by when its
// last call started (started): one that went during an outage and failed just after
// other calls worked again is the outage's (breaker.FailureStarted).
func (m *model) callError(step string, err error, started time.Time) error {
	var wait *retry.WaitError
	if errors.Is(err, limiter.ErrQuotaPaused) && errors.As(err, &wait) && m.breaker.Err() == nil {
		// The fleet paused the model for an exhausted quota (another process, or this
		// one before a restart, met it): the breaker says so too, in /readyz and its
		// metrics, for the pause. The job waits for it (the WaitError), as it would.
		m.breaker.Trip(fmt.Errorf("%s (the limiter paused the model for every process)", wait.Reason), wait.Delay)
	}
	if !providerFailure(err) {
		return modelError(step, err)
	}
	open, inRun := m.breaker.FailureStarted(err, started)
	if open {
		if open := m.breaker.Err(); open != nil {
			return retry.Unavailable(fmt.Errorf("onceflow: model step %q: %w (%w)", step, err, open))
		}
		return retry.Unavailable(fmt.Errorf("onceflow: model step %q: %w", step, err))
	}
	if inRun {
		return retry.Unavailable(fmt.Errorf("onceflow: model step %q: %w (the provider's calls are failing in a row)", step, err))
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
