// Package breaker is a circuit breaker for one dependency that a whole process shares:
// while it is open, callers do not call the dependency and workers do not take new work
// that needs it, so an outage spends no job's budget.
//
// A Breaker is closed until it opens, in one of three ways: Trip opens it at once (an
// exhausted provider quota, for example); Failure counts a transient failure of the
// dependency and opens it after Config.Threshold of them in a row, across calls, a
// success in between (Success, or Succeed) ending the run; and Watch, a health probe,
// calls a check every interval and counts its failures as Failure does.
//
// While open, Allow refuses calls with an *OpenError, which matches retry.ErrUnavailable
// (so retry.Classify reports ClassUnavailable: not retried in-process, but transient),
// and Admit, the queue.Gate a worker consults before it reads new work, blocks. Once
// the probe interval has passed, the breaker is half-open. A watched breaker (one whose
// Watch runs) is probed by its check: a check that succeeds closes it, one that fails
// keeps it open for another interval, and Admit lets no job through until it closes.
// An unwatched one is probed by a call: Allow lets exactly one call through (and
// schedules the next probe one interval later), Admit lets one job through to make it;
// a probe that succeeds closes the breaker (Succeed), one that trips it again keeps it
// open for another interval.
//
// Set combines the breakers of the dependencies a worker needs into one queue.Gate.
// While every breaker is closed, Admit, Allow, Succeed and Success cost an atomic load
// each: no lock, no allocation.
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
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/retry"
)

// Defaults of Config.
const (
	// DefaultProbeInterval is how long a tripped breaker waits before its first probe,
	// and between probes, when Config.ProbeInterval is zero and the trip named no wait.
	DefaultProbeInterval = time.Minute
	// DefaultThreshold is how many transient failures in a row (Failure, or failing
	// checks of Watch) open a breaker when Config.Threshold is zero.
	DefaultThreshold = 5
)

// MinCheckTimeout is the least time Watch gives one check: its timeout is the interval,
// or this when the interval is shorter.
const MinCheckTimeout = time.Second

// Config configures a Breaker.
type Config struct {
	// Name names the dependency in errors, logs and the metrics label ("llm",
	// "postgres"). Required.
	Name string
	// ProbeInterval is how long the breaker stays open after a trip before it lets one
	// call through to probe whether the dependency is back, and between probes.
	// Default: DefaultProbeInterval (1m).
	ProbeInterval time.Duration
	// RunProbeInterval is ProbeInterval for a breaker opened by a run of failures
	// (Failure) rather than by Trip: a run of 5xx usually clears sooner than an
	// exhausted quota, so it may be probed more often. Default: ProbeInterval.
	RunProbeInterval time.Duration
	// Threshold is how many transient failures of the dependency in a row, across
	// calls (Failure, or failing checks of Watch), open the breaker; a success in
	// between (Success, Succeed, a passing check) starts the count again. Default:
	// DefaultThreshold (5).
	Threshold int
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
	open atomic.Bool // fast path of Allow, Admit, Succeed and Success
	// failing is the length of the current run of failures (written under mu): the
	// fast path of Success, which has nothing to do while it is 0.
	failing atomic.Int64
	// runStart is when the current run of failures began (under mu).
	runStart time.Time
	// endedRuns are the last runs of failures that ended (at most maxEndedRuns), oldest
	// first, each from its first failure to the call that worked again or the breaker's
	// closing (under mu; FailureStarted). Runs follow one another, so both ends ascend.
	endedRuns []span
	// openedRun is when the outage the open breaker stands for began: the first failure
	// of the run that opened it, or its opening (under mu).
	openedRun time.Time
	// interval is the time between probes of the current opening (under mu).
	interval time.Duration
	// watchers counts the Watch loops running: while one runs, its checks are the
	// probes and Admit lets no job through an open breaker.
	watchers atomic.Int32

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
	if cfg.Threshold < 0 {
		return nil, fmt.Errorf("breaker %s: Threshold %d is negative", cfg.Name, cfg.Threshold)
	}
	cfg.ProbeInterval = cmp.Or(cfg.ProbeInterval, DefaultProbeInterval)
	if cfg.RunProbeInterval < 0 {
		return nil, fmt.Errorf("breaker %s: RunProbeInterval %v is negative", cfg.Name, cfg.RunProbeInterval)
	}
	cfg.RunProbeInterval = cmp.Or(cfg.RunProbeInterval, cfg.ProbeInterval)
	cfg.Threshold = cmp.Or(cfg.Threshold, DefaultThreshold)
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
	reason := "tripped"
	if cause != nil {
		reason = cause.Error()
	}
	b.mu.Lock()
	b.trip(reason, wait, false, b.cfg.ProbeInterval)
}

