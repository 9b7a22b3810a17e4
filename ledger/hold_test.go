package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// heldCall makes one call through a Client under HoldAnswers and returns the ledger,
// its pool, the hold, the call's key and the answer the caller got.
func heldCall(t *testing.T) (*ledger.Ledger, *pgxpool.Pool, *ledger.Held, string, *llm.Response) {
	t.Helper()
	_, adapter := fakeLLM(t, fakeserver.Config{})
	l, pool := newLedger(t, ledger.Config{})
	var h ledger.Held
	req := request("Summarise the refund policy")
	req.IdempotencyKey = "job-1:summarise"
	resp, err := l.Wrap("openai", adapter).Complete(ledger.HoldAnswers(ctxT(t), &h), req)
	if err != nil {
		t.Fatal(err)
	}
	return l, pool, &h, ledger.Key(req.IdempotencyKey, req), resp
}

// sideTable creates a table of the test's own for what a caller writes with an answer.
func sideTable(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	name := fmt.Sprintf("held_side_%d", time.Now().UnixNano())
	if _, err := pool.Exec(ctxT(t), `CREATE TABLE `+name+` (answer text)`); err != nil {
		t.Fatal(err)
	}
	return name
}

// commitWithHeld sends h's answers and one row of the caller's as one batch: one
// implicit transaction, as onceflow's job Commit does.
func commitWithHeld(t *testing.T, pool *pgxpool.Pool, h *ledger.Held, table, answer string) (queued int, err error) {
	t.Helper()
	b := &pgx.Batch{}
	keys, err := h.Queue(b)
	if err != nil {
		t.Fatal(err)
	}
	queued = len(keys)
	b.Queue(`INSERT INTO `+table+` VALUES ($1)`, answer)
	return queued, pool.SendBatch(ctxT(t), b).Close()
}

// A held answer is not recorded until the caller's batch commits, and then it is,
// with the caller's own row in the same commit.
func TestHeldAnswerIsRecordedWithTheCallersCommit(t *testing.T) {
	t.Parallel()
	l, pool, h, key, resp := heldCall(t)
	if r := mustGet(t, l, key); r.State != ledger.StateInFlight || !h.Pending() {
		t.Fatalf("after the call: row %s, held %v; want in_flight and held", r.State, h.Pending())
	}
	table := sideTable(t, pool)
	queued, err := commitWithHeld(t, pool, h, table, resp.Content)
	if err != nil || queued != 1 {
		t.Fatalf("batch: %d queued, %v", queued, err)
	}
	h.Committed()
	r := mustGet(t, l, key)
	if r.State != ledger.StateSucceeded || r.Attempt != 1 || h.Pending() {
		t.Fatalf("after the commit: row %s attempt %d, held %v; want succeeded in attempt 1, nothing held", r.State, r.Attempt, h.Pending())
	}
	rec, err := l.Wrap("openai", nil).Complete(ctxT(t), &llm.Request{Model: "gpt-4.1-mini", IdempotencyKey: "job-1:summarise",
		Messages: []llm.Message{{Role: llm.RoleUser, Content: "Summarise the refund policy"}}})
	if err != nil || rec.Content != resp.Content {
		t.Fatalf("replay: %v, %q; want the held answer %q", err, rec.Content, resp.Content)
	}
}

// When another attempt recorded the call's answer first, the held answer's statement
// fails the caller's transaction: nothing the caller wrote with it commits, and
// RecordHeld says the answer was superseded.
func TestHeldAnswerSupersededFailsTheCallersTransaction(t *testing.T) {
	t.Parallel()
	l, pool, h, key, resp := heldCall(t)
	r := mustGet(t, l, key)
	other := ledger.Result{Response: []byte(`{"content":"another answer"}`), Raw: []byte(`{}`)}
	call := ledger.Call{Key: key, Work: r.Work, RequestHash: r.RequestHash, Provider: r.Provider, Model: r.Model}
	if ok, err := l.Record(ctxT(t), nil, call, other); err != nil || !ok {
		t.Fatalf("another attempt's record: %v, %v", ok, err)
	}
	table := sideTable(t, pool)
	_, err := commitWithHeld(t, pool, h, table, resp.Content)
	if !ledger.IsSuperseded(err) {
		t.Fatalf("batch: %v, want a superseded answer", err)
	}
	var n int
	if err := pool.QueryRow(ctxT(t), `SELECT count(*) FROM `+table).Scan(&n); err != nil || n != 0 {
		t.Fatalf("the caller's rows: %d (%v), want 0", n, err)
	}
	var sup *ledger.SupersededError
	if err := l.RecordHeld(ctxT(t), h); !errors.As(err, &sup) || sup.Key != key || h.Pending() {
		t.Fatalf("RecordHeld: %v, held %v; want a SupersededError for %s, nothing held", err, h.Pending(), key)
	}
	// The holder acted on an answer that is not the recorded one: whatever it writes
	// with the hold from then on fails with the same error.
	b := &pgx.Batch{}
	if keys, err := h.Queue(b); !errors.As(err, &sup) || len(keys) != 0 || b.Len() != 0 {
		t.Errorf("Queue after the superseded answer: %v queued (%d statements), %v; want the SupersededError", keys, b.Len(), err)
	}
	if err := l.RecordHeld(ctxT(t), h); !errors.As(err, &sup) || sup.Key != key {
		t.Errorf("RecordHeld again: %v; want the SupersededError for %s", err, key)
	}
}

