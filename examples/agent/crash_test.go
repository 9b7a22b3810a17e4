package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
)

// Crash tests: the program is a real process killed with SIGKILL (kill -9) at the
// hazard's moment and started again. Each counts the effects: refunds (distinct keys
// at the payments API, which honours Idempotency-Key), emails, replies rows, model
// calls and order reads.

// stop ends an agent process gracefully.
func stop(t *testing.T, p *onceflowtest.Process) {
	t.Helper()
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(20 * time.Second); code != 0 {
		t.Errorf("agent exited %d", code)
	}
}

// The orders API answers with an updated_at that changes at every read. The process
// is killed after the refund reached the payments API and before its answer (so before
// the tool's result is recorded and before the commit). The next process replays the
// model's two turns from the ledger and the order's first read from its record (a
// second read would change the next turn's request), calls the payments API again with
// the same key (its first answer comes back), asks the model its last turn and commits:
// one read, three model calls, one refund key, one reply row, one email.
func TestRestartAfterTheRefundReplaysTheChangingReadAndRefundsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	w := newWorld(t, fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsRandom}, "A-17", 1299)
	redisURL, prefix, db, dsn := stores(t)
	env := w.processEnv(redisURL, prefix, dsn)

	w.payments.SetLatency(time.Hour) // the refund is recorded on arrival; its answer never comes
	a, api := startProcess(t, env)
	id := post(t, api, "support-0101-crash-refund", "A-17")
	onceflowtest.WaitFor(t, 20*time.Second, "the refund at the payments API", func() bool { return w.payments.Total() == 1 })
	a.Kill()
	w.payments.SetLatency(0)
	if n := onceflowtest.Count(t, db, `SELECT count(*) FROM replies`) + w.mail.Total(); n != 0 {
		t.Fatalf("%d replies or emails before the kill, want none", n)
	}

	b, api := startProcess(t, env)
	st := waitDone(t, api, w, id)
	stop(t, b)
	requireOneReply(t, db, w, id, st)
	if keys := w.payments.Keys(); len(keys) != 1 || w.payments.Total() != 2 {
		t.Fatalf("payments got %d POSTs with keys %v; want the refund twice under its one key", w.payments.Total(), keys)
	}
	if reads, calls := w.reads.Load(), w.model.Requests(); reads != 1 || calls != 3 {
		t.Fatalf("%d order reads, %d model calls; want 1 (recorded) and 3 (two replayed by the ledger)", reads, calls)
	}
	if r := w.lastToolResult(); !strings.Contains(r, `"status":"succeeded"`) {
		t.Fatalf("the model read %q as the refund's result, want the payments API's first answer", r)
	}
}