// trip opens the breaker or keeps it open, for reason, and unlocks b.mu, which the
// caller holds; quiet logs a failed probe at Debug level rather than Warn (Watch's
// checks, every interval).
func (b *Breaker) trip(reason string, wait time.Duration, quiet bool, interval time.Duration) {
	now := b.cfg.Now()
	b.interval = interval
	if wait <= 0 {
		wait = interval
	}
	wasOpen := b.open.Load()
	if !wasOpen {
		b.since = now
		b.openedRun = now
		if b.failing.Load() > 0 {
			b.openedRun = b.runStart
		}
		b.open.Store(true)
	}
	b.reason = reason
	b.probeAt = now.Add(wait)
	b.gen++
	b.probe = 0
	b.resetRunLocked()
	since := b.since
	b.notifyLocked()
	b.mu.Unlock()

	b.m.trips.Inc()
	if wasOpen {
		level := slog.LevelWarn
		if quiet {
			level = slog.LevelDebug
		}
		b.log.Log(context.Background(), level, "dependency still unavailable; staying stopped", "since", since, "next_probe_in", wait, "reason", reason)
		return
	}
	b.m.open.Set(1)
	b.m.openSince.Set(float64(since.UnixNano()) / 1e9)
	b.log.Error("dependency unavailable: stopped calling it and taking work that needs it, until a probe succeeds",
		"next_probe_in", wait, "reason", reason)
}

// Failure reports a transient failure of the dependency (a connection refused, a 503,
// a timeout, after the caller's own retries) and returns whether the breaker is open
// after it. The Threshold-th failure in a row opens it, the reason naming the count and
// err, with the first probe after err's Retry-After when it carries one (a 429's, a
// 503's), else after ProbeInterval. While it is open, a failure changes nothing (a call
// that went before the trip says nothing new) and Failure returns true. Callers report
// the failure that opened the breaker, and any failure while it is open, as the
// dependency's unavailability (retry.Unavailable), not as the job's.
func (b *Breaker) Failure(err error) (open bool) {
	open, _ = b.FailureInRun(err)
	return open
}

// FailureInRun is Failure that also reports whether a run of failures was under way
// before err (Failing above 0), read under the same lock as err is counted: of
// concurrent failures right after a success, exactly one starts the run (inRun false).
// While the breaker is open, inRun is true.
func (b *Breaker) FailureInRun(err error) (open, inRun bool) {
	return b.failure(err, time.Time{})
}

// FailureStarted is FailureInRun for a call that started at started. A call begun
// during a run of failures that ended (one of the last 256: after its first failure,
// before a call worked again or the breaker closed; it went during an outage, and its
// failure came back after the outage) belongs to that run: it reports inRun true and is
// not counted in the next run, as SucceedStarted does not count a success of a call
// begun before a run. A call begun while no run was under way is judged as
// FailureInRun judges it.
func (b *Breaker) FailureStarted(err error, started time.Time) (open, inRun bool) {
	return b.failure(err, started)
}