// A batch that committed although its caller did not learn so (the connection lost
// with the COMMIT's reply) recorded the answer: RecordHeld then finds it as this
// attempt's own and succeeds.
func TestRecordHeldFindsItsOwnAnswerACommitRecordedUnseen(t *testing.T) {
	t.Parallel()
	l, pool, h, key, resp := heldCall(t)
	if _, err := commitWithHeld(t, pool, h, sideTable(t, pool), resp.Content); err != nil {
		t.Fatal(err)
	}
	// No Committed: the caller does not know.
	if err := l.RecordHeld(ctxT(t), h); err != nil || h.Pending() {
		t.Fatalf("RecordHeld: %v, held %v; want nil and nothing held", err, h.Pending())
	}
	if r := mustGet(t, l, key); r.State != ledger.StateSucceeded || r.Attempt != 1 {
		t.Fatalf("row %s attempt %d", r.State, r.Attempt)
	}
}

// RecordHeld records alone, and an answer PostgreSQL could not record stays held for
// a later try.
func TestRecordHeldKeepsWhatPostgresCouldNotRecord(t *testing.T) {
	t.Parallel()
	_, adapter := fakeLLM(t, fakeserver.Config{})
	_, dsn := testenv.Postgres(t)
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	l, err := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var h ledger.Held
	req := request("Summarise the outage report")
	req.IdempotencyKey = "job-2:summarise"
	if _, err := l.Wrap("openai", adapter).Complete(ledger.HoldAnswers(ctxT(t), &h), req); err != nil {
		t.Fatal(err)
	}
	pool.Close() // PostgreSQL out of reach
	if err := l.RecordHeld(ctxT(t), &h); !errors.Is(err, ledger.ErrUnavailable) || !h.Pending() {
		t.Fatalf("RecordHeld without PostgreSQL: %v, held %v; want ErrUnavailable and the answer still held", err, h.Pending())
	}
	pool2, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool2.Close)
	l2, err := ledger.New(pool2, ledger.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if r := mustGet(t, l2, ledger.Key(req.IdempotencyKey, req)); r.State != ledger.StateInFlight {
		t.Fatalf("row %s, want in_flight (the answer unrecorded)", r.State)
	}
}

// RecordHeld reports an answer another attempt recorded first (a *SupersededError: the
// caller acted on an answer that is not the recorded one) even when PostgreSQL could
// not write another held answer before it: the database error must not mask the
// supersession, which the caller has to act on (retry), and which the hold forgets.
func TestRecordHeldReportsASupersededAnswerBesideAnUnavailableOne(t *testing.T) {
	t.Parallel()
	_, adapter := fakeLLM(t, fakeserver.Config{})
	l, pool := newLedger(t, ledger.Config{})
	var h ledger.Held
	var keys []string
	for _, step := range []string{"first", "second"} {
		req := request("Summarise the refund policy")
		req.IdempotencyKey = "job-1:" + step
		if _, err := l.Wrap("openai", adapter).Complete(ledger.HoldAnswers(ctxT(t), &h), req); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, ledger.Key(req.IdempotencyKey, req))
	}
	// The first answer's write fails (the database refuses it); the second's row holds
	// another attempt's answer already.
	for _, sql := range []string{
		`CREATE FUNCTION refuse_first() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.idem_key = '` + keys[0] + `' AND NEW.state = 'succeeded' THEN RAISE EXCEPTION 'the answer cannot be written now'; END IF;
	RETURN NEW;
END $$`,
		`CREATE TRIGGER refuse_first BEFORE INSERT OR UPDATE ON llm_calls FOR EACH ROW EXECUTE FUNCTION refuse_first()`,
	} {
		if _, err := pool.Exec(ctxT(t), sql); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctxT(t), `UPDATE llm_calls SET state = 'succeeded', attempt = 2, owner = NULL, lease_until = NULL,
	response = '{"content": "another attempt''s answer"}', response_raw = 'other' WHERE idem_key = $1`, keys[1]); err != nil {
		t.Fatal(err)
	}
	err := l.RecordHeld(ctxT(t), &h)
	var sup *ledger.SupersededError
	if !errors.As(err, &sup) {
		t.Fatalf("RecordHeld: %v; want a *SupersededError for %s (the first answer's database error aside)", err, keys[1])
	}
}

