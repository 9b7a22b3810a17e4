package breaker_test

import (
	"context"
	"errors"
	"strings"
	"sync"
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
func TestAdmit(t *testing.T) {
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
