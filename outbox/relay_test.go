package outbox_test

import (
	"context"
	"errors"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// env is one test's outbox: a schema of its own, a webhook sink and a webhook sender.
type env struct {
	pool   *pgxpool.Pool
	store  *pgoutbox.Store
	sink   *webhooksink.Sink
	sender *webhook.Sender
}

func newEnv(t *testing.T, rows int, opts webhooksink.Options) *env {
	t.Helper()
	pool, _ := testenv.Postgres(t)
	sink := webhooksink.New(opts)
	srv := httptest.NewServer(sink)
	t.Cleanup(srv.Close)
	sender, err := webhook.New(webhook.Config{URL: srv.URL + "/hook", Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if rows > 0 {
		if _, err := pool.Exec(ctxT(t), `INSERT INTO outbox (topic, dedupe_key, payload)
			SELECT 'email.summary_ready', 'summary_ready:' || g, jsonb_build_object('job_id', g, 'to', 'u' || g || '@example.com')
			FROM generate_series(1, $1::int) g`, rows); err != nil {
			t.Fatal(err)
		}
	}
	return &env{pool: pool, store: pgoutbox.New(pool), sink: sink, sender: sender}
}

func (e *env) relay(t *testing.T, cfg outbox.Config) *outbox.Relay {
	t.Helper()
	return e.relayWith(t, e.store, e.sender, cfg)
}

func (e *env) relayWith(t *testing.T, store outbox.Store, sender outbox.Sender, cfg outbox.Config) *outbox.Relay {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	r, err := outbox.NewRelay(store, sender, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (e *env) count(t *testing.T, where string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(ctxT(t), "SELECT count(*) FROM outbox WHERE "+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (e *env) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := e.pool.Exec(ctxT(t), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// docs/outbox.md: an email provider that is down. The send fails, attempts goes to 1, and the
// next relay pass sends it.
func TestProviderDownThenSentOnTheNextPass(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{})
	e.sink.FailNext(1)
	reg := prometheus.NewRegistry()
	r := e.relay(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond, Registerer: reg})
	ctx := ctxT(t)

	res, err := r.Pass(ctx)
	if err != nil || res.Claimed != 1 || res.Retrying != 1 || res.Sent != 0 {
		t.Fatalf("first pass %+v %v", res, err)
	}
	if n := e.count(t, "attempts = 1 AND sent_at IS NULL AND last_error LIKE '%503%' AND claimed_by IS NULL"); n != 1 {
		t.Fatal("after the provider failed: want attempts 1, last_error, lease cleared")
	}
	time.Sleep(5 * time.Millisecond) // the 1ms backoff
	res, err = r.Pass(ctx)
	if err != nil || res.Sent != 1 {
		t.Fatalf("next pass %+v %v", res, err)
	}
	if n := e.count(t, "attempts = 1 AND sent_at IS NOT NULL"); n != 1 {
		t.Fatal("row not marked sent")
	}
	if st := e.sink.Stats(); st.Deliveries != 1 || st.Failed != 1 || e.sink.Count("summary_ready:1") != 1 {
		t.Fatalf("sink %+v: want one failed and one delivered POST", st)
	}
	if got := (metric(t, reg, "onceflow_outbox_sent_total")); got != 1 {
		t.Errorf("sent_total %v", got)
	}
}

// crashAfterSend is a Store whose Settle never reaches the database: the relay sent and
// then died before recording it (a panic standing in for SIGKILL).
type crashAfterSend struct{ outbox.Store }

func (crashAfterSend) Settle(context.Context, string, outbox.Settlement) (outbox.Settled, error) {
	return outbox.Settled{}, errors.New("relay killed before marking")
}

// docs/outbox.md: the sender delivers and the relay dies before marking. After the lease,
// another relay sends the row again, with the same dedupe key: the duplicate window the
// provider's idempotency key must close.
func TestSendThenDieBeforeMarkSendsAgainWithTheSameKeyAfterTheLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{})
	ctx := ctxT(t)
	// Long enough that the dying relay's pass (a send and three failed settle tries,
	// about 0.6s) ends well inside it on a loaded machine.
	lease := 4 * time.Second
	dying := e.relayWith(t, crashAfterSend{e.store}, e.sender, outbox.Config{Name: "dying", Lease: lease})
	if _, err := dying.Pass(ctx); err == nil {
		t.Fatal("pass with a crashing settle reported no error")
	}
	if e.sink.Count("summary_ready:1") != 1 || e.count(t, "sent_at IS NULL AND claimed_by = 'dying'") != 1 {
		t.Fatal("want one delivery and the row still unsent and claimed by the dead relay")
	}

	survivor := e.relay(t, outbox.Config{Name: "survivor", Lease: lease})
	if res, err := survivor.Pass(ctx); err != nil || res.Claimed != 0 {
		t.Fatalf("survivor claimed %+v %v while the lease ran", res, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := survivor.Pass(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if res.Sent == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("row not sent after the lease ran out")
		}
		time.Sleep(50 * time.Millisecond)
	}
	d := e.sink.Deliveries()
	if len(d) != 2 || d[0].Key != "summary_ready:1" || d[1].Key != d[0].Key {
		t.Fatalf("deliveries %+v: want two with the same Idempotency-Key", d)
	}
	if e.count(t, "sent_at IS NOT NULL AND attempts = 0 AND claimed_by IS NULL") != 1 {
		t.Fatal("row not marked sent by the survivor")
	}
}

func TestTwoRelaysOnAThousandRowsSendEachRowOnce(t *testing.T) {
	t.Parallel()
	const rows = 1000
	e := newEnv(t, rows, webhooksink.Options{})
	ctx, cancel := context.WithCancel(ctxT(t))
	var wg sync.WaitGroup
	var perRelay [2]atomic.Int64
	for i, name := range []string{"relay-a", "relay-b"} {
		counting := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
			perRelay[i].Add(1)
			return e.sender.Send(ctx, m)
		})
		r := e.relayWith(t, e.store, counting, outbox.Config{Name: name, BatchSize: 50, Concurrency: 8, PollInterval: 10 * time.Millisecond})
		wg.Go(func() { _ = r.Run(ctx) })
	}
	deadline := time.Now().Add(60 * time.Second)
	for e.count(t, "sent_at IS NULL") > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	st := e.sink.Stats()
	if st.Deliveries != rows || st.DistinctKeys != rows || len(st.Duplicates) != 0 {
		t.Fatalf("sink %d deliveries, %d keys, duplicates %v; want %d, %d, none", st.Deliveries, st.DistinctKeys, st.Duplicates, rows, rows)
	}
	if n := e.count(t, "sent_at IS NOT NULL AND claimed_by IS NULL"); n != rows {
		t.Fatalf("%d rows marked sent, want %d", n, rows)
	}
	if a, b := perRelay[0].Load(), perRelay[1].Load(); a == 0 || b == 0 || a+b != rows {
		t.Fatalf("relays sent %d and %d rows: want both to take part, %d in all", a, b, rows)
	}
}

func TestFailuresBackOffThenExhaust(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{FailRate: 1})
	reg := prometheus.NewRegistry()
	r := e.relay(t, outbox.Config{MaxAttempts: 3, BackoffBase: time.Millisecond, BackoffCap: 2 * time.Millisecond, Registerer: reg})
	ctx := ctxT(t)
	for i := 1; i <= 3; i++ {
		time.Sleep(5 * time.Millisecond)
		res, err := r.Pass(ctx)
		if err != nil || res.Claimed != 1 {
			t.Fatalf("pass %d: %+v %v", i, res, err)
		}
		if i < 3 && res.Retrying != 1 || i == 3 && res.Exhausted != 1 {
			t.Fatalf("pass %d: %+v", i, res)
		}
	}
	if n := e.count(t, "attempts = 3 AND exhausted_at IS NOT NULL AND sent_at IS NULL AND last_error LIKE 'webhook answered 503%'"); n != 1 {
		t.Fatal("row not exhausted after 3 attempts")
	}
	time.Sleep(5 * time.Millisecond)
	if res, _ := r.Pass(ctx); res.Claimed != 0 {
		t.Fatal("exhausted row claimed again")
	}
	if st := e.sink.Stats(); st.Failed != 3 || st.Deliveries != 0 {
		t.Fatalf("sink %+v, want 3 failed POSTs", st)
	}
	if got := (metric(t, reg, "onceflow_outbox_exhausted_total")); got != 1 {
		t.Errorf("exhausted_total %v", got)
	}
}

// The delay after a failure is a full-jitter draw up to base*2^(attempts-1), or the
// receiver's Retry-After when it sent one.
func TestBackoffDelayAndRetryAfterScheduleTheNextAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{FailRate: 1})
	ctx := ctxT(t)
	r := e.relay(t, outbox.Config{BackoffBase: 10 * time.Minute, BackoffCap: time.Hour})
	if res, err := r.Pass(ctx); err != nil || res.Retrying != 1 {
		t.Fatalf("%+v %v", res, err)
	}
	if n := e.count(t, "attempts = 1 AND next_attempt_at BETWEEN now() AND now() + interval '10 minutes 1 second'"); n != 1 {
		t.Fatal("first retry not scheduled within [0, base]")
	}
	e.exec(t, "UPDATE outbox SET attempts = 4, next_attempt_at = now() WHERE attempts = 1")
	if res, err := r.Pass(ctx); err != nil || res.Retrying != 1 {
		t.Fatalf("%+v %v", res, err)
	}
	if n := e.count(t, "attempts = 5 AND next_attempt_at BETWEEN now() AND now() + interval '61 minutes'"); n != 1 {
		t.Fatal("fifth failure not scheduled within the cap")
	}

	e2 := newEnv(t, 1, webhooksink.Options{FailRate: 1, FailStatus: 429, RetryAfter: 2 * time.Hour})
	r2 := e2.relay(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond, MaxRetryAfter: 90 * time.Minute})
	if res, err := r2.Pass(ctx); err != nil || res.Retrying != 1 {
		t.Fatalf("%+v %v", res, err)
	}
	if n := e2.count(t, "next_attempt_at BETWEEN now() + interval '89 minutes' AND now() + interval '91 minutes'"); n != 1 {
		t.Fatal("Retry-After of 2h not honoured as the next attempt, capped at MaxRetryAfter 90m")
	}
}

