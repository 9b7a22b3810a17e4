package breaker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/retry"
)

// clock is a manual clock for Config.Now.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func newBreaker(t *testing.T, probe time.Duration, reg prometheus.Registerer) (*breaker.Breaker, *clock) {
	t.Helper()
	c := &clock{now: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)}
	b, err := breaker.New(breaker.Config{Name: "llm", ProbeInterval: probe, Now: c.Now, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	return b, c
}

func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := breaker.New(breaker.Config{}); err == nil {
		t.Fatal("no name accepted")
	}
	if _, err := breaker.New(breaker.Config{Name: "x", ProbeInterval: -time.Second}); err == nil {
		t.Fatal("negative probe interval accepted")
	}
}

// Closed, tripped, refused until the probe is due, one probe let through, still open
// after a failed probe, closed by a success.
func TestTripProbeSucceed(t *testing.T) {
	reg := prometheus.NewRegistry()
	b, c := newBreaker(t, time.Minute, reg)
	if _, err := b.Allow(); err != nil {
		t.Fatalf("closed breaker refused: %v", err)
	}
	if b.Err() != nil {
		t.Fatal("closed breaker reports an error")
	}
	start := c.Now()
	b.Trip(errors.New("HTTP 429, quota exhausted (insufficient_quota)"), 0)

	_, err := b.Allow()
	var oe *breaker.OpenError
	if !errors.As(err, &oe) || !errors.Is(err, retry.ErrUnavailable) {
		t.Fatalf("open breaker: Allow = %v, want an *OpenError matching retry.ErrUnavailable", err)
	}
	if oe.Name != "llm" || !oe.Since.Equal(start) || !oe.NextProbe.Equal(start.Add(time.Minute)) || !strings.Contains(oe.Reason, "insufficient_quota") {
		t.Fatalf("OpenError %+v", oe)
	}
	if v := retry.Classify(err); v.Retryable || v.Class != retry.ClassUnavailable || !retry.Transient(err) || !retry.Outage(err) {
		t.Fatalf("Classify(open) = %+v, want unavailable, not retryable, transient", v)
	}
	if got := value(t, reg, "onceflow_breaker_open"); got != 1 {
		t.Fatalf("open gauge %v", got)
	}
	if got := value(t, reg, "onceflow_breaker_open_since_timestamp_seconds"); got != float64(start.Unix()) {
		t.Fatalf("open since %v, want %d", got, start.Unix())
	}

	c.Advance(59 * time.Second)
	if _, err := b.Allow(); err == nil {
		t.Fatal("let a call through before the probe was due")
	}
	c.Advance(time.Second)
	first, err := b.Allow()
	if err != nil {
		t.Fatalf("due probe refused: %v", err)
	}
	if _, err := b.Allow(); err == nil {
		t.Fatal("a second call let through while the probe is out")
	}
	// The probe met the quota again: open for another interval, since unchanged.
	b.Trip(errors.New("still over quota"), 0)
	if err := b.Err(); !errors.As(err, &oe) || !oe.Since.Equal(start) || oe.Reason != "still over quota" {
		t.Fatalf("after a failed probe: %v", err)
	}
	b.Succeed(first) // the first probe's success, late, after it tripped again: stays open
	if b.Err() == nil {
		t.Fatal("the success of a probe from before the last trip closed the breaker")
	}
	c.Advance(time.Minute)
	probe, err := b.Allow()
	if err != nil {
		t.Fatalf("second probe refused: %v", err)
	}
	b.Succeed(0) // a call allowed while the breaker was closed
	if b.Err() == nil {
		t.Fatal("a call allowed before the trip closed the breaker")
	}
	b.Succeed(probe)
	if _, err := b.Allow(); err != nil || b.Err() != nil {
		t.Fatalf("after a successful probe: Allow %v, Err %v", err, b.Err())
	}
	if got := value(t, reg, "onceflow_breaker_open"); got != 0 {
		t.Fatalf("open gauge %v after closing", got)
	}
	if got := value(t, reg, "onceflow_breaker_trips_total"); got != 2 {
		t.Fatalf("trips %v, want 2", got)
	}
	if got := value(t, reg, "onceflow_breaker_probes_total"); got != 2 {
		t.Fatalf("probes %v, want 2", got)
	}
}

// A trip with a wait (the provider's Retry-After) schedules the probe after it.
func TestTripWithWait(t *testing.T) {
	b, c := newBreaker(t, time.Minute, nil)
	b.Trip(errors.New("quota"), 5*time.Second)
	c.Advance(4 * time.Second)
	if _, err := b.Allow(); err == nil {
		t.Fatal("probe before the wait")
	}
	c.Advance(time.Second)
	if _, err := b.Allow(); err != nil {
		t.Fatalf("probe after the wait refused: %v", err)
	}
}