// The provider gives every answer new tool-call ids, and the ledger's rows are lost
// (DELETE FROM llm_calls while the process is down, as an early purge or a restore
// would lose them). The next process asks the model every turn again and gets new ids,
// but a call's key is its content's: the recorded read is found, and the refund keeps
// its key. Killed while the model generates its last turn (the refund recorded), the
// payments API is not called again; killed after the refund reached it and before its
// answer, it is called again with the same key. Either way one read, one refund key,
// the same stable ids in both deliveries' conversations, one reply row, one email.
func TestNewToolCallIDsAndLostLedgerRowsStillRefundOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		answered   bool // the refund's answer came, and was recorded, before the kill
		turns      int  // llm_calls rows at the kill
		posts      int  // refund POSTs in all
		modelCalls int
	}{
		{"killed while the last turn is asked", true, 3, 1, 6},
		{"killed before the refund's answer", false, 2, 2, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w := newWorld(t, fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsRandom}, "A-18", 1299)
			if tc.answered {
				w.payments.SetAnswer(func(key string, body []byte) []byte {
					w.model.Hold() // the last turn's request waits: the kill comes while it is asked
					return []byte(`{"refund_id":"re_1","status":"succeeded"}`)
				})
			} else {
				w.payments.SetLatency(time.Hour) // the refund is recorded on arrival; its answer never comes
			}
			redisURL, prefix, db, dsn := stores(t)
			env := w.processEnv(redisURL, prefix, dsn)

			a, api := startProcess(t, env)
			id := post(t, api, "support-0201-crash-ids", "A-18")
			onceflowtest.WaitFor(t, 20*time.Second, "the kill's moment", func() bool {
				return w.payments.Total() == 1 && (!tc.answered || w.model.Requests() == 3)
			})
			recorded := 0
			if tc.answered {
				recorded = 1
			}
			if n := onceflowtest.Count(t, db, `SELECT count(*) FROM job_steps WHERE job_id = $1 AND tool = 'issue_refund'`, id); n != recorded {
				t.Fatalf("%d recorded refunds before the kill, want %d", n, recorded)
			}
			a.Kill()
			w.model.Release()
			w.payments.SetLatency(0)
			if n := onceflowtest.Count(t, db, `WITH d AS (DELETE FROM llm_calls RETURNING 1) SELECT count(*) FROM d`); n != tc.turns {
				t.Fatalf("deleted %d llm_calls rows, want the %d turns'", n, tc.turns)
			}

			b, api := startProcess(t, env)
			st := waitDone(t, api, w, id)
			stop(t, b)
			requireOneReply(t, db, w, id, st)
			if keys := w.payments.Keys(); len(keys) != 1 || w.payments.Total() != tc.posts {
				t.Fatalf("payments got %d POSTs with keys %v; want %d under one key", w.payments.Total(), keys, tc.posts)
			}
			if reads, calls := w.reads.Load(), w.model.Requests(); reads != 1 || calls != tc.modelCalls {
				t.Fatalf("%d order reads, %d model calls; want 1 (recorded) and %d (every turn asked again)", reads, calls, tc.modelCalls)
			}
			if ids := w.toolCallIDs(); len(ids) != 2 || ids[0] != ids[1] {
				t.Fatalf("the two deliveries' second turns name the lookup's call %v, want one stable id", ids)
			}
		})
	}
}

// A refund above the threshold waits for an operator; the process is killed while the
// job waits and started again; an operator decides through the program's route. The
// model asked three times (the first two replayed, the third after the decision), one
// reply row and one email; approved, one refund; rejected, none, and the model reads
// the rejection with the operator's note as the tool's result.
func TestApprovalAcrossAKill(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		decision string
		refunds  int
	}{{"approve", 1}, {"reject", 0}} {
		t.Run(tc.decision, func(t *testing.T) {
			t.Parallel()
			w := newWorld(t, fakeserver.Config{}, "B-"+tc.decision, 25000)
			redisURL, prefix, db, dsn := stores(t)
			env := w.processEnv(redisURL, prefix, dsn)

			a, api := startProcess(t, env)
			id := post(t, api, "support-0301-approval-"+tc.decision, "B-"+tc.decision)
			var pending struct{ Approvals []onceflow.Approval }
			onceflowtest.WaitFor(t, 20*time.Second, "the refund waiting for a decision", func() bool {
				var st jobState
				return do(t, http.MethodGet, api+"/v1/approvals", "admin", "", "", &pending) == http.StatusOK && len(pending.Approvals) == 1 &&
					do(t, http.MethodGet, api+"/v1/jobs/"+id, "secret", "", "", &st) == http.StatusOK && st.Status == "queued"
			})
			a.Kill()
			call := pending.Approvals[0]
			if call.JobID != id || call.Tool != "issue_refund" || w.payments.Total() != 0 {
				t.Fatalf("waiting: %+v, %d refunds; want job %s's issue_refund and no refund yet", call, w.payments.Total(), id)
			}

			b, api := startProcess(t, env)
			decide := api + "/v1/jobs/" + id + "/approvals/" + call.Key + "/" + tc.decision
			if code := do(t, http.MethodPost, decide, "secret", "", "", nil); code != http.StatusUnauthorized {
				t.Fatalf("a customer's key decides: %d, want 401", code)
			}
			if code := do(t, http.MethodPost, decide, "admin", "", `{"by":"ops@example.com","note":"checked the order"}`, nil); code != http.StatusOK {
				t.Fatalf("POST %s: %d", tc.decision, code)
			}
			st := waitDone(t, api, w, id)
			// The same decision again is a retry, answered as the first; the other one
			// is refused: the call is decided once.
			if code := do(t, http.MethodPost, decide, "admin", "", "", nil); code != http.StatusOK {
				t.Fatalf("deciding the same again: %d, want 200 (a retry)", code)
			}
			other := map[string]string{"approve": "reject", "reject": "approve"}[tc.decision]
			if code := do(t, http.MethodPost, strings.TrimSuffix(decide, tc.decision)+other, "admin", "", "", nil); code != http.StatusConflict {
				t.Fatalf("deciding the other way: %d, want 409", code)
			}
			stop(t, b)
			requireOneReply(t, db, w, id, st)
			w.payments.RequireOncePerKey(t, tc.refunds)
			if calls := w.model.Requests(); calls != 3 {
				t.Fatalf("%d model calls, want 3", calls)
			}
			result := w.lastToolResult()
			switch tc.decision {
			case "approve":
				if w.payments.Keys()[0] != call.Key || !strings.Contains(result, `"status":"succeeded"`) {
					t.Fatalf("refund keyed %s, the model read %q; want the approved call's key %s and the payments API's answer", w.payments.Keys()[0], result, call.Key)
				}
			case "reject":
				if want := "rejected: the operator did not approve this call: checked the order"; result != want {
					t.Fatalf("the model read %q, want %q", result, want)
				}
			}
		})
	}
}