// failure is FailureInRun, and FailureStarted when started is not zero.
func (b *Breaker) failure(err error, started time.Time) (open, inRun bool) {
	if b.open.Load() {
		return true, true
	}
	b.mu.Lock()
	if b.open.Load() {
		b.mu.Unlock()
		return true, true
	}
	if !started.IsZero() && b.startedInEndedRunLocked(started) {
		b.mu.Unlock()
		return false, true
	}
	n := b.failing.Add(1)
	inRun = n > 1
	if n == 1 {
		b.runStart = b.cfg.Now()
	}
	if n < int64(b.cfg.Threshold) {
		b.mu.Unlock()
		return false, inRun
	}
	b.trip(fmt.Sprintf("%d failures in a row, the last: %v", n, err), retry.Classify(err).RetryAfter, false, b.cfg.RunProbeInterval)
	return true, inRun
}

// Failing returns the length of the current run of failures: how many transient
// failures were reported since the last success (0 after one, or while none failed).
func (b *Breaker) Failing() int64 { return b.failing.Load() }

// Success reports a call to the dependency that worked, made without a ticket (a
// commit, a ping): it ends the current run of failures. An open breaker closes only
// once its probe is due, as a probe that worked would close it; before that, a call
// that went before the trip may be what succeeded.
func (b *Breaker) Success() {
	if !b.open.Load() {
		if b.failing.Load() != 0 {
			b.mu.Lock()
			b.endRunLocked()
			b.mu.Unlock()
		}
		return
	}
	b.mu.Lock()
	if !b.open.Load() || b.cfg.Now().Before(b.probeAt) {
		b.mu.Unlock()
		return
	}
	b.close()
}

// resetRunLocked ends the run of failures; b.mu is held.
func (b *Breaker) resetRunLocked() { b.failing.Store(0) }

// endRunLocked ends the run of failures because a call worked, and, when one was under
// way, notes it as the last run that ended (FailureStarted); b.mu is held.
func (b *Breaker) endRunLocked() {
	if b.failing.Load() != 0 {
		b.runEndedLocked(b.runStart, b.cfg.Now())
	}
	b.resetRunLocked()
}

// span is a run of failures that ended: [start, end).
type span struct{ start, end time.Time }

// maxEndedRuns is how many ended runs FailureStarted remembers: at the end of an
// outage, with many jobs, calls that work and calls that fail interleave, each success
// ending a short run, and a slow call sent during the outage may come back after many.
const maxEndedRuns = 256

// runEndedLocked notes the run of failures [start, end) as ended; b.mu is held.
func (b *Breaker) runEndedLocked(start, end time.Time) {
	if len(b.endedRuns) == maxEndedRuns {
		b.endedRuns = append(b.endedRuns[:0], b.endedRuns[1:]...)
	}
	b.endedRuns = append(b.endedRuns, span{start, end})
}

// startedInEndedRunLocked reports whether started is within a run of failures that
// ended; b.mu is held.
func (b *Breaker) startedInEndedRunLocked(started time.Time) bool {
	// The last run that began at or before started is the only one it can be in.
	i := sort.Search(len(b.endedRuns), func(i int) bool { return started.Before(b.endedRuns[i].start) })
	return i > 0 && started.Before(b.endedRuns[i-1].end)
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
		b.probeAt = now.Add(b.interval)
		b.gen++
		b.probe = b.gen
		b.m.probes.Inc()
		b.log.Info("probing whether the dependency is back", "since", b.since)
		return Ticket(b.gen), nil
	}
	return 0, &OpenError{Name: b.cfg.Name, Reason: b.reason, Since: b.since, NextProbe: b.probeAt}
}

// Succeed reports that the call of ticket t worked. On a closed breaker it ends the
// run of failures, as Success does. An open breaker closes only when t is the probe
// let through since its last trip: a call allowed before the trip (a long generation
// the provider accepted earlier) says nothing about the dependency now.
func (b *Breaker) Succeed(t Ticket) {
	if !b.open.Load() {
		if b.failing.Load() != 0 {
			b.mu.Lock()
			b.endRunLocked()
			b.mu.Unlock()
		}
		return
	}
	b.mu.Lock()
	if !b.open.Load() || t == 0 || uint64(t) != b.probe {
		b.mu.Unlock()
		return
	}
	b.close()
}