// Admit returns at once (no limit) while closed, blocks while open, admits one job
// when a probe is due and wakes when the breaker closes.
func TestAdmitWaitsWhileOpenAndAdmitsOneJobPerDueProbe(t *testing.T) {
	b, clk := newBreaker(t, 200*time.Millisecond, nil)
	ctx := context.Background()
	if n, err := b.Admit(ctx); n != 0 || err != nil {
		t.Fatalf("closed: Admit = %d, %v", n, err)
	}
	b.Trip(errors.New("quota"), time.Hour)
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if n, err := b.Admit(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("open: Admit = %d, %v, want to block until ctx ends", n, err)
	}

	done := make(chan int, 1)
	go func() {
		n, _ := b.Admit(ctx)
		done <- n
	}()
	select {
	case n := <-done:
		t.Fatalf("Admit returned %d while open", n)
	case <-time.After(50 * time.Millisecond):
	}
	clk.Advance(time.Hour) // the probe is due (the waiting Admit's timer is real time)
	probe, err := b.Allow()
	if err != nil {
		t.Fatal(err)
	}
	b.Succeed(probe)
	select {
	case n := <-done:
		if n != 0 {
			t.Fatalf("Admit after closing = %d, want 0 (no limit)", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Admit did not wake when the breaker closed")
	}

	// A due probe admits exactly one job; the next Admit waits for that job's call.
	b.Trip(errors.New("quota"), 10*time.Millisecond)
	clk.Advance(10 * time.Millisecond)
	if n, err := b.Admit(ctx); n != 1 || err != nil {
		t.Fatalf("due probe: Admit = %d, %v, want 1", n, err)
	}
	short2, cancel2 := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel2()
	if n, err := b.Admit(short2); err == nil {
		t.Fatalf("second Admit for one probe = %d", n)
	}
}

// value returns the value of the one series of the gauge or counter name.
func value(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			return m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	t.Fatalf("metric %s not exported", name)
	return 0
}

// Threshold failures in a row open the breaker, the reason naming the last; a success
// in between starts the count again; once open, a failure changes nothing.
func TestFailureRunTrips(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := &clock{now: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)}
	b, err := breaker.New(breaker.Config{Name: "postgres", Threshold: 3, ProbeInterval: time.Second, Now: c.Now, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	fail := func(i int) bool { return b.Failure(fmt.Errorf("connection refused (%d)", i)) }
	if fail(1) || fail(2) {
		t.Fatal("opened before Threshold failures")
	}
	b.Success() // the run ends
	if fail(3) || fail(4) {
		t.Fatal("a success did not end the run of failures")
	}
	b.Succeed(0) // a call through Allow while closed ends it too
	if fail(5) || fail(6) {
		t.Fatal("Succeed did not end the run of failures")
	}
	if !fail(7) {
		t.Fatal("the third failure in a row did not open the breaker")
	}
	var oe *breaker.OpenError
	if err := b.Err(); !errors.As(err, &oe) || !strings.Contains(oe.Reason, "3 failures in a row") || !strings.Contains(oe.Reason, "connection refused (7)") {
		t.Fatalf("Err = %v, want the run and the last failure", err)
	}
	since := oe.Since
	if !fail(8) {
		t.Fatal("a failure while open reported closed")
	}
	if err := b.Err(); !errors.As(err, &oe) || !oe.Since.Equal(since) || !strings.Contains(oe.Reason, "(7)") {
		t.Fatalf("a failure while open changed the breaker: %v", err)
	}
	if got := value(t, reg, "onceflow_breaker_trips_total"); got != 1 {
		t.Fatalf("trips %v, want 1", got)
	}
	b.Success() // before the probe is due: a call from before the trip
	if b.Err() == nil {
		t.Fatal("a success before the probe was due closed the breaker")
	}
	c.Advance(time.Second)
	b.Success() // after it: the dependency works
	if b.Err() != nil {
		t.Fatal("a success once the probe was due did not close the breaker")
	}
	if fail(9) || fail(10) {
		t.Fatal("the run did not start again after closing")
	}
}

// Watch: Threshold failing checks open the breaker, Admit lets no job through while
// it is watched (the check probes), and the first passing check closes it.
func TestWatchOpensOnFailingChecksAndClosesOnTheFirstPassingOne(t *testing.T) {
	reg := prometheus.NewRegistry()
	b, err := breaker.New(breaker.Config{Name: "redis", Threshold: 2, ProbeInterval: 20 * time.Millisecond, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var down atomic.Bool
	var checks atomic.Int64
	done := make(chan error, 1)
	go func() {
		done <- b.Watch(ctx, 10*time.Millisecond, func(ctx context.Context) error {
			checks.Add(1)
			if down.Load() {
				return errors.New("dial tcp: connection refused")
			}
			return nil
		})
	}()
	waitFor(t, "checks", func() bool { return checks.Load() >= 3 })
	if b.Err() != nil {
		t.Fatal("passing checks opened the breaker")
	}
	down.Store(true)
	waitFor(t, "the breaker to open", func() bool { return b.Err() != nil })
	var oe *breaker.OpenError
	if err := b.Err(); !errors.As(err, &oe) || !strings.Contains(oe.Reason, "health check: dial tcp: connection refused") {
		t.Fatalf("Err = %v", err)
	}
	// Watched and open: no probe job, however long it stays open.
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancelShort()
	if n, err := b.Admit(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("watched, open: Admit = %d, %v, want to block", n, err)
	}
	if got := value(t, reg, "onceflow_breaker_probes_total"); got < 2 {
		t.Fatalf("%v probes while open, want one per check", got)
	}
	admitted := make(chan int, 1)
	go func() {
		n, _ := b.Admit(ctx)
		admitted <- n
	}()
	down.Store(false)
	waitFor(t, "the breaker to close", func() bool { return b.Err() == nil })
	select {
	case n := <-admitted:
		if n != 0 {
			t.Fatalf("Admit after the check closed it = %d, want 0", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Admit did not wake when the check closed the breaker")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Watch = %v", err)
	}
	if err := b.Watch(context.Background(), 0, func(context.Context) error { return nil }); err == nil {
		t.Fatal("Watch with no interval started")
	}
}

// Set admits nothing while any breaker is open and not due a probe, and the smallest
// limit once all would admit.
func TestSetAdmitsOnlyWhenEveryBreakerWould(t *testing.T) {
	a, clk := newBreaker(t, time.Minute, nil)
	b, err := breaker.New(breaker.Config{Name: "postgres", ProbeInterval: time.Minute, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	s := breaker.Set{a, nil, b}
	ctx := context.Background()
	if n, err := s.Admit(ctx); n != 0 || err != nil {
		t.Fatalf("all closed: Admit = %d, %v", n, err)
	}
	b.Trip(errors.New("down"), time.Hour)
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if n, err := s.Admit(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("one open: Admit = %d, %v, want to block", n, err)
	}
	a.Trip(errors.New("quota"), time.Minute)
	clk.Advance(time.Minute) // a's probe is due, b's is not
	short2, cancel2 := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel2()
	if n, err := s.Admit(short2); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a due, b not: Admit = %d, %v, want to block", n, err)
	}
	clk.Advance(time.Hour) // both due: one job probes
	if n, err := s.Admit(ctx); n != 1 || err != nil {
		t.Fatalf("both due: Admit = %d, %v, want 1", n, err)
	}
	pa, _ := a.Allow()
	a.Succeed(pa)
	pb, _ := b.Allow()
	b.Succeed(pb)
	if n, err := s.Admit(ctx); n != 0 || err != nil {
		t.Fatalf("closed again: Admit = %d, %v", n, err)
	}
}

// The gate of closed breakers is on every read of a worker: a few atomic loads, no
// lock, no allocation.
func BenchmarkGateAllClosed(b *testing.B) {
	var s breaker.Set
	for _, name := range []string{"redis", "postgres", "llm"} {
		br, err := breaker.New(breaker.Config{Name: name})
		if err != nil {
			b.Fatal(err)
		}
		s = append(s, br)
	}
	var gate interface {
		Admit(context.Context) (int, error)
	} = s
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if n, err := gate.Admit(ctx); n != 0 || err != nil {
			b.Fatal(n, err)
		}
	}
}

func TestGateAllClosedAllocatesNothing(t *testing.T) {
	br, err := breaker.New(breaker.Config{Name: "redis"})
	if err != nil {
		t.Fatal(err)
	}
	s := breaker.Set{br, br}
	ctx := context.Background()
	if n := testing.AllocsPerRun(100, func() { _, _ = s.Admit(ctx) }); n != 0 {
		t.Fatalf("Admit of closed breakers allocates %v times", n)
	}
}

// waitFor polls cond for up to 10s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The failure that opens the breaker sets the first probe after its Retry-After.
func TestFailureRunHonoursRetryAfter(t *testing.T) {
	b, c := newBreaker(t, time.Minute, nil)
	for range breaker.DefaultThreshold {
		b.Failure(retry.RetryAfter(10*time.Second, errors.New("HTTP 503")))
	}
	var oe *breaker.OpenError
	if err := b.Err(); !errors.As(err, &oe) || !oe.NextProbe.Equal(c.Now().Add(10*time.Second)) {
		t.Fatalf("Err = %v, want the next probe 10s after the trip", err)
	}
}

// A call that started before a run of failures began and succeeds during it (a long
// model call begun before the provider went down) does not end the run; one that started
// after the run's first failure does.
func TestSuccessOfAnOlderCallDoesNotEndTheRun(t *testing.T) {
	c := &clock{now: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)}
	b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 3, ProbeInterval: time.Second, Now: c.Now})
	if err != nil {
		t.Fatal(err)
	}
	before := c.Now()
	c.Advance(time.Second)
	b.Failure(errors.New("503 (1)"))
	b.Failure(errors.New("503 (2)"))
	b.SucceedStarted(0, before) // began before the first 503
	if !b.Failure(errors.New("503 (3)")) {
		t.Fatal("a success of a call begun before the run ended it")
	}
	c.Advance(2 * time.Second) // the probe is due
	t1, err := b.Allow()
	if err != nil || t1 == 0 {
		t.Fatalf("probe: %v %v", t1, err)
	}
	b.SucceedStarted(t1, c.Now())
	if b.Err() != nil {
		t.Fatal("the probe's success did not close the breaker")
	}
	b.Failure(errors.New("503 (4)"))
	c.Advance(time.Millisecond)
	b.SucceedStarted(0, c.Now()) // began after the run's first failure: ends it
	b.Failure(errors.New("503 (5)"))
	if b.Failure(errors.New("503 (6)")) {
		t.Fatal("a success of a call begun during the run did not end it")
	}
}

// A breaker opened by a run of failures is probed every RunProbeInterval, one opened by
// Trip (an exhausted quota) every ProbeInterval.
func TestRunProbeInterval(t *testing.T) {
	c := &clock{now: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)}
	b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 1, ProbeInterval: time.Minute, RunProbeInterval: 10 * time.Second, Now: c.Now})
	if err != nil {
		t.Fatal(err)
	}
	b.Failure(errors.New("503"))
	var oe *breaker.OpenError
	if !errors.As(b.Err(), &oe) || oe.NextProbe.Sub(c.Now()) != 10*time.Second {
		t.Fatalf("after a run: %v, want the first probe in 10s", b.Err())
	}
	c.Advance(10 * time.Second)
	if _, err := b.Allow(); err != nil {
		t.Fatalf("probe not allowed after 10s: %v", err)
	}
	if !errors.As(b.Err(), &oe) || oe.NextProbe.Sub(c.Now()) != 10*time.Second {
		t.Fatalf("after a probe: %v, want the next in 10s", b.Err())
	}
	b.Trip(errors.New("insufficient_quota"), 0)
	if !errors.As(b.Err(), &oe) || oe.NextProbe.Sub(c.Now()) != time.Minute {
		t.Fatalf("after a quota trip: %v, want the next probe in 1m", b.Err())
	}
}

