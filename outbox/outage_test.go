package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/outbox"
)

// A send that fails because a dependency is down (Unavailable) counts no attempt and
// never exhausts the row, however many times it fails and whatever the row's attempts
// were: a row at MaxAttempts already waits too. Once the outage is over, the rows have
// the attempts they had before it: an ordinary failure then counts as it always did
// (the row at MaxAttempts is exhausted by it, the other retried), and the next send
// succeeds.
func TestUnavailableSendNeverExhaustsTheRow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2, webhooksink.Options{})
	const maxAttempts = 2
	e.exec(t, `UPDATE outbox SET attempts = $1 WHERE dedupe_key = 'summary_ready:2'`, maxAttempts)
	var mode atomic.Value // "down", "fail" or "up"
	mode.Store("down")
	var sends atomic.Int64
	sender := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		sends.Add(1)
		switch mode.Load() {
		case "down":
			return outbox.Unavailable(errors.New("dial tcp 127.0.0.1:1: connect: connection refused"))
		case "fail":
			return errors.New("provider answered 503")
		}
		return e.sender.Send(ctx, m)
	})
	reg := prometheus.NewRegistry()
	r := e.relayWith(t, e.store, sender, outbox.Config{MaxAttempts: maxAttempts,
		BackoffBase: time.Millisecond, BackoffCap: 2 * time.Millisecond, Registerer: reg})
	ctx := ctxT(t)
	// pass runs passes until one claims both rows (each is due within BackoffCap).
	pass := func() outbox.PassResult {
		t.Helper()
		var total outbox.PassResult
		for deadline := time.Now().Add(30 * time.Second); total.Claimed < 2; {
			if time.Now().After(deadline) {
				t.Fatalf("rows not due again: %+v", total)
			}
			time.Sleep(3 * time.Millisecond)
			res, err := r.Pass(ctx)
			if err != nil {
				t.Fatal(err)
			}
			total.Claimed += res.Claimed
			total.Sent += res.Sent
			total.Retrying += res.Retrying
			total.Exhausted += res.Exhausted
		}
		return total
	}

	const outagePasses = 3 * maxAttempts
	for i := range outagePasses {
		if res := pass(); res.Retrying != 2 || res.Exhausted != 0 {
			t.Fatalf("outage pass %d: %+v, want both rows retrying, none exhausted", i+1, res)
		}
	}
	if n := e.count(t, `exhausted_at IS NULL AND sent_at IS NULL AND last_error LIKE '%connection refused%'
		AND ((dedupe_key = 'summary_ready:1' AND attempts = 0) OR (dedupe_key = 'summary_ready:2' AND attempts = $1))`, maxAttempts); n != 2 {
		t.Fatal("after the outage: want both rows waiting, attempts as before it, the outage's error recorded")
	}
	if got := labeled(t, reg, "onceflow_outbox_send_failures_total", "class", "unavailable"); got != 2*outagePasses {
		t.Errorf("send_failures_total{class=unavailable} = %v, want %d", got, 2*outagePasses)
	}
	if got := metric(t, reg, "onceflow_outbox_exhausted_total"); got != 0 {
		t.Errorf("exhausted_total %v during the outage", got)
	}

	mode.Store("fail")
	if res := pass(); res.Retrying != 1 || res.Exhausted != 1 {
		t.Fatalf("ordinary failure after the outage: %+v, want the row at MaxAttempts exhausted, the other retrying", res)
	}
	mode.Store("up")
	deadline := time.Now().Add(30 * time.Second)
	for e.count(t, `sent_at IS NOT NULL`) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("row not sent after the outage")
		}
		time.Sleep(3 * time.Millisecond)
		if _, err := r.Pass(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.count(t, `dedupe_key = 'summary_ready:1' AND sent_at IS NOT NULL AND attempts = 1`); n != 1 {
		t.Fatal("the retried row: want sent with the one ordinary failure counted")
	}
	if st := e.sink.Stats(); st.Deliveries != 1 || e.sink.Count("summary_ready:1") != 1 || e.sink.Count("summary_ready:2") != 0 {
		t.Fatalf("sink %+v: want one delivery, of the row that was not exhausted", st)
	}
	if want := int64(2*outagePasses + 2 + 1); sends.Load() != want {
		t.Errorf("%d sends, want %d", sends.Load(), want)
	}
}

// labeled returns the value of the series of counter name whose label is value.
func labeled(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
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
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("metric %s{%s=%q} not registered", name, label, value)
	return 0
}
