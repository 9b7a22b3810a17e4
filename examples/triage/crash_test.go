package main

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm/toolkey"
	"github.com/onceflow/onceflow/onceflowtest"
)

// Crash tests: the program is a real process killed with SIGKILL, or a delivery fails
// where a crash would stop it. Each counts the effects.

// stop ends a triage process gracefully.
func stop(t *testing.T, p *onceflowtest.Process) {
	t.Helper()
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(30 * time.Second); code != 0 {
		t.Errorf("triage exited %d", code)
	}
}

// The worker commits the ticket, refund and reply with their effects and is killed
// (kill -9) before its acknowledgement: the entry stays pending; the next process
// reclaims it, gets the model's answer from the ledger and finds the job committed. One
// model call, one row of each, one refund and one email.
//
// To put the kill between the commit and the acknowledgement without racing, the
// process runs on a Redis of the test's own whose writes the test pauses while the
// model holds the answer: the worker then commits to PostgreSQL and blocks on its
// acknowledgement. Its relay cannot reach the receivers, so nothing is sent before the
// kill (its failed sends are retried by the next process).
func TestWorkerKilledBetweenCommitAndAck(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	s := newStores(t)
	r := onceflowtest.PrivateRedis(t)
	db, dsn := onceflowtest.Postgres(t, *Workflow(Options{}).Migrations)
	env := s.processEnv(r.URL, "onceflow", dsn)
	unreachable := append(env[:len(env):len(env)], "PAYMENTS_URL=http://127.0.0.1:1", "MAILER_URL=http://127.0.0.1:1")

	s.model.Hold()
	a, api := startProcess(t, unreachable)
	if code, _ := post(t, api, "ticket-crash-commit-ack", refundTicket); code != http.StatusAccepted {
		t.Fatalf("POST: %d", code)
	}
	s.model.WaitRequests(t, 1, 20*time.Second)
	resume := r.PauseWrites(t)
	s.model.Release()
	onceflowtest.WaitFor(t, 20*time.Second, "the commit", func() bool { return onceflowtest.Count(t, db, `SELECT count(*) FROM tickets`) == 1 })
	a.Kill() // its acknowledgement waits for the paused Redis
	resume()
	if n := onceflowtest.Pending(t, r.Client, "onceflow", "triage"); n != 1 {
		t.Fatalf("%d pending after the kill, want the job unacknowledged", n)
	}

	b, _ := startProcess(t, env)
	onceflowtest.WaitFor(t, 30*time.Second, "the reclaim and the effects", func() bool {
		return onceflowtest.Pending(t, r.Client, "onceflow", "triage") == 0 && s.payments.Total() == 1 && s.mail.Total() == 1
	})
	stop(t, b)
	if got, calls := rows(t, db), s.model.Requests(); got != [4]int{1, 1, 1, 2} || calls != 1 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and 1 (the ledger replayed the answer)", got, calls)
	}
	s.payments.RequireOncePerKey(t, 1)
	s.mail.RequireOncePerKey(t, 1)
}

// The relay delivers the refund and is killed (kill -9) before recording it: after its
// lease the next process's relay sends it again with the same key, the tool-call key,
// so a payments API that honours Idempotency-Key refunds once. One model call, one row
// of each, one refund key, one email key.
func TestRelayKilledBetweenSendAndMark(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	s := newStores(t)
	_, prefix := onceflowtest.Redis(t)
	db, dsn := onceflowtest.Postgres(t, *Workflow(Options{}).Migrations)
	env := s.processEnv(onceflowtest.RedisURL(t), prefix, dsn)

	s.payments.SetLatency(time.Hour) // the refund is recorded on arrival; the answer never comes
	a, api := startProcess(t, env)
	if code, _ := post(t, api, "ticket-crash-relay-mark", refundTicket); code != http.StatusAccepted {
		t.Fatalf("POST: %d", code)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the refund's first delivery", func() bool { return s.payments.Total() == 1 })
	a.Kill()
	s.payments.SetLatency(0)
	if n := onceflowtest.SentOutboxRows(t, db, "payments.refund"); n != 0 {
		t.Fatalf("%d refunds marked sent before the kill, want 0", n)
	}

	b, _ := startProcess(t, env)
	onceflowtest.WaitFor(t, 30*time.Second, "the refund sent again after the lease", func() bool {
		return onceflowtest.SentOutboxRows(t, db, "") == 2
	})
	stop(t, b)
	if got, calls := rows(t, db), s.model.Requests(); got != [4]int{1, 1, 1, 2} || calls != 1 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and 1", got, calls)
	}
	keys := s.payments.Keys()
	if s.payments.Total() != 2 || len(keys) != 1 || s.payments.Count(keys[0]) != 2 || onceflowtest.Count(t, db, `SELECT count(*) FROM refunds WHERE refund_key = $1`, keys[0]) != 1 {
		t.Fatalf("payments received %d POSTs with keys %v; want the refund twice, with its one tool-call key", s.payments.Total(), keys)
	}
	if len(s.mail.Keys()) != 1 || s.mail.Total() > 2 {
		t.Fatalf("mailer received %d POSTs with keys %v; want one email key (sent at most twice: it was in the killed batch)", s.mail.Total(), s.mail.Keys())
	}
}

