// Package breaker is a circuit breaker for one dependency that a whole process shares:
// while it is open, callers do not call the dependency and workers do not take new work
// that needs it, so an outage spends no job's budget.
//
// A Breaker is closed until Trip opens it (an exhausted provider quota, for example).
// While open, Allow refuses calls with an *OpenError, which matches
// retry.ErrUnavailable (so retry.Classify reports ClassUnavailable: not retried
// in-process, but transient), and Admit, the queue.Gate a worker consults before it
// reads new work, blocks. Once the probe interval has passed, the breaker is half-open:
// Allow lets exactly one call through as a probe (and schedules the next probe one
// interval later), Admit lets one job through to make it. A probe that succeeds closes
// the breaker (Succeed); one that trips it again keeps it open for another interval.
//
// Every change of state is logged (opening at Error level, so it alerts), and exported
// as metrics labelled with the dependency's name: onceflow_breaker_open (1 while open),
// onceflow_breaker_open_since_timestamp_seconds, onceflow_breaker_trips_total and
// onceflow_breaker_probes_total.
package breaker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/retry"
)

// DefaultProbeInterval is how long a tripped breaker waits before its first probe, and
// between probes, when Config.ProbeInterval is zero and the trip named no wait.
const DefaultProbeInterval = time.Minute

// Config configures a Breaker.
type Config struct {
	// Name names the dependency in errors, logs and the metrics label ("llm",
	// "postgres"). Required.
	Name string
	// ProbeInterval is how long the breaker stays open after a trip before it lets one
	// call through to probe whether the dependency is back, and between probes.
	// Default: DefaultProbeInterval (1m).
	ProbeInterval time.Duration
	// Logger receives the state changes. Default: slog.Default().
	Logger *slog.Logger
	// Registerer exports the breaker's metrics; nil leaves them unexported.
	Registerer prometheus.Registerer
	// Now returns the current time; tests set it. Default: time.Now.
	Now func() time.Time
}

// Breaker is a circuit breaker; see the package documentation. Its methods are safe for
// concurrent use. Create it with New.
type Breaker struct {
	cfg  Config
	log  *slog.Logger
	m    *breakerMetrics
	open atomic.Bool // fast path of Allow and Succeed

	mu      sync.Mutex
	since   time.Time // when it opened
	reason  string    // why, from the last trip
	probeAt time.Time // when the next probe may go
	// admitted is when Admit last let a job through for a probe.
	admitted time.Time
	// gen counts trips and probes; probe is the ticket of the probe out since the last
	// trip (0: none), the only call whose success closes the breaker.
	gen, probe uint64
	changed    chan struct{} // closed and replaced on every change, for Admit
}

// New checks cfg and returns a closed Breaker.
func New(cfg Config) (*Breaker, error) {
	if cfg.Name == "" {
		return nil, errors.New("breaker: Name is required")
	}
	if cfg.ProbeInterval < 0 {
		return nil, fmt.Errorf("breaker %s: ProbeInterval %v is negative", cfg.Name, cfg.ProbeInterval)
	}
	cfg.ProbeInterval = cmp.Or(cfg.ProbeInterval, DefaultProbeInterval)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Breaker{
		cfg: cfg, log: cfg.Logger.With("dependency", cfg.Name), m: newBreakerMetrics(cfg.Registerer, cfg.Name),
		changed: make(chan struct{}),
	}, nil
}

// Name returns the dependency's name.
func (b *Breaker) Name() string { return b.cfg.Name }

// OpenError is what Allow returns while the breaker is open. It matches
// retry.ErrUnavailable.
type OpenError struct {
	// Name is the dependency's.
	Name string
	// Reason is the cause of the last trip.
	Reason string
	// Since is when the breaker opened.
	Since time.Time
	// NextProbe is when the next probe may go.
	NextProbe time.Time
}

// Error says which dependency is unavailable, since when and why.
func (e *OpenError) Error() string {
	return fmt.Sprintf("%s unavailable since %s: %s", e.Name, e.Since.UTC().Format(time.RFC3339), e.Reason)
}

// Unwrap returns retry.ErrUnavailable.
func (e *OpenError) Unwrap() error { return retry.ErrUnavailable }

// Trip opens the breaker because of cause, or keeps it open when it is (a failed
// probe). The next probe may go after wait when it is positive (a Retry-After the
// dependency sent), else after ProbeInterval.
func (b *Breaker) Trip(cause error, wait time.Duration) {
	now := b.cfg.Now()
	if wait <= 0 {
		wait = b.cfg.ProbeInterval
	}
	reason := "tripped"
	if cause != nil {
		reason = cause.Error()
	}
	b.mu.Lock()
	wasOpen := b.open.Load()
	if !wasOpen {
		b.since = now
		b.open.Store(true)
	}
	b.reason = reason
	b.probeAt = now.Add(wait)
	b.gen++
	b.probe = 0
	since := b.since
	b.notifyLocked()
	b.mu.Unlock()

	b.m.trips.Inc()
	if wasOpen {
		b.log.Warn("dependency still unavailable; staying stopped", "since", since, "next_probe_in", wait, "reason", reason)
		return
	}
	b.m.open.Set(1)
	b.m.openSince.Set(float64(since.UnixNano()) / 1e9)
	b.log.Error("dependency unavailable: stopped calling it and taking work that needs it, until a probe succeeds",
		"next_probe_in", wait, "reason", reason)
}