// Release reports that the call of ticket t did not reach the dependency after all (its
// answer was replayed from a record): it says nothing of the dependency, so nothing
// changes but that, when t is the probe let through since the last trip, the probe is
// due again at once, for the next call to make.
func (b *Breaker) Release(t Ticket) {
	if t == 0 || !b.open.Load() {
		return
	}
	b.mu.Lock()
	if !b.open.Load() || uint64(t) != b.probe {
		b.mu.Unlock()
		return
	}
	b.probe = 0
	b.probeAt = b.cfg.Now()
	b.notifyLocked()
	b.mu.Unlock()
}

// SucceedStarted is Succeed for a call that started at started. While the breaker is
// closed, its success ends the current run of failures only when it started after the
// run's first failure: a long call begun before the dependency went down (a 5 s model
// call that was already streaming) says nothing about it now, and must not hold off the
// trip while every new call fails.
func (b *Breaker) SucceedStarted(t Ticket, started time.Time) {
	if !b.open.Load() {
		if b.failing.Load() != 0 {
			b.mu.Lock()
			if !started.Before(b.runStart) {
				b.endRunLocked()
			}
			b.mu.Unlock()
		}
		return
	}
	b.Succeed(t)
}

// close closes the open breaker and unlocks b.mu, which the caller holds.
func (b *Breaker) close() {
	b.open.Store(false)
	since := b.since
	b.since, b.reason, b.probeAt = time.Time{}, "", time.Time{}
	b.resetRunLocked()
	b.runEndedLocked(b.openedRun, b.cfg.Now())
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
// shares the breaker; another after a few seconds if that job made no call). A watched
// breaker (see Watch) admits no probe job: its check is the probe, and Admit blocks
// until the breaker closes. It returns ctx's error when ctx ends first. It implements
// queue.Gate.
func (b *Breaker) Admit(ctx context.Context) (int, error) {
	if !b.open.Load() {
		return 0, nil
	}
	return Set{b}.Admit(ctx)
}

// probeAdmitGrace is how long Admit waits for the job it let through to make the probe
// before it lets another through.
const probeAdmitGrace = 5 * time.Second

// admission says whether Admit may let work through b now; b.mu is held. When it may,
// limit is 0 (closed) or 1 (a probe job), and claim records the probe job's admission.
// When it may not, wait is when to look again (0: only when b changes).
func (b *Breaker) admission(now time.Time, claim bool) (limit int, ok bool, wait time.Duration) {
	if !b.open.Load() {
		return 0, true, 0
	}
	if b.watchers.Load() > 0 {
		return 0, false, 0 // the check probes; wait for it to close the breaker
	}
	wait = b.probeAt.Sub(now)
	if wait > 0 {
		return 0, false, wait
	}
	// One job per due probe; another only if that one has not made its call (Allow)
	// within probeAdmitGrace, as when it needed no call at all.
	if b.admitted.Before(b.probeAt) || now.Sub(b.admitted) >= probeAdmitGrace {
		if claim {
			b.admitted = now
		}
		return 1, true, 0
	}
	return 0, false, b.admitted.Add(probeAdmitGrace).Sub(now)
}

// Set is the breakers of the dependencies some work needs (Redis, PostgreSQL, the
// model), combined into one queue.Gate: Admit blocks while any of them is open and
// not due a probe, and admits the smallest limit of them (1 while one is probed).
// Nil entries are ignored. A Set is safe for concurrent use; do not change its
// elements while it is in use.
type Set []*Breaker

// Admit blocks until every breaker of s would admit work (see Breaker.Admit) and
// returns the smallest limit among them, 0 meaning none; it returns ctx's error when
// ctx ends first. While every breaker is closed it costs one atomic load per breaker:
// no lock, no allocation. It implements queue.Gate.
func (s Set) Admit(ctx context.Context) (int, error) {
	for {
		closed := true
		for _, b := range s {
			if b != nil && b.open.Load() {
				closed = false
				break
			}
		}
		if closed {
			return 0, nil
		}
		limit, changed, wait := s.admit()
		if changed == nil {
			return limit, nil
		}
		if err := waitChange(ctx, changed, wait); err != nil {
			return 0, err
		}
	}
}

// admit checks every open breaker of s and, when all would admit work, claims their
// probes and returns the smallest limit; otherwise it returns the change channel of the
// first that would not, read with its state, and how long to wait for it (0: until it
// changes).
func (s Set) admit() (limit int, changed <-chan struct{}, wait time.Duration) {
	for _, claim := range []bool{false, true} {
		limit = 0
		for _, b := range s {
			if b == nil || !b.open.Load() {
				continue
			}
			b.mu.Lock()
			n, ok, w := b.admission(b.cfg.Now(), claim)
			ch := b.changed
			b.mu.Unlock()
			if !ok {
				return 0, ch, w
			}
			if n > 0 && (limit == 0 || n < limit) {
				limit = n
			}
		}
	}
	return limit, nil, 0
}

// waitChange waits until changed is closed (its breaker changed state), wait passes
// (when positive) or ctx ends (then it returns ctx's error).
func waitChange(ctx context.Context, changed <-chan struct{}, wait time.Duration) error {
	var timeout <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-changed:
	case <-timeout:
	}
	return nil
}