// A delivery gets the model's answer (issue_refund) and fails before its commit (a
// trigger refuses the first ticket insert, as a crash would stop it there); the next
// delivery commits. When the ledger holds the answer, it is replayed: one model call.
// When the record was lost (deleted, as a purge or a failed write would lose it), the
// request is made again and the fake model answers the same call with a new id (as
// providers do): two model calls, detected as an unstable id, and still one refund,
// keyed by the first id seen: the key the payments API saw first.
func TestRetriedModelRequestKeepsTheToolKey(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		loseRecord bool
		calls      int
		unstable   float64
	}{{"ledger replays", false, 1, 0}, {"record lost, new id", true, 2, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newStores(t)
			var db atomic.Pointer[pgxpool.Pool]
			loseRecord := func(next onceflow.JobFunc) onceflow.JobFunc {
				return func(ctx context.Context, info *onceflow.JobInfo) error {
					err := next(ctx, info)
					if err != nil && tc.loseRecord && info.Delivery == 1 {
						if _, err := db.Load().Exec(ctx, `DELETE FROM llm_calls`); err != nil {
							t.Error(err)
						}
					}
					return err
				}
			}
			reg := prometheus.NewRegistry()
			env, api := s.inProcess(t, onceflow.Config{Middleware: []onceflow.Middleware{loseRecord}, Registerer: reg})
			db.Store(env.DB)
			if _, err := env.DB.Exec(context.Background(), `
				CREATE SEQUENCE crash_once;
				CREATE FUNCTION crash_once() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					IF nextval('crash_once') = 1 THEN RAISE EXCEPTION 'injected crash before the commit'; END IF;
					RETURN NEW;
				END $$;
				CREATE TRIGGER crash_once BEFORE INSERT ON tickets FOR EACH ROW EXECUTE FUNCTION crash_once();`); err != nil {
				t.Fatal(err)
			}
			if code, _ := post(t, api.URL, "ticket-retried-model-call", refundTicket); code != http.StatusAccepted {
				t.Fatalf("POST: %d", code)
			}
			onceflowtest.WaitFor(t, 30*time.Second, "the refund and the email", func() bool { return s.payments.Total() == 1 && s.mail.Total() == 1 })
			if n := onceflowtest.Count(t, env.DB, `SELECT last_value FROM crash_once`); n != 2 {
				t.Fatalf("the ticket insert ran %d times, want 2 (the first refused)", n)
			}
			if got, calls := rows(t, env.DB), s.model.Requests(); got != [4]int{1, 1, 1, 2} || calls != tc.calls {
				t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and %d", got, calls, tc.calls)
			}
			s.payments.RequireOncePerKey(t, 1)
			s.mail.RequireOncePerKey(t, 1)
			var requestKey, firstID string
			if err := env.DB.QueryRow(context.Background(), `SELECT request_key, call_id FROM llm_tool_calls`).Scan(&requestKey, &firstID); err != nil {
				t.Fatal(err)
			}
			if key := s.payments.Keys()[0]; key != toolkey.IDKey(requestKey, firstID) {
				t.Fatalf("refund keyed %s, want the key of the first id seen, %s", key, toolkey.IDKey(requestKey, firstID))
			}
			if got := counter(t, reg, "onceflow_llm_tool_call_ids_total", "stability", "unstable"); got != tc.unstable {
				t.Fatalf("%v tool calls seen with a changed id, want %v", got, tc.unstable)
			}
		})
	}
}