// Ticket identifies a call Allow let through, for Succeed.
type Ticket uint64

// Allow reports whether a call may go now: nil when the breaker is closed, or when it
// is open and a probe is due, in which case this call is the probe and the next one is
// due a ProbeInterval later; otherwise an *OpenError. The ticket goes to Succeed when
// the call works.
func (b *Breaker) Allow() (Ticket, error) {
	if !b.open.Load() {
		return 0, nil
	}
	now := b.cfg.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open.Load() {
		return 0, nil
	}
	if !now.Before(b.probeAt) {
		b.probeAt = now.Add(b.cfg.ProbeInterval)
		b.gen++
		b.probe = b.gen
		b.m.probes.Inc()
		b.log.Info("probing whether the dependency is back", "since", b.since)
		return Ticket(b.gen), nil
	}
	return 0, &OpenError{Name: b.cfg.Name, Reason: b.reason, Since: b.since, NextProbe: b.probeAt}
}

// Succeed reports that the call of ticket t worked. An open breaker closes only when t
// is the probe let through since its last trip: a call allowed before the trip (a long
// generation the provider accepted earlier) says nothing about the dependency now.
func (b *Breaker) Succeed(t Ticket) {
	if !b.open.Load() {
		return
	}
	b.mu.Lock()
	if !b.open.Load() || t == 0 || uint64(t) != b.probe {
		b.mu.Unlock()
		return
	}
	b.open.Store(false)
	since := b.since
	b.since, b.reason, b.probeAt = time.Time{}, "", time.Time{}
	b.notifyLocked()
	b.mu.Unlock()
	b.m.open.Set(0)
	b.m.openSince.Set(0)
	b.log.Info("dependency back: calls and work resume", "unavailable_for", b.cfg.Now().Sub(since).Round(time.Millisecond))
}

// Err returns nil while the breaker is closed, else the *OpenError describing it; it
// never claims a probe. Use it for readiness reports.
func (b *Breaker) Err() error {
	if !b.open.Load() {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open.Load() {
		return nil
	}
	return &OpenError{Name: b.cfg.Name, Reason: b.reason, Since: b.since, NextProbe: b.probeAt}
}

// Admit blocks while the breaker is open and no probe is due, and returns how many
// jobs a worker may take: 0 (no limit) when closed, 1 when open with a probe due, so
// that the job it takes makes the probe (one job per probe, across every worker that
// shares the breaker; another after a few seconds if that job made no call). It
// returns ctx's error when ctx ends first. It implements queue.Gate.
func (b *Breaker) Admit(ctx context.Context) (int, error) {
	for {
		if !b.open.Load() {
			return 0, nil
		}
		b.mu.Lock()
		if !b.open.Load() {
			b.mu.Unlock()
			return 0, nil
		}
		now := b.cfg.Now()
		wait := b.probeAt.Sub(now)
		if wait <= 0 {
			// One job per due probe; another only if that one has not made its call
			// (Allow) within probeAdmitGrace, as when it needed no call at all.
			if b.admitted.Before(b.probeAt) || now.Sub(b.admitted) >= probeAdmitGrace {
				b.admitted = now
				b.mu.Unlock()
				return 1, nil
			}
			wait = b.admitted.Add(probeAdmitGrace).Sub(now)
		}
		changed := b.changed
		b.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, ctx.Err()
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

// probeAdmitGrace is how long Admit waits for the job it let through to make the probe
// before it lets another through.
const probeAdmitGrace = 5 * time.Second

// notifyLocked wakes every Admit waiting on the current state; b.mu is held.
func (b *Breaker) notifyLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

type breakerMetrics struct {
	open, openSince prometheus.Gauge
	trips, probes   prometheus.Counter
}

func newBreakerMetrics(reg prometheus.Registerer, name string) *breakerMetrics {
	open := metrics.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "breaker", Name: "open",
		Help: "1 while the circuit breaker of a dependency is open (calls to it stopped, work that needs it held back), else 0.",
	}, []string{"dependency"}))
	since := metrics.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "breaker", Name: "open_since_timestamp_seconds",
		Help: "When the circuit breaker of a dependency opened, as a Unix time; 0 while closed.",
	}, []string{"dependency"}))
	trips := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "breaker", Name: "trips_total",
		Help: "Trips of the circuit breaker of a dependency: the first, and every failed probe.",
	}, []string{"dependency"}))
	probes := metrics.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "breaker", Name: "probes_total",
		Help: "Calls let through an open circuit breaker to probe whether its dependency is back.",
	}, []string{"dependency"}))
	m := &breakerMetrics{open: open.WithLabelValues(name), openSince: since.WithLabelValues(name),
		trips: trips.WithLabelValues(name), probes: probes.WithLabelValues(name)}
	return m
}