// An SSE client reads the job's events while the model streams its last turn slowly;
// the process is killed mid-stream, after the client got part of the text, and started
// again; the client reconnects to it with Last-Event-ID. It gets each event once: a
// restart (the dead attempt's text is to be dropped), the new attempt's text, the end
// with status done. The text after the restart is the reply committed and emailed.
func TestEventsResumeAcrossAKillWithoutRepeats(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts processes: make test-long runs it (go test without -short)")
	}
	t.Parallel()
	w := newWorld(t, fakeserver.Config{DripInterval: time.Millisecond}, "C-3", 1299)
	w.model.Server.Script(fakeserver.Fault{}, fakeserver.Fault{}, fakeserver.Fault{Kind: fakeserver.FaultDrip}) // the last turn, a byte a millisecond
	redisURL, prefix, db, dsn := stores(t)
	env := w.processEnv(redisURL, prefix, dsn)

	a, api := startProcess(t, env)
	id := post(t, api, "support-0401-crash-events", "C-3")
	killed := false
	first := readEvents(t, api+"/v1/jobs/"+id+"/events", "", func(ev sseEvent) {
		if ev.event == "text" && !killed {
			a.Kill() // the connection breaks with the process
			killed = true
		}
	})
	if !killed || first[len(first)-1].event != "text" {
		t.Fatalf("first connection: %v, want it broken by the kill after some text", first)
	}

	b, api := startProcess(t, env)
	second := readEvents(t, api+"/v1/jobs/"+id+"/events", first[len(first)-1].id, nil)
	st := waitDone(t, api, w, id)
	stop(t, b)
	events := append(first, second...)
	seen := map[string]bool{}
	var kinds []string
	for _, ev := range events {
		if seen[ev.id] {
			t.Errorf("event id %s seen twice", ev.id)
		}
		seen[ev.id] = true
		kinds = append(kinds, ev.event)
	}
	last := events[len(events)-1]
	var end struct{ Status string }
	if last.event != "end" || json.Unmarshal([]byte(last.data), &end) != nil || end.Status != "done" {
		t.Fatalf("the stream ends with %+v, want end with status done; events %v", last, kinds)
	}
	restart := -1
	for i, ev := range events {
		if ev.event == "restart" {
			restart = i
		}
	}
	if restart < 0 {
		t.Fatalf("events %v: no restart after the kill", kinds)
	}
	var text strings.Builder
	for _, ev := range events[restart+1:] {
		var d struct{ Text string }
		if ev.event == "text" && json.Unmarshal([]byte(ev.data), &d) == nil {
			text.WriteString(d.Text)
		}
	}
	if text.String() != st.Result.Reply {
		t.Fatalf("text after the restart %q, want the reply %q", text.String(), st.Result.Reply)
	}
	requireOneReply(t, db, w, id, st)
	w.payments.RequireOncePerKey(t, 1)
	if reads, calls := w.reads.Load(), w.model.Requests(); reads != 1 || calls != 4 {
		t.Fatalf("%d order reads, %d model calls; want 1 and 4 (the last turn asked again)", reads, calls)
	}
}
