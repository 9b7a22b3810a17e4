package pgoutbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// seed inserts n committed rows with dedupe keys k-1..k-n and returns nothing.
func seed(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	if _, err := pool.Exec(ctxT(t), `INSERT INTO outbox (topic, dedupe_key, payload)
		SELECT 'test', 'k-' || g, jsonb_build_object('n', g) FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
}

func insertTx(t *testing.T, pool *pgxpool.Pool, key string) (pgx.Tx, int64, error) {
	t.Helper()
	ctx := ctxT(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id, err := pgoutbox.Insert(ctx, tx, outbox.Message{Topic: "email.summary_ready", DedupeKey: key,
		Payload: json.RawMessage(`{"to":"a@example.com"}`), Traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	return tx, id, err
}

func count(t *testing.T, pool *pgxpool.Pool, where string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctxT(t), "SELECT count(*) FROM outbox WHERE "+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestInsertCommitsWithTheCallersTransaction(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)

	tx, _, err := insertTx(t, pool, "rolled-back")
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	tx, id, err := insertTx(t, pool, "committed")
	if err != nil || id == 0 {
		t.Fatalf("insert: id %d, %v", id, err)
	}
	if n := count(t, pool, "true"); n != 0 {
		t.Fatalf("%d rows visible before commit", n)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, "true"); n != 1 {
		t.Fatalf("%d rows after one commit and one rollback, want 1", n)
	}
	var tp string
	if err := pool.QueryRow(ctx, `SELECT traceparent FROM outbox WHERE id = $1`, id).Scan(&tp); err != nil || tp == "" {
		t.Fatalf("traceparent %q, %v", tp, err)
	}
}

func TestInsertDuplicateKeyIsErrDuplicateAndLeavesTheTransactionUsable(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	tx, _, err := insertTx(t, pool, "summary_ready:1")
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	tx, id, err := insertTx(t, pool, "summary_ready:1")
	if !errors.Is(err, pgoutbox.ErrDuplicate) || id != 0 {
		t.Fatalf("duplicate insert: id %d, err %v; want ErrDuplicate", id, err)
	}
	// The transaction is not aborted: the caller can go on and decide.
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatalf("transaction unusable after duplicate: %v", err)
	}
	_ = tx.Rollback(ctx)

	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, m := range []outbox.Message{
		{DedupeKey: "k", Payload: json.RawMessage(`{}`)},
		{Topic: "t", Payload: json.RawMessage(`{}`)},
		{Topic: "t", DedupeKey: "k", Payload: json.RawMessage(`{not json`)},
	} {
		if _, err := pgoutbox.Insert(ctx, tx, m); err == nil || errors.Is(err, pgoutbox.ErrDuplicate) {
			t.Errorf("Insert(%+v) = %v, want a validation error", m, err)
		}
	}
}

func TestClaimLeasesDueRowsOnceInDueOrder(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	s := pgoutbox.New(pool)
	seed(t, pool, 5)
	// k-5 is due first, k-4 is not due yet, k-3 is sent, k-2 is exhausted.
	if _, err := pool.Exec(ctx, `UPDATE outbox SET next_attempt_at = now() - interval '1 hour' WHERE dedupe_key = 'k-5';
		UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE dedupe_key = 'k-4';
		UPDATE outbox SET sent_at = now() WHERE dedupe_key = 'k-3';
		UPDATE outbox SET exhausted_at = now() WHERE dedupe_key = 'k-2'`); err != nil {
		t.Fatal(err)
	}
	got, err := s.Claim(ctx, "a", 10, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if keys := keysOf(got); fmt.Sprint(keys) != "[k-5 k-1]" {
		t.Fatalf("claimed %v, want [k-5 k-1] (due order, only due rows)", keys)
	}
	if string(got[0].Payload) != `{"n": 5}` || got[0].Topic != "test" || got[0].CreatedAt.IsZero() {
		t.Errorf("claimed message %+v", got[0])
	}
	if again, err := s.Claim(ctx, "b", 10, time.Minute); err != nil || len(again) != 0 {
		t.Fatalf("second claim while leased: %v %v, want nothing", keysOf(again), err)
	}
	if n := count(t, pool, "claimed_by = 'a' AND claimed_until > now() + interval '50 seconds'"); n != 2 {
		t.Fatalf("%d rows leased to a for about a minute, want 2", n)
	}
	// Once the lease has run out, another relay may claim.
	if _, err := pool.Exec(ctx, `UPDATE outbox SET claimed_until = now() - interval '1 second' WHERE claimed_by = 'a'`); err != nil {
		t.Fatal(err)
	}
	again, err := s.Claim(ctx, "b", 1, time.Minute)
	if err != nil || fmt.Sprint(keysOf(again)) != "[k-5]" {
		t.Fatalf("claim after lease: %v %v, want [k-5] (limit 1)", keysOf(again), err)
	}
}

// Ids are assigned at insert and commit out of order: a relay that polled "id > last
// seen" would skip the row of the transaction that committed late.
func TestClaimFindsRowsThatCommitOutOfIdOrder(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	s := pgoutbox.New(pool)
	slow, slowID, err := insertTx(t, pool, "slow") // lower id, commits last
	if err != nil {
		t.Fatal(err)
	}
	fast, fastID, err := insertTx(t, pool, "fast")
	if err != nil {
		t.Fatal(err)
	}
	if err := fast.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if slowID >= fastID {
		t.Fatalf("ids %d, %d: want the slow row's id lower", slowID, fastID)
	}
	first, err := s.Claim(ctx, "r", 10, time.Minute)
	if err != nil || fmt.Sprint(keysOf(first)) != "[fast]" {
		t.Fatalf("first claim %v %v", keysOf(first), err)
	}
	if err := slow.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	second, err := s.Claim(ctx, "r", 10, time.Minute)
	if err != nil || fmt.Sprint(keysOf(second)) != "[slow]" {
		t.Fatalf("second claim %v %v, want the late-committing lower id", keysOf(second), err)
	}
}

func TestSettleIsFencedByTheCurrentClaim(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	s := pgoutbox.New(pool)
	seed(t, pool, 3)
	a, err := s.Claim(ctx, "relay-a", 10, time.Minute)
	if err != nil || len(a) != 3 {
		t.Fatalf("claim: %d %v", len(a), err)
	}
	// relay-a's lease runs out; relay-b claims two of the rows.
	if _, err := pool.Exec(ctx, `UPDATE outbox SET claimed_until = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	b, err := s.Claim(ctx, "relay-b", 2, time.Minute)
	if err != nil || len(b) != 2 {
		t.Fatalf("claim b: %d %v", len(b), err)
	}
	// relay-a's late mark applies only to the row nobody claimed since.
	got, err := s.Settle(ctx, "relay-a", outbox.Settlement{Sent: []int64{a[0].ID, a[1].ID, a[2].ID}})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got.Sent) != fmt.Sprint([]int64{a[2].ID}) || got.Len() != 1 {
		t.Fatalf("relay-a settled %+v, want only row %d", got, a[2].ID)
	}
	if n := count(t, pool, "claimed_by = 'relay-b' AND sent_at IS NULL"); n != 2 {
		t.Fatalf("relay-b's rows changed by relay-a's late mark: %d still claimed and unsent, want 2", n)
	}
	got, err = s.Settle(ctx, "relay-b", outbox.Settlement{
		Failed: []outbox.Failure{{ID: b[0].ID, Error: "boom", Delay: time.Hour}, {ID: b[1].ID, Error: "bad request", Exhaust: true}},
	})
	if err != nil || len(got.Retrying) != 1 || len(got.Exhausted) != 1 {
		t.Fatalf("relay-b settled %+v %v", got, err)
	}
	if n := count(t, pool, `id = $1 AND attempts = 1 AND last_error = 'boom' AND claimed_by IS NULL
		AND next_attempt_at > now() + interval '59 minutes' AND exhausted_at IS NULL`, b[0].ID); n != 1 {
		t.Error("failed row not rescheduled with attempts 1, its error and the delay")
	}
	if n := count(t, pool, `id = $1 AND attempts = 1 AND exhausted_at IS NOT NULL AND claimed_by IS NULL`, b[1].ID); n != 1 {
		t.Error("permanent failure not exhausted")
	}
	// Settling a settled row again changes nothing.
	if got, err := s.Settle(ctx, "relay-b", outbox.Settlement{Sent: []int64{b[0].ID, b[1].ID}}); err != nil || got.Len() != 0 {
		t.Fatalf("second settle %+v %v, want nothing", got, err)
	}
}

func TestReleaseClearsTheLeaseWithoutCountingAnAttempt(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	s := pgoutbox.New(pool)
	seed(t, pool, 2)
	c, err := s.Claim(ctx, "r", 10, time.Minute)
	if err != nil || len(c) != 2 {
		t.Fatal(len(c), err)
	}
	got, err := s.Settle(ctx, "r", outbox.Settlement{Released: []int64{c[0].ID, c[1].ID}})
	if err != nil || len(got.Released) != 2 {
		t.Fatalf("release: %+v %v", got, err)
	}
	if n := count(t, pool, "claimed_by IS NULL AND claimed_until IS NULL AND attempts = 0 AND sent_at IS NULL"); n != 2 {
		t.Fatalf("%d rows released cleanly, want 2", n)
	}
	if again, err := s.Claim(ctx, "other", 10, time.Minute); err != nil || len(again) != 2 {
		t.Fatalf("released rows not claimable at once: %d %v", len(again), err)
	}
}

// One claim and one settle per batch, whatever its size: the round trips the relay's
// throughput and PostgreSQL's commit ceiling depend on.
func TestOneClaimAndOneSettleRoundTripPerBatch(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	seed(t, pool, 150)
	var rt roundtrip.Counter
	counted, err := connect.Postgres(ctxT(t), dsn+"&pool_max_conns=1", &rt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(counted.Close)
	s := pgoutbox.New(counted)
	relay, err := outbox.NewRelay(s, outbox.SenderFunc(func(context.Context, outbox.Message) error { return nil }),
		outbox.Config{BatchSize: 50, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	if _, err := relay.Pass(ctx); err != nil { // warm up: prepares the statements once per connection
		t.Fatal(err)
	}
	for range 2 {
		rt.Reset()
		res, err := relay.Pass(ctx)
		if err != nil || res.Sent != 50 {
			t.Fatalf("pass: %+v %v", res, err)
		}
		if got := rt.Postgres(); got != 2 {
			t.Fatalf("%d PostgreSQL round trips for a batch of 50, want 2 (claim, settle)", got)
		}
	}
	rt.Reset()
	if res, err := relay.Pass(ctx); err != nil || res.Claimed != 0 || rt.Postgres() != 1 {
		t.Fatalf("empty pass: %+v %v, %d round trips, want 1", res, err, rt.Postgres())
	}
}

func TestPurgeSentDeletesOnlyOldSentRowsInBatches(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	seed(t, pool, 10)
	// k-1..k-7 sent 8 days ago, k-8 sent now, k-9 unsent and old, k-10 exhausted and old.
	if _, err := pool.Exec(ctx, `
		UPDATE outbox SET sent_at = now() - interval '8 days', created_at = now() - interval '8 days'
			WHERE dedupe_key IN ('k-1','k-2','k-3','k-4','k-5','k-6','k-7');
		UPDATE outbox SET sent_at = now() WHERE dedupe_key = 'k-8';
		UPDATE outbox SET created_at = now() - interval '9 days' WHERE dedupe_key = 'k-9';
		UPDATE outbox SET exhausted_at = now() - interval '9 days', created_at = now() - interval '9 days' WHERE dedupe_key = 'k-10'`); err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(pgoutbox.New(pool), outbox.LogSender{Logger: testenv.Logger(t)},
		outbox.Config{PurgeBatch: 3, Retention: 7 * 24 * time.Hour, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	n, err := relay.Purge(ctx)
	if err != nil || n != 7 {
		t.Fatalf("purged %d, %v; want 7", n, err)
	}
	var left []string
	rows, _ := pool.Query(ctx, `SELECT dedupe_key FROM outbox ORDER BY id`)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || fmt.Sprint(left) != "[k-8 k-9 k-10]" {
		t.Fatalf("left %v %v", left, err)
	}
	if n, err := pgoutbox.New(pool).PurgeSent(ctx, 7*24*time.Hour, 3); n != 0 || err != nil {
		t.Fatalf("second purge %d %v", n, err)
	}
}

func TestListRetryAndStats(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	s := pgoutbox.New(pool)
	seed(t, pool, 5)
	if _, err := pool.Exec(ctx, `
		UPDATE outbox SET sent_at = now() WHERE dedupe_key IN ('k-1', 'k-2');
		UPDATE outbox SET exhausted_at = now(), attempts = 10, last_error = 'webhook answered 400',
			created_at = now() - interval '1 hour' WHERE dedupe_key IN ('k-3', 'k-4');
		UPDATE outbox SET created_at = now() - interval '2 hours' WHERE dedupe_key = 'k-5'`); err != nil {
		t.Fatal(err)
	}
	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Total != 5 || st.Sent != 2 || st.Unsent != 1 || st.Exhausted != 2 {
		t.Fatalf("stats %+v", st)
	}
	if st.OldestUnsentAge < 119*time.Minute || st.OldestUnsentAge > 121*time.Minute ||
		st.OldestExhaustedAge < 59*time.Minute || st.OldestExhaustedAge > 61*time.Minute {
		t.Fatalf("ages %v / %v, want about 2h / 1h", st.OldestUnsentAge, st.OldestExhaustedAge)
	}
	if age, err := s.OldestUnsent(ctx); err != nil || age < 119*time.Minute {
		t.Fatalf("OldestUnsent %v %v", age, err)
	}

	all, err := s.List(ctx, pgoutbox.ListOptions{})
	if err != nil || len(all) != 5 || all[0].DedupeKey != "k-5" || all[0].State != "pending" || all[4].State != "sent" {
		t.Fatalf("list all: %d rows %+v %v", len(all), all, err)
	}
	failed, err := s.List(ctx, pgoutbox.ListOptions{Failed: true})
	if err != nil || len(failed) != 2 || failed[0].State != "exhausted" || failed[0].LastError != "webhook answered 400" {
		t.Fatalf("list failed: %+v %v", failed, err)
	}

	if err := s.Retry(ctx, failed[0].ID); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, "id = $1 AND attempts = 0 AND exhausted_at IS NULL AND next_attempt_at <= now()", failed[0].ID); n != 1 {
		t.Fatal("retried row not reset")
	}
	if err := s.Retry(ctx, failed[0].ID); !errors.Is(err, pgoutbox.ErrNotExhausted) {
		t.Fatalf("retry of a pending row: %v, want ErrNotExhausted", err)
	}
	if err := s.Retry(ctx, 999999); !errors.Is(err, pgoutbox.ErrNotFound) {
		t.Fatalf("retry of a missing row: %v, want ErrNotFound", err)
	}
	if n, err := s.RetryAll(ctx); err != nil || n != 1 {
		t.Fatalf("retry all: %d %v, want 1", n, err)
	}
	if st, _ := s.Stats(ctx); st.Exhausted != 0 || st.Unsent != 3 {
		t.Fatalf("stats after retry %+v", st)
	}
}

func keysOf(ms []outbox.Message) []string {
	keys := make([]string, len(ms))
	for i, m := range ms {
		keys[i] = m.DedupeKey
	}
	return keys
}

// QueueInsert's strict insert commits with the batch's other statements in one implicit
// transaction, and an existing dedupe key fails it (IsDuplicate) and rolls the whole
// batch back: nothing of it is written.
func TestQueueInsertIsStrictAndAtomicWithTheBatch(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	seed(t, pool, 1) // k-1
	msg := func(key string) outbox.Message {
		return outbox.Message{Topic: "test", DedupeKey: key, Payload: json.RawMessage(`{"n":0}`)}
	}
	send := func(keys ...string) error {
		b := &pgx.Batch{}
		for _, k := range keys {
			if err := pgoutbox.QueueInsert(b, msg(k)); err != nil {
				t.Fatal(err)
			}
		}
		return pool.SendBatch(ctx, b).Close()
	}
	if err := send("k-2", "k-3"); err != nil {
		t.Fatal(err)
	}
	err := send("k-4", "k-1", "k-5")
	if !pgoutbox.IsDuplicate(err) {
		t.Fatalf("existing key: %v, want the dedupe key's unique violation", err)
	}
	if n := count(t, pool, "true"); n != 3 {
		t.Fatalf("%d rows, want 3: the failed batch wrote part of itself", n)
	}
	if pgoutbox.IsDuplicate(errors.New("23505")) || pgoutbox.IsDuplicate(nil) {
		t.Fatal("IsDuplicate matched a non-PostgreSQL error")
	}
	b := &pgx.Batch{}
	if err := pgoutbox.QueueInsert(b, outbox.Message{Topic: "t", DedupeKey: "k", Payload: json.RawMessage(`{`)}); err == nil || b.Len() != 0 {
		t.Fatalf("invalid payload: %v, %d queued", err, b.Len())
	}
}

// List's Topic selects one topic, or a prefix's ("email." or "email.*"), as the router's
// keys do.
func TestListByTopic(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	s := pgoutbox.New(pool)
	for i, topic := range []string{"email.reply", "email.summary_ready", "payments.refund", "emailer"} {
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (topic, dedupe_key, payload) VALUES ($1, $2, '{}')`, topic, fmt.Sprint("t-", i)); err != nil {
			t.Fatal(err)
		}
	}
	for topic, want := range map[string]string{
		"":                "[emailer payments.refund email.summary_ready email.reply]",
		"payments.refund": "[payments.refund]",
		"email.":          "[email.summary_ready email.reply]",
		"email.*":         "[email.summary_ready email.reply]",
		"email":           "[]",
		"email.reply":     "[email.reply]",
	} {
		rows, err := s.List(ctx, pgoutbox.ListOptions{Topic: topic})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, r := range rows {
			got = append(got, r.Topic)
		}
		if g := fmt.Sprint(got); g != want && !(want == "[]" && got == nil) {
			t.Errorf("Topic %q: %s, want %s", topic, g, want)
		}
	}
}