func TestPermanent4xxExhaustsAtOnceAndRetryResetsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{FailStatus: 400})
	e.sink.FailNext(1)
	ctx := ctxT(t)
	r := e.relay(t, outbox.Config{})
	if res, err := r.Pass(ctx); err != nil || res.Exhausted != 1 {
		t.Fatalf("%+v %v, want exhausted at once", res, err)
	}
	if n := e.count(t, "attempts = 1 AND exhausted_at IS NOT NULL AND last_error LIKE 'webhook answered 400%'"); n != 1 {
		t.Fatal("permanent failure not recorded")
	}
	rows, err := e.store.List(ctx, pgoutbox.ListOptions{Failed: true})
	if err != nil || len(rows) != 1 {
		t.Fatalf("list --failed: %v %v", rows, err)
	}
	if err := e.store.Retry(ctx, rows[0].ID); err != nil {
		t.Fatal(err)
	}
	if res, err := r.Pass(ctx); err != nil || res.Sent != 1 {
		t.Fatalf("after retry: %+v %v", res, err)
	}
	if st := e.sink.Stats(); st.Deliveries != 1 || st.Failed != 1 {
		t.Fatalf("sink %+v", st)
	}
}

// A relay whose lease ran out while it was sending: another relay claimed and sent the
// row meanwhile, and the late relay's mark changes nothing.
func TestLateMarkIsFenced(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{})
	ctx := ctxT(t)
	reg := prometheus.NewRegistry()
	other := e.relay(t, outbox.Config{Name: "other"})
	var otherRes outbox.PassResult
	slow := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		if err := e.sender.Send(ctx, m); err != nil {
			return err
		}
		// While this send was slow, the lease ran out and another relay took the row.
		if _, err := e.pool.Exec(ctx, "UPDATE outbox SET claimed_until = now() - interval '1 second'"); err != nil {
			return err
		}
		var err error
		otherRes, err = other.Pass(ctx)
		return err
	})
	late := e.relayWith(t, e.store, slow, outbox.Config{Name: "late", Registerer: reg})
	res, err := late.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Fenced != 1 || res.Sent != 0 || otherRes.Sent != 1 {
		t.Fatalf("late %+v, other %+v: want the late mark fenced and the other relay's recorded", res, otherRes)
	}
	if got := (metric(t, reg, "onceflow_outbox_fenced_marks_total")); got != 1 {
		t.Errorf("fenced_marks_total %v", got)
	}
	if e.sink.Count("summary_ready:1") != 2 || e.count(t, "sent_at IS NOT NULL") != 1 {
		t.Fatal("want two deliveries with one key and one sent row")
	}
}