// heldRun is a triage process holding refunds over 10.00, with a refund ticket it
// holds.
type heldRun struct {
	s      *stores
	rdb    *redis.Client
	prefix string
	db     *pgxpool.Pool
	env    []string
	p      *onceflowtest.Process
	api    string
	id     string
}

// startHeld starts a triage process on stores of the test's own, posts a refund ticket
// under idempotency key key and waits until the gate holds it.
func startHeld(t *testing.T, key string) (*heldRun, onceflow.Held) {
	t.Helper()
	r := &heldRun{s: newStores(t)}
	r.s.holdOver = 1000
	r.rdb, r.prefix = onceflowtest.Redis(t)
	var dsn string
	r.db, dsn = onceflowtest.Postgres(t, *Workflow(Options{}).Migrations)
	r.env = r.s.processEnv(onceflowtest.RedisURL(t), r.prefix, dsn)
	r.p, r.api = startProcess(t, r.env)
	code, id := post(t, r.api, key, refundTicket)
	if code != http.StatusAccepted {
		t.Fatalf("POST: %d", code)
	}
	r.id = id
	return r, waitHeld(t, r.api, id)
}

// A refund over the limit holds its ticket; the program is killed (kill -9) while the
// ticket is held and started again: the ticket is still held, nothing written or sent.
// Released on the new process, it goes on with the held answer: one model call (the
// ledger replays it), one row of each, one refund key, one email. A second release is a
// retry (200) and a rejection after it 409: no second effect.
func TestHeldTicketKilledWhileHeldThenReleasedSendsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	run, _ := startHeld(t, "ticket-crash-held")
	s, db, env, id := run.s, run.db, run.env, run.id
	run.p.Kill()
	if got, calls := rows(t, db), s.model.Requests(); got != [4]int{} || calls != 1 || s.payments.Total()+s.mail.Total() != 0 {
		t.Fatalf("held, killed: rows %v, %d model calls, %d deliveries; want none, 1, 0", got, calls, s.payments.Total()+s.mail.Total())
	}

	b, api := startProcess(t, env)
	if code, st := ticketState(t, api, id); code != http.StatusOK || st.Status != onceflow.StatusHeld {
		t.Fatalf("GET after the restart: %d %q, want held", code, st.Status)
	}
	h := waitHeld(t, api, id)
	if code, got := decide(t, api, id, "release", h.Key, "checked with the customer"); code != http.StatusOK || got != "released" {
		t.Fatalf("release: %d %q", code, got)
	}
	onceflowtest.WaitFor(t, 30*time.Second, "the ticket done, its refund and reply sent", func() bool {
		_, st := ticketState(t, api, id)
		return st.Status == onceflow.StatusDone && s.payments.Total() == 1 && s.mail.Total() == 1
	})
	if code, got := decide(t, api, id, "release", h.Key, "checked with the customer"); code != http.StatusOK || got != "released" {
		t.Fatalf("the same release again: %d %q, want 200 (a retry)", code, got)
	}
	if code, _ := decide(t, api, id, "reject", h.Key, ""); code != http.StatusConflict {
		t.Fatalf("reject after the release: %d, want 409", code)
	}
	stop(t, b)
	if got, calls := rows(t, db), s.model.Requests(); got != [4]int{1, 1, 1, 2} || calls != 1 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and 1 (the ledger replayed the answer)", got, calls)
	}
	s.payments.RequireOncePerKey(t, 1)
	s.mail.RequireOncePerKey(t, 1)
	if k := s.payments.Keys()[0]; onceflowtest.Count(t, db, `SELECT count(*) FROM refunds WHERE refund_key = $1`, k) != 1 {
		t.Fatalf("the payments key %s is not the refund row's tool-call key", k)
	}
}