// A probe ticket handed back (its call's answer was replayed, the dependency never
// reached) makes the probe due again at once, for the next call; the breaker stays open.
// A ticket that is not the probe's changes nothing.
func TestReleasedProbeIsDueAgain(t *testing.T) {
	b, c := newBreaker(t, time.Minute, nil)
	b.Trip(errors.New("quota"), 0)
	c.Advance(time.Minute)
	t1, err := b.Allow()
	if err != nil || t1 == 0 {
		t.Fatalf("probe: %v %v", t1, err)
	}
	if _, err := b.Allow(); err == nil {
		t.Fatal("a second probe while the first is out")
	}
	b.Release(t1 + 1) // not the probe
	if _, err := b.Allow(); err == nil {
		t.Fatal("another ticket's release let a probe through")
	}
	b.Release(t1)
	if b.Err() == nil {
		t.Fatal("a released probe closed the breaker")
	}
	t2, err := b.Allow()
	if err != nil || t2 == 0 {
		t.Fatalf("the probe after a release: %v %v, want one at once", t2, err)
	}
	b.Succeed(t1)
	if b.Err() == nil {
		t.Fatal("the released ticket's success closed the breaker")
	}
	b.Succeed(t2)
	if b.Err() != nil {
		t.Fatal("the new probe's success did not close the breaker")
	}
}

