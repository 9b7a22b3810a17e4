package llmmetrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/llmmetrics"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

func TestCallsAndRetriesAreCounted(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m := llmmetrics.New(reg)
	f := fake.New()
	f.FailNext(&retry.StatusError{Status: 503}, &retry.StatusError{Status: 429, After: 2 * time.Second, HasAfter: true})
	c := m.Instrument("fake", f)
	req := &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "hello"}}}
	clock := retrytest.NewClock(time.Unix(0, 0))
	_, err := retry.Do(context.Background(), retry.Policy{Clock: clock, OnRetry: m.OnRetry}, retry.AfterOn(clock, time.Minute),
		func(ctx context.Context) (*llm.Response, error) { return c.Complete(ctx, req) })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := llm.Collect(c.Stream(context.Background(), req)); err != nil {
		t.Fatal(err)
	}
	f.FailNext(errors.New("boom"))
	_, _ = llm.Collect(c.Stream(context.Background(), req))

	for labels, n := range map[[2]string]float64{{"fake", "ok"}: 2, {"fake", "server_error"}: 1, {"fake", "rate_limited"}: 1, {"fake", "unknown"}: 1, {"fake", "quota"}: 0} {
		if got := value(t, reg, "onceflow_llm_calls_total", map[string]string{"provider": labels[0], "outcome": labels[1]}); got != n {
			t.Errorf("calls{%v} = %v, want %v", labels, got, n)
		}
	}
	for labels, n := range map[[2]string]float64{{"server_error", "backoff"}: 1, {"rate_limited", "retry_after"}: 1, {"timeout", "backoff"}: 0} {
		if got := value(t, reg, "onceflow_llm_retries_total", map[string]string{"class": labels[0], "source": labels[1]}); got != n {
			t.Errorf("retries{%v} = %v, want %v", labels, got, n)
		}
	}
	if n, err := testutil.GatherAndCount(reg, "onceflow_llm_call_duration_seconds", "onceflow_llm_retry_delay_seconds"); err != nil || n != 2 {
		t.Fatalf("histograms: %d %v", n, err)
	}
	// Registering a second instance on the same registry reuses the collectors.
	llmmetrics.New(reg)
}

// value returns the counter series of name with labels in reg.
func value(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := true
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					match = false
				}
			}
			if match {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

func TestAmbiguousFailures(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"timeout", context.DeadlineExceeded, true},
		{"reset", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, true},
		{"stream cut", fmt.Errorf("stream: %w", io.ErrUnexpectedEOF), true},
		{"refused", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, false},
		{"dns", &net.DNSError{Err: "no such host", Name: "x.invalid"}, false},
		{"429", &retry.StatusError{Status: 429}, false},
		{"408 is an answer", &retry.StatusError{Status: 408}, false},
		{"400", &retry.StatusError{Status: 400}, false},
		{"canceled", context.Canceled, false},
		{"nil", nil, false},
		{"h2 reset", errors.New("stream error: stream ID 1; INTERNAL_ERROR; received from peer"), true},
		{"h2 refused stream", errors.New("stream error: stream ID 1; REFUSED_STREAM; received from peer"), false},
		{"h2 goaway below the stream", errors.New("http2: Transport received GOAWAY from server ErrCode:NO_ERROR"), false},
	}
	for _, tc := range cases {
		if got := llmmetrics.Ambiguous(tc.err); got != tc.want {
			t.Errorf("%s: Ambiguous(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}

	reg := prometheus.NewRegistry()
	m := llmmetrics.New(reg)
	f := fake.New()
	c := m.Instrument("fake", f)
	if got := value(t, reg, "onceflow_llm_ambiguous_failures_total", map[string]string{"provider": "fake"}); got != 0 {
		t.Fatalf("ambiguous before any call = %v", got)
	}
	f.FailNext(fmt.Errorf("read: %w", io.ErrUnexpectedEOF), &retry.StatusError{Status: 503})
	req := &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "hello"}}}
	_, _ = c.Complete(context.Background(), req)
	_, _ = c.Complete(context.Background(), req)
	if got := value(t, reg, "onceflow_llm_ambiguous_failures_total", map[string]string{"provider": "fake"}); got != 1 {
		t.Errorf("ambiguous = %v after one cut answer and one 503, want 1", got)
	}
	m.OnRetry(retry.Retry{Class: retry.ClassRateLimited, Delay: 2 * time.Second, FromRetryAfter: true})
	m.OnRetry(retry.Retry{Class: retry.ClassServerError, Delay: 500 * time.Millisecond})
	if got := value(t, reg, "onceflow_llm_retry_wait_seconds_total", map[string]string{"source": "retry_after"}); got != 2 {
		t.Errorf("retry_after wait = %v, want 2", got)
	}
	if got := value(t, reg, "onceflow_llm_retry_wait_seconds_total", map[string]string{"source": "backoff"}); got != 0.5 {
		t.Errorf("backoff wait = %v, want 0.5", got)
	}
}