// A Queue while a RecordHeld is recording the answers (taken out of the hold) must
// not let the caller's batch commit without them: it waits for that RecordHeld, and
// when the answer turns out superseded, returns its error, so nothing the caller
// wrote with the answer commits.
func TestQueueBesideARecordHeldInProgressReturnsItsSupersededError(t *testing.T) {
	t.Parallel()
	l, pool, h, key, resp := heldCall(t)
	// Another attempt's answer, in a transaction not committed yet: RecordHeld's write
	// of the held answer waits on its row lock.
	other, err := pool.Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Exec(ctxT(t), `UPDATE llm_calls SET state = 'succeeded', attempt = 2, owner = NULL, lease_until = NULL,
	response = '{"content": "another attempt''s answer"}', response_raw = 'other' WHERE idem_key = $1`, key); err != nil {
		_ = other.Rollback(context.Background())
		t.Fatal(err)
	}
	recorded := make(chan error, 1)
	go func() { recorded <- l.RecordHeld(ctxT(t), h) }()
	testenv.WaitFor(t, 10*time.Second, "RecordHeld waiting on the row", func() bool {
		var n int
		_ = pool.QueryRow(ctxT(t), `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO llm_calls%'`).Scan(&n)
		return n > 0
	})
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(300 * time.Millisecond) // Queue runs meanwhile
		_ = other.Commit(context.Background())
	}()
	defer func() { <-released }()
	table := sideTable(t, pool)
	b := &pgx.Batch{}
	keys, qerr := h.Queue(b)
	if qerr == nil {
		b.Queue(`INSERT INTO `+table+` VALUES ($1)`, resp.Content)
		qerr = pool.SendBatch(ctxT(t), b).Close()
	}
	var sup *ledger.SupersededError
	if err := <-recorded; !errors.As(err, &sup) {
		t.Fatalf("RecordHeld: %v; want a SupersededError for %s", err, key)
	}
	var n int
	if err := pool.QueryRow(ctxT(t), `SELECT count(*) FROM `+table).Scan(&n); err != nil || n != 0 {
		t.Fatalf("Queue beside the RecordHeld: %d keys, %v; the caller's rows committed: %d (%v), want 0", len(keys), qerr, n, err)
	}
	if !errors.As(qerr, &sup) {
		t.Errorf("Queue beside the RecordHeld: %v; want its SupersededError", qerr)
	}
}

// RecordHeldDurably with nothing held to record (another RecordHeld recorded it) still
// makes the answers recorded without a flush durable: one write, nothing pending after.
// With an answer held, its own durable write covers them: no write besides it.
func TestRecordHeldDurablyFlushesTheDeferredAnswersWhenItRecordsNothing(t *testing.T) {
	t.Parallel()
	flushes := &roundtrip.Commits{Only: func(sql string) bool { return strings.Contains(sql, "updated_at = updated_at") }}
	l, _ := tracedLedger(t, ledger.Config{GroupLinger: -1}, flushes)
	ctx := ctxT(t)
	var d ledger.Deferred
	att, _, err := l.Begin(ctx, callOf("job-1/a", request("a")))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := att.Succeed(ledger.DeferFlush(ctx, &d), ledger.ResultOf(&llm.Response{Content: "a"})); err != nil {
		t.Fatal(err)
	}
	var h ledger.Held
	flushes.Reset()
	if err := l.RecordHeldDurably(ctx, &h, &d); err != nil || d.Pending() || flushes.Durable() != 1 {
		t.Fatalf("RecordHeldDurably with nothing held: %v, pending after: %v, %d flushes; want one flush and nothing pending", err, d.Pending(), flushes.Durable())
	}

	// An answer held: its durable write is the flush.
	att2, _, err := l.Begin(ctx, callOf("job-1/c", request("c")))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := att2.Succeed(ledger.DeferFlush(ctx, &d), ledger.ResultOf(&llm.Response{Content: "c"})); err != nil {
		t.Fatal(err)
	}
	_, adapter := fakeLLM(t, fakeserver.Config{})
	req := request("Summarise the refund policy")
	req.IdempotencyKey = "job-1:d"
	if _, err := l.Wrap("openai", adapter).Complete(ledger.HoldAnswers(ctx, &h), req); err != nil {
		t.Fatal(err)
	}
	flushes.Reset()
	if err := l.RecordHeldDurably(ctx, &h, &d); err != nil || d.Pending() || h.Pending() || flushes.Durable() != 0 {
		t.Fatalf("RecordHeldDurably of a held answer: %v, deferred pending after: %v, held pending: %v, %d flushes; want none besides its durable write", err, d.Pending(), h.Pending(), flushes.Durable())
	}
}
