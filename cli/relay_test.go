package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
)

func seedOutbox(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `INSERT INTO outbox (topic, dedupe_key, payload)
		SELECT 'email.summary_ready', 'summary_ready:' || g, jsonb_build_object('job_id', g, 'to', 'u' || g || '@example.com')
		FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
}

func countOutbox(t *testing.T, pool *pgxpool.Pool, where string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE "+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func relayEnv(dsn, webhookURL string, extra ...string) []string {
	return append([]string{"ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + webhookURL,
		"ONCEFLOW_RELAY_INTERVAL=50ms"}, extra...)
}

// A relay process killed with kill -9 in the middle of a batch: the rows it had claimed
// stay claimed until their lease ends, then another relay sends them. None is lost;
// the only duplicates are rows the dead relay had sent but not marked, always with the
// same Idempotency-Key.
func TestRelayKilledMidBatchItsRowsAreSentByAnotherAfterTheLease(t *testing.T) {
	t.Parallel()
	const rows = 200
	pool, dsn := testenv.Postgres(t)
	seedOutbox(t, pool, rows)
	sink := webhooksink.New(webhooksink.Options{Latency: 300 * time.Millisecond})
	srv := httptest.NewServer(sink)
	t.Cleanup(srv.Close)
	bin := testenv.Binary(t)
	const lease = 4 * time.Second
	env := relayEnv(dsn, srv.URL, "ONCEFLOW_RELAY_LEASE="+lease.String(), "ONCEFLOW_RELAY_BATCH_SIZE=20", "ONCEFLOW_RELAY_CONCURRENCY=5")

	first := testenv.Start(t, bin, env, "relay")
	testenv.WaitFor(t, 30*time.Second, "the first relay's deliveries", func() bool { return sink.Stats().Deliveries >= 7 })
	first.Kill()
	killedAt := time.Now()
	sink.SetLatency(0)

	// What the dead relay left: rows claimed but not marked, leased for a while yet.
	type claimed struct {
		key   string
		until time.Time
	}
	r, err := pool.Query(context.Background(), `SELECT dedupe_key, claimed_until FROM outbox
		WHERE claimed_by IS NOT NULL AND sent_at IS NULL`)
	if err != nil {
		t.Fatal(err)
	}
	orphans, err := pgx.CollectRows(r, func(row pgx.CollectableRow) (claimed, error) {
		var c claimed
		return c, row.Scan(&c.key, &c.until)
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(orphans) == 0 {
		t.Fatal("the killed relay held no claimed rows: the kill was not mid-batch")
	}
	orphanUntil := map[string]time.Time{}
	for _, o := range orphans {
		orphanUntil[o.key] = o.until
	}

	second := testenv.Start(t, bin, env, "relay")
	testenv.WaitFor(t, 60*time.Second, "every row sent", func() bool { return countOutbox(t, pool, "sent_at IS NOT NULL") == rows })
	second.Signal(syscall.SIGTERM)
	if code := second.Wait(30 * time.Second); code != 0 {
		t.Fatalf("second relay exit %d", code)
	}

	st := sink.Stats()
	if st.DistinctKeys != rows || st.MissingKey != 0 {
		t.Fatalf("sink saw %d distinct keys, want %d (none lost)", st.DistinctKeys, rows)
	}
	extra := 0
	for key, n := range st.Duplicates {
		if _, ok := orphanUntil[key]; !ok {
			t.Errorf("key %s delivered %d times but was not held by the killed relay", key, n)
		}
		extra += n - 1
	}
	if st.Deliveries != rows+extra || extra > len(orphans) {
		t.Fatalf("%d deliveries, %d extra, %d orphans", st.Deliveries, extra, len(orphans))
	}
	// No orphan went out again before its lease ended.
	for _, d := range sink.Deliveries() {
		if until, ok := orphanUntil[d.Key]; ok && d.At.After(killedAt) && d.At.Before(until.Add(-50*time.Millisecond)) {
			t.Errorf("orphan %s re-sent at %v, before its lease ended at %v", d.Key, d.At, until)
		}
	}
	t.Logf("killed relay left %d claimed rows; %d were delivered twice (same key)", len(orphans), extra)
}

// SIGTERM: the relay stops claiming, finishes the sends in flight, marks them, releases
// the rest of its batch and exits 0.
func TestRelaySIGTERMFinishesInFlightSendsAndReleasesTheRest(t *testing.T) {
	t.Parallel()
	const rows = 40
	pool, dsn := testenv.Postgres(t)
	seedOutbox(t, pool, rows)
	sink := webhooksink.New(webhooksink.Options{Latency: 300 * time.Millisecond})
	srv := httptest.NewServer(sink)
	t.Cleanup(srv.Close)
	p := testenv.Start(t, testenv.Binary(t), relayEnv(dsn, srv.URL, "ONCEFLOW_RELAY_BATCH_SIZE=20",
		"ONCEFLOW_RELAY_CONCURRENCY=2", "ONCEFLOW_SHUTDOWN_TIMEOUT=10s", "ONCEFLOW_METRICS_ADDR=127.0.0.1:0"), "relay")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	metricsURL := "http://" + fmt.Sprint(p.WaitLog(ctx, "http listening")["addr"]) + "/metrics"
	testenv.WaitFor(t, 30*time.Second, "deliveries", func() bool { return sink.Stats().Deliveries >= 3 })
	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"onceflow_outbox_sent_total ", `onceflow_outbox_send_failures_total{class="permanent"} 0`,
		"onceflow_outbox_claimed_batches_total 1", "onceflow_outbox_oldest_unsent_age_seconds ", "onceflow_build_info{"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(30 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	delivered := sink.Stats().Deliveries
	if delivered >= rows {
		t.Fatal("everything was sent before SIGTERM: nothing tested")
	}
	if n := countOutbox(t, pool, "sent_at IS NOT NULL"); n != delivered {
		t.Fatalf("%d rows marked sent, %d delivered", n, delivered)
	}
	if n := countOutbox(t, pool, "claimed_by IS NOT NULL"); n != 0 {
		t.Fatalf("%d rows still claimed after a graceful stop", n)
	}
	if n := countOutbox(t, pool, "sent_at IS NULL AND attempts = 0"); n != rows-delivered {
		t.Fatalf("%d unsent rows untouched, want %d", n, rows-delivered)
	}
	if !strings.Contains(p.Stderr(), `"msg":"relay stopped"`) {
		t.Errorf("no clean stop logged")
	}
}

func TestOutboxListAndRetryCommands(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	seedOutbox(t, pool, 3)
	if _, err := pool.Exec(context.Background(), `UPDATE outbox SET exhausted_at = now(), attempts = 10,
		last_error = 'webhook answered 400 Bad Request' WHERE dedupe_key IN ('summary_ready:1', 'summary_ready:2')`); err != nil {
		t.Fatal(err)
	}
	bin := testenv.Binary(t)
	env := []string{"ONCEFLOW_DATABASE_URL=" + dsn}
	run := func(want int, args ...string) *testenv.Process {
		t.Helper()
		p := testenv.Start(t, bin, env, args...)
		if code := p.Wait(20 * time.Second); code != want {
			t.Fatalf("onceflow %s: exit %d, want %d\nstdout %s\nstderr %s", strings.Join(args, " "), code, want, p.Stdout(), p.Stderr())
		}
		return p
	}
	var failed []struct {
		ID        int64  `json:"id"`
		State     string `json:"state"`
		DedupeKey string `json:"dedupe_key"`
		Attempts  int    `json:"attempts"`
		LastError string `json:"last_error"`
	}
	out := run(0, "outbox", "list", "--failed", "--json").Stdout()
	if err := json.Unmarshal([]byte(out), &failed); err != nil {
		t.Fatalf("list --failed --json: %v\n%s", err, out)
	}
	if len(failed) != 2 || failed[0].State != "exhausted" || failed[0].Attempts != 10 || !strings.Contains(failed[0].LastError, "400") {
		t.Fatalf("failed rows %+v", failed)
	}
	table := run(0, "outbox", "list").Stdout()
	if !strings.Contains(table, "DEDUPE_KEY") || strings.Count(table, "summary_ready:") != 3 || !strings.Contains(table, "pending") {
		t.Fatalf("table:\n%s", table)
	}

	run(0, "outbox", "retry", fmt.Sprint(failed[0].ID))
	if n := countOutbox(t, pool, "exhausted_at IS NULL AND attempts = 0"); n != 2 {
		t.Fatalf("%d rows due with fresh attempts, want 2", n)
	}
	if p := run(1, "outbox", "retry", fmt.Sprint(failed[0].ID)); !strings.Contains(p.Stderr(), "not exhausted") {
		t.Fatalf("retry of a pending row: %s", p.Stderr())
	}
	if p := run(1, "outbox", "retry", "999999"); !strings.Contains(p.Stderr(), "no such outbox row") {
		t.Fatalf("retry of a missing row: %s", p.Stderr())
	}
	run(2, "outbox", "retry")
	run(2, "outbox", "retry", "--all", "1")
	run(2, "outbox", "retry", "abc")
	run(2, "outbox", "frobnicate")
	if out := run(0, "outbox", "retry", "--all").Stdout(); !strings.Contains(out, "1 exhausted rows reset") {
		t.Fatalf("retry --all: %s", out)
	}
	if out := run(0, "outbox", "list", "--failed", "--json").Stdout(); strings.TrimSpace(out) != "[]" {
		t.Fatalf("list --failed after retry --all: %s", out)
	}
}

func TestWebhookSinkCommandCountsDeliveriesPerKey(t *testing.T) {
	t.Parallel()
	p := testenv.Start(t, testenv.Binary(t), nil, "webhook-sink", "--addr", "127.0.0.1:0")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	base := "http://" + fmt.Sprint(p.WaitLog(ctx, "webhook sink listening")["addr"])
	for _, key := range []string{"a", "b", "a"} {
		req, _ := http.NewRequest(http.MethodPost, base, strings.NewReader(`{"topic":"t"}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	resp, err := http.Get(base)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var st webhooksink.Stats
	if err := json.Unmarshal(b, &st); err != nil || st.Deliveries != 3 || st.DistinctKeys != 2 || st.Duplicates["a"] != 2 {
		t.Fatalf("stats %s (%v)", b, err)
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if help := testenv.Start(t, testenv.Binary(t), nil, "help"); help.Wait(10*time.Second) != 0 || !strings.Contains(help.Stdout(), "webhook-sink") {
		t.Fatalf("webhook-sink, a documented command, must be in help:\n%s", help.Stdout())
	}
}

// The binary's relay sends the summaries workflow's topic with ONCEFLOW_SENDER and
// claims nothing else: a row of a topic no workflow of the binary sends (written by
// another program into the same outbox) waits untouched, never tried nor exhausted, for
// a relay that has a sender for it; audit reports it once it is old.
func TestRelaySendsOnlyTheSummariesTopic(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	// The foreign row first: the oldest, so a relay claiming every topic takes it first.
	if _, err := pool.Exec(context.Background(), `INSERT INTO outbox (topic, dedupe_key, payload)
		VALUES ('payments.refund', 'refund:1', '{}')`); err != nil {
		t.Fatal(err)
	}
	seedOutbox(t, pool, 3)
	sink := webhooksink.New(webhooksink.Options{})
	srv := httptest.NewServer(sink)
	t.Cleanup(srv.Close)
	p := testenv.Start(t, testenv.Binary(t), relayEnv(dsn, srv.URL, "ONCEFLOW_SHUTDOWN_TIMEOUT=10s"), "relay")
	testenv.WaitFor(t, 20*time.Second, "the summaries emails sent", func() bool {
		return countOutbox(t, pool, "topic = 'email.summary_ready' AND sent_at IS NOT NULL") == 3
	})
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	if st := sink.Stats(); st.Deliveries != 3 || sink.Count("refund:1") != 0 {
		t.Fatalf("%d deliveries (%d of refund:1), want the 3 summaries emails only", st.Deliveries, sink.Count("refund:1"))
	}
	if n := countOutbox(t, pool, "topic = 'payments.refund' AND sent_at IS NULL AND exhausted_at IS NULL AND attempts = 0 AND claimed_by IS NULL"); n != 1 {
		t.Fatalf("the foreign row was touched (%d untouched, want 1)", n)
	}
}