// FailureInRun says whether a run was under way before the failure it counts: of
// concurrent failures after a success, exactly one starts the run.
func TestFailureInRunStartsOneRun(t *testing.T) {
	b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var starts atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, inRun := b.FailureInRun(errors.New("503")); !inRun {
				starts.Add(1)
			}
		}()
	}
	wg.Wait()
	if n := starts.Load(); n != 1 {
		t.Fatalf("%d failures started the run, want 1", n)
	}
	b.Success()
	if _, inRun := b.FailureInRun(errors.New("503")); inRun {
		t.Fatal("the first failure after a success continued a run")
	}
}

// A failure of a call that started during the last run of failures that ended (it went
// during the outage, and came back after other calls worked again) continues that run
// and is not counted in a new one; a call that started before the run began, or after
// it ended, is judged as any failure is.
func TestFailureOfACallStartedDuringTheLastRunContinuesIt(t *testing.T) {
	c := &clock{now: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)}
	b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 3, ProbeInterval: time.Second, Now: c.Now})
	if err != nil {
		t.Fatal(err)
	}
	before := c.Now() // a call sent while the provider worked
	c.Advance(time.Millisecond)
	if _, inRun := b.FailureStarted(errors.New("503 (1)"), c.Now()); inRun {
		t.Fatal("the first failure continued a run")
	}
	c.Advance(time.Millisecond)
	during := c.Now()
	c.Advance(time.Millisecond)
	b.SucceedStarted(0, c.Now()) // the provider is back: the run ends
	c.Advance(time.Millisecond)
	for i := range 5 { // more than the threshold: none of them may count
		open, inRun := b.FailureStarted(errors.New("503 of a call sent during the outage"), during)
		if !inRun || open {
			t.Fatalf("failure %d of a call begun during the run: inRun %v open %v, want the run's, breaker closed", i, inRun, open)
		}
	}
	if n := b.Failing(); n != 0 {
		t.Fatalf("%d failures counted in a new run, want 0", n)
	}
	if _, inRun := b.FailureStarted(errors.New("503 of a call sent before the run"), before); inRun {
		t.Fatal("the failure of a call begun before the run began continued it")
	}
	b.Success()
	if _, inRun := b.FailureStarted(errors.New("503 (2)"), c.Now()); inRun {
		t.Fatal("the failure of a call begun after the run ended continued it")
	}
	// A run that opened the breaker ends when it closes after a probe; a call sent
	// during that run (before the trip, or while open) belongs to it.
	c.Advance(time.Millisecond)
	sentInRun := c.Now()
	b.FailureStarted(errors.New("503 (3)"), c.Now())
	b.FailureStarted(errors.New("503 (4)"), c.Now())
	if b.Err() == nil {
		t.Fatal("three failures in a row did not open the breaker")
	}
	c.Advance(2 * time.Second)
	t1, err := b.Allow()
	if err != nil {
		t.Fatal(err)
	}
	b.Succeed(t1)
	if _, inRun := b.FailureStarted(errors.New("503 of a call sent before the trip"), sentInRun); !inRun {
		t.Fatal("the failure of a call begun during the run that opened the breaker started a run after it closed")
	}
	if _, inRun := b.FailureStarted(errors.New("503 of a call sent after the close"), c.Now()); inRun {
		t.Fatal("the failure of a call begun after the breaker closed continued a run")
	}
}