// Watch probes the dependency's health until ctx ends, then returns nil: it calls
// check at once and then every interval, each call under a timeout of the interval (at
// least MinCheckTimeout). A failing check counts as a Failure, so Threshold of them in
// a row open the breaker; a passing check ends the run. While the breaker is open, the
// checks are its probes: one runs when the probe is due (at most an interval apart), a
// passing one closes the breaker and a failing one keeps it open for another
// ProbeInterval; Admit lets no job through meanwhile. It returns an error at once when
// interval is not positive or check is nil. Several Watch loops may run at once.
func (b *Breaker) Watch(ctx context.Context, interval time.Duration, check func(ctx context.Context) error) error {
	if interval <= 0 || check == nil {
		return fmt.Errorf("breaker %s: Watch needs a positive interval (%v) and a check", b.cfg.Name, interval)
	}
	b.watchers.Add(1)
	b.wake() // an Admit waiting for a probe job's turn now waits for the check
	defer func() {
		b.watchers.Add(-1)
		b.wake() // unwatched again: probe jobs may go
	}()
	timeout := max(interval, MinCheckTimeout)
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		err := check(cctx)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		b.checked(err)
		next := interval
		b.mu.Lock()
		if b.open.Load() {
			next = min(next, max(b.probeAt.Sub(b.cfg.Now()), 0))
		}
		b.mu.Unlock()
		t.Reset(next)
	}
}

// Watched reports whether a Watch loop of b is running: while it does, its checks are
// b's probes, and work that needs the dependency need not run to probe it. Like Err,
// it is an atomic load.
func (b *Breaker) Watched() bool { return b.watchers.Load() > 0 }

// checked records the outcome of one of Watch's checks.
func (b *Breaker) checked(err error) {
	b.mu.Lock()
	open := b.open.Load()
	switch {
	case !open && err == nil:
		b.endRunLocked()
		b.mu.Unlock()
	case !open:
		b.mu.Unlock()
		b.Failure(fmt.Errorf("health check: %w", err))
	case err == nil:
		b.m.probes.Inc()
		b.close()
	default:
		b.m.probes.Inc()
		b.trip(fmt.Sprintf("health check: %v", err), 0, true, b.interval)
	}
}

// wake wakes every Admit waiting on the current state.
func (b *Breaker) wake() {
	b.mu.Lock()
	b.notifyLocked()
	b.mu.Unlock()
}

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