// Graceful shutdown: no claim after cancel, sends in flight finish within the shutdown
// timeout and are marked sent, and the claimed rows that were not sent are released.
func TestShutdownFinishesInFlightSendsAndReleasesTheRest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 20, webhooksink.Options{Latency: 300 * time.Millisecond})
	ctx, cancel := context.WithCancel(ctxT(t))
	r := e.relay(t, outbox.Config{Name: "stopping", BatchSize: 20, Concurrency: 2, ShutdownTimeout: 10 * time.Second})
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	for e.sink.Stats().Deliveries < 3 {
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	delivered := e.sink.Stats().Deliveries
	if delivered >= 20 {
		t.Fatalf("all %d rows sent: the shutdown came too late to test anything", delivered)
	}
	if n := e.count(t, "sent_at IS NOT NULL"); n != delivered {
		t.Fatalf("%d rows marked sent, %d delivered: every finished send must be marked", n, delivered)
	}
	if n := e.count(t, "claimed_by IS NOT NULL OR claimed_until IS NOT NULL"); n != 0 {
		t.Fatalf("%d rows still claimed after shutdown, want all released", n)
	}
	if n := e.count(t, "sent_at IS NULL AND attempts = 0"); n != 20-delivered {
		t.Fatalf("%d unsent rows with attempts 0, want %d", n, 20-delivered)
	}
	// The next relay sends the rest at once, without waiting for a lease.
	next := e.relay(t, outbox.Config{Name: "next", BatchSize: 20, Concurrency: 20})
	if res, err := next.Pass(ctxT(t)); err != nil || res.Sent != 20-delivered {
		t.Fatalf("next relay %+v %v", res, err)
	}
}