// A call sent during a run of failures that fails after that run ended belongs to it
// however many runs ended since: at the end of an outage, with many jobs, calls that
// work and calls that fail interleave, and each success ends a short run; a slow 503 of
// a call sent during the outage is still the outage's.
func TestFailureOfACallStartedDuringAnEarlierRunContinuesIt(t *testing.T) {
	c := &clock{now: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)}
	b, err := breaker.New(breaker.Config{Name: "llm", Threshold: 1000, Now: c.Now})
	if err != nil {
		t.Fatal(err)
	}
	b.FailureStarted(errors.New("503: the outage begins"), c.Now())
	c.Advance(time.Millisecond)
	during := c.Now() // a slow call sent during the outage
	for range 3 {     // the provider flaps back: short runs, each ended by a success
		c.Advance(time.Millisecond)
		b.SucceedStarted(0, c.Now())
		c.Advance(time.Millisecond)
		b.FailureStarted(errors.New("503 while it recovers"), c.Now())
	}
	c.Advance(time.Millisecond)
	b.SucceedStarted(0, c.Now())
	c.Advance(time.Millisecond)
	if open, inRun := b.FailureStarted(errors.New("503 of the call sent during the outage"), during); !inRun || open {
		t.Fatalf("the failure of a call sent during the outage, after later runs ended: inRun %v open %v, want the outage's (inRun true)", inRun, open)
	}
	if n := b.Failing(); n != 0 {
		t.Fatalf("%d failures counted in a new run, want 0", n)
	}
}