// A held ticket an operator rejects is dead-lettered with the gate's reason and the
// operator's note: nothing written or sent. The program is then killed (kill -9) and
// started again: still failed, and nothing of it is sent, while a question posted after
// the restart gets its reply (the new process works and relays).
func TestRejectedTicketSendsNothingAcrossAKill(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	run, h := startHeld(t, "ticket-crash-rejected")
	s, db, env, a, api, id := run.s, run.db, run.env, run.p, run.api, run.id
	if code, got := decide(t, api, id, "reject", h.Key, "refund policy: replacement only"); code != http.StatusOK || got != "rejected" {
		t.Fatalf("reject: %d %q", code, got)
	}
	failed := func(api string) bool {
		_, st := ticketState(t, api, id)
		return st.Status == onceflow.StatusFailed && strings.Contains(st.Error, "eval gate") &&
			strings.Contains(st.Error, "over the limit of 1000") && strings.Contains(st.Error, "replacement only")
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the ticket dead-lettered with the gate's reason", func() bool { return failed(api) })
	a.Kill()
	if got := rows(t, db); got != [4]int{} || s.payments.Total()+s.mail.Total() != 0 {
		t.Fatalf("rejected: rows %v, %d deliveries; want none", got, s.payments.Total()+s.mail.Total())
	}

	b, api := startProcess(t, env)
	if !failed(api) {
		t.Fatal("after the restart the rejected ticket is no longer failed with its reason")
	}
	if code, _ := decide(t, api, id, "release", h.Key, ""); code != http.StatusConflict {
		t.Fatalf("release after the rejection: %d, want 409", code)
	}
	question := Ticket{Customer: "bob@example.com", OrderID: "B-2", Message: "When does my parcel arrive?"}
	_, qid := post(t, api, "ticket-crash-after-reject", question)
	onceflowtest.WaitFor(t, 30*time.Second, "the question's reply", func() bool { return s.mail.Total() == 1 })
	stop(t, b)
	if got, calls := rows(t, db), s.model.Requests(); got != [4]int{1, 0, 1, 1} || calls != 2 || s.payments.Total() != 0 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls, %d refunds sent; want [1 0 1 1] (the question's), 2, 0",
			got, calls, s.payments.Total())
	}
	if keys := s.mail.Keys(); len(keys) != 1 || keys[0] != "reply:"+qid {
		t.Fatalf("emails keyed %v, want the question's reply only", keys)
	}
}

// An operator releases a held ticket; the woken job replays the answer, passes the
// gate with the release and is killed (kill -9) inside its commit, before it
// committed: nothing written or sent. The next process reclaims the job and commits it
// once with the recorded release: one model call, one row of each, one refund, one
// email.
//
// To put the kill inside the commit without racing, the test holds an exclusive lock
// on the refunds table, which the commit reads first, and kills the process once its
// commit waits for the lock.
func TestReleasedTicketKilledInItsCommitSendsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	run, h := startHeld(t, "ticket-crash-released")
	s, r, prefix, db, env, a, api, id := run.s, run.rdb, run.prefix, run.db, run.env, run.p, run.api, run.id
	ctx := context.Background()
	lock, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }() // for a failure before the rollback below
	if _, err := lock.Exec(ctx, `LOCK TABLE refunds IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	if code, got := decide(t, api, id, "release", h.Key, ""); code != http.StatusOK || got != "released" {
		t.Fatalf("release: %d %q", code, got)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the released job's commit waiting for the lock", func() bool {
		return onceflowtest.Count(t, db, `SELECT count(*) FROM pg_locks WHERE relation = 'refunds'::regclass AND NOT granted`) == 1
	})
	a.Kill()
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := rows(t, db); got != [4]int{} || s.payments.Total()+s.mail.Total() != 0 {
		t.Fatalf("killed in the commit: rows %v, %d deliveries; want none", got, s.payments.Total()+s.mail.Total())
	}
	if n := onceflowtest.Pending(t, r, prefix, "triage"); n != 1 {
		t.Fatalf("%d pending after the kill, want the released job unacknowledged", n)
	}

	b, api := startProcess(t, env)
	onceflowtest.WaitFor(t, 30*time.Second, "the reclaim and the effects", func() bool {
		_, st := ticketState(t, api, id)
		return st.Status == onceflow.StatusDone && s.payments.Total() == 1 && s.mail.Total() == 1
	})
	if held := heldTickets(t, api); len(held) != 0 {
		t.Fatalf("held again after the release: %+v", held)
	}
	stop(t, b)
	if got, calls := rows(t, db), s.model.Requests(); got != [4]int{1, 1, 1, 2} || calls != 1 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and 1", got, calls)
	}
	s.payments.RequireOncePerKey(t, 1)
	s.mail.RequireOncePerKey(t, 1)
}

// counter returns the value of the counter name whose label has value (0 when absent).
func counter(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
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
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