// A send that outlives the shutdown timeout is abandoned and its row released.
func TestShutdownTimeoutAbandonsAndReleasesSlowSends(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2, webhooksink.Options{})
	ctx, cancel := context.WithCancel(ctxT(t))
	var started atomic.Int32
	hang := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		started.Add(1)
		<-ctx.Done()
		return ctx.Err()
	})
	r := e.relayWith(t, e.store, hang, outbox.Config{ShutdownTimeout: 100 * time.Millisecond})
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	for started.Load() < 2 {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
	if n := e.count(t, "sent_at IS NULL AND attempts = 0 AND claimed_by IS NULL AND exhausted_at IS NULL"); n != 2 {
		t.Fatalf("%d rows released without an attempt counted, want 2", n)
	}
}

// A send still running when the lease is about to end is cancelled and counted as a
// timeout, so no other relay can claim the row while this one may still send it.
func TestSendsAreCancelledBeforeTheLeaseEnds(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1, webhooksink.Options{})
	ctx := ctxT(t)
	var left time.Duration
	hang := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		d, _ := ctx.Deadline()
		left = time.Until(d)
		<-ctx.Done()
		return ctx.Err()
	})
	r := e.relayWith(t, e.store, hang, outbox.Config{Lease: time.Second, BackoffBase: time.Hour, BackoffCap: time.Hour})
	res, err := r.Pass(ctx)
	if err != nil || res.Retrying != 1 {
		t.Fatalf("%+v %v", res, err)
	}
	if left <= 0 || left > time.Second {
		t.Fatalf("send deadline %v away, want within the 1s lease", left)
	}
	if n := e.count(t, "attempts = 1 AND claimed_by IS NULL AND last_error LIKE '%deadline%'"); n != 1 {
		t.Fatal("timed-out send not recorded as a failed attempt")
	}
}

func TestNewRelayRejectsBadConfig(t *testing.T) {
	t.Parallel()
	store := pgoutbox.New(nil)
	for _, cfg := range []outbox.Config{{BatchSize: -1}, {Lease: -time.Second}, {BackoffBase: time.Hour, BackoffCap: time.Minute}} {
		if _, err := outbox.NewRelay(store, outbox.LogSender{}, cfg); err == nil {
			t.Errorf("NewRelay(%+v) accepted", cfg)
		}
	}
	if _, err := outbox.NewRelay(nil, outbox.LogSender{}, outbox.Config{}); err == nil {
		t.Error("NewRelay without a store accepted")
	}
	r, err := outbox.NewRelay(store, outbox.LogSender{}, outbox.Config{})
	if err != nil || r.Name() == "" {
		t.Fatalf("defaults: %v, name %q", err, r.Name())
	}
	r2, _ := outbox.NewRelay(store, outbox.LogSender{}, outbox.Config{})
	if r.Name() == r2.Name() {
		t.Errorf("two relays got the same default name %q", r.Name())
	}
}

// metric returns the value of the named counter or gauge in reg, summed over labels.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			var v float64
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
			return v
		}
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

// A relay outlives a PostgreSQL restart: passes fail while it is down, and the relay
// drains what was committed before and after once it is back.
func TestRelaySurvivesAPostgresRestart(t *testing.T) {
	t.Parallel()
	pg := testenv.PrivatePostgres(t)
	url := testenv.PostgresURLOf(pg) + "&connect_timeout=1"
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	if _, err := migrations.Up(ctx, url, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	pool, err := connect.Postgres(ctx, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := newEnv(t, 0, webhooksink.Options{})
	e.pool, e.store = pool, pgoutbox.New(pool)
	insert := func(from, to int) {
		e.exec(t, `INSERT INTO outbox (topic, dedupe_key, payload)
			SELECT 't', 'k-' || g, '{}' FROM generate_series($1::int, $2::int) g`, from, to)
	}
	insert(1, 5)
	r := e.relay(t, outbox.Config{PollInterval: 20 * time.Millisecond})
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	waitSent := func(n int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for e.sink.Stats().DistinctKeys < n {
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d rows delivered", e.sink.Stats().DistinctKeys, n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitSent(5)
	pg.Stop()
	time.Sleep(300 * time.Millisecond) // a few failing passes
	pg.Start()
	insert(6, 10)
	waitSent(10)
	cancel()
	<-done
	if st := e.sink.Stats(); st.Deliveries != 10 || len(st.Duplicates) != 0 {
		t.Fatalf("sink %+v, want each of 10 rows once", st)
	}
}

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
