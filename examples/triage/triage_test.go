package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// Every test counts effects: model requests (the fake model), rows (tickets, refunds,
// replies, outbox), and POSTs with their keys (the payments and mailer sinks).

var orderRE = regexp.MustCompile(`^Order (\S+)\.`)

// refundWhenAsked is the fake model's agent: it calls issue_refund(order, 1299) when
// the customer wants their money back, and answers in text otherwise.
func refundWhenAsked(req *llm.Request) (string, json.RawMessage, bool) {
	p := fake.Prompt(req.Messages)
	m := orderRE.FindStringSubmatch(p)
	if m == nil || !strings.Contains(p, "money back") {
		return "", nil, false
	}
	return "issue_refund", json.RawMessage(fmt.Sprintf(`{"order_id": %q, "amount_cents": 1299}`, m[1])), true
}

// stores are one test's fake model, receivers and database schema.
type stores struct {
	model          *onceflowtest.FakeLLM
	payments, mail *onceflowtest.Sink
}

func newStores(t *testing.T) *stores {
	return &stores{model: onceflowtest.NewFakeLLM(t, fakeserver.Config{ToolChoice: refundWhenAsked}),
		payments: onceflowtest.NewSink(t), mail: onceflowtest.NewSink(t)}
}

func tenant(*http.Request) (string, error) { return "acme", nil }

// inProcess runs the workflow in the test's process with cfg's extras (Middleware,
// Registerer) and returns its environment and API.
func (s *stores) inProcess(t *testing.T, cfg onceflow.Config) (*onceflowtest.Env, *httptest.Server) {
	cfg.Model, cfg.Provider = s.model.Client(), "openai"
	cfg.Workflows = []onceflow.Workflow{Workflow(Options{Tenant: tenant, Queue: onceflow.QueueConfig{ClaimIdle: 300 * time.Millisecond},
		Payments: s.payments.Sender(t, webhook.PayloadOnly), Mailer: s.mail.Sender(t, webhook.PayloadOnly)})}
	env := onceflowtest.New(t, cfg)
	mux := http.NewServeMux()
	if err := env.Client.Mount(mux); err != nil {
		t.Fatal(err)
	}
	api := httptest.NewServer(mux)
	t.Cleanup(api.Close)
	env.Start()
	return env, api
}

// processEnv is the environment of the triage program on the given stores.
func (s *stores) processEnv(redisURL, prefix, dsn string) []string {
	return []string{"ONCEFLOW_REDIS_URL=" + redisURL, "ONCEFLOW_PREFIX=" + prefix, "ONCEFLOW_DATABASE_URL=" + dsn,
		"OPENAI_BASE_URL=" + s.model.URL + "/v1", "OPENAI_API_KEY=test", "TRIAGE_API_KEYS=secret=acme", "TRIAGE_ADDR=127.0.0.1:0",
		"PAYMENTS_URL=" + s.payments.URL, "MAILER_URL=" + s.mail.URL, "ONCEFLOW_CLAIM_IDLE=1s", "ONCEFLOW_RELAY_LEASE=2s"}
}

// startProcess runs the triage program and returns it with its API's URL.
func startProcess(t *testing.T, env []string) (*onceflowtest.Process, string) {
	p := onceflowtest.Start(t, onceflowtest.Build(t, "."), env)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return p, "http://" + p.WaitLog(ctx, "triage listening")["addr"].(string)
}

// post sends a ticket with an Idempotency-Key and returns the status and job id.
func post(t *testing.T, api, key string, tk Ticket) (int, string) {
	t.Helper()
	body, _ := json.Marshal(tk)
	req, _ := http.NewRequest(http.MethodPost, api+"/v1/tickets", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer secret")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		JobID string `json:"job_id"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out.JobID
}

var refundTicket = Ticket{Customer: "ann@example.com", OrderID: "A-17", Message: "It arrived broken; I want my money back."}

// rows counts the workflow's rows: tickets, refunds, replies, outbox.
func rows(t *testing.T, db *pgxpool.Pool) [4]int {
	t.Helper()
	count := func(sql string) int { return onceflowtest.Count(t, db, sql) }
	return [4]int{count(`SELECT count(*) FROM tickets`), count(`SELECT count(*) FROM refunds`),
		count(`SELECT count(*) FROM replies`), onceflowtest.OutboxRows(t, db, "")}
}

// Both branches of the agent, and a retried POST: a refund ticket posted twice is one
// job, one model call, one refund and one email; a question gets an email and no
// refund.
func TestRefundAndQuestionTickets(t *testing.T) {
	t.Parallel()
	s := newStores(t)
	env, api := s.inProcess(t, onceflow.Config{})
	code, id := post(t, api.URL, "ticket-0001-refund", refundTicket)
	code2, id2 := post(t, api.URL, "ticket-0001-refund", refundTicket)
	if code != http.StatusAccepted || code2 != http.StatusAccepted || id != id2 {
		t.Fatalf("POST twice: %d %s, %d %s; want 202 and the same job", code, id, code2, id2)
	}
	question := Ticket{Customer: "bob@example.com", OrderID: "B-2", Message: "When does my parcel arrive?"}
	if code, _ := post(t, api.URL, "ticket-0002-question", question); code != http.StatusAccepted {
		t.Fatalf("POST question: %d", code)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "two replies", func() bool { return s.mail.Total() == 2 && s.payments.Total() == 1 })
	s.payments.RequireOncePerKey(t, 1)
	s.mail.RequireOncePerKey(t, 2)
	if got := rows(t, env.DB); got != [4]int{2, 1, 2, 3} || s.model.Requests() != 2 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [2 1 2 3] and 2", got, s.model.Requests())
	}
	var refund Refund
	if err := json.Unmarshal(s.payments.Deliveries()[0].Body, &refund); err != nil || refund != (Refund{OrderID: "A-17", AmountCents: 1299}) {
		t.Fatalf("payments received %s, want the refund of A-17", s.payments.Deliveries()[0].Body)
	}
	if k := s.payments.Keys()[0]; env.Count(`SELECT count(*) FROM refunds WHERE refund_key = $1`, k) != 1 {
		t.Fatalf("the payments key %s is not the refund row's tool-call key", k)
	}
}

// The route refuses what it must (no bearer token, a bad body) with nothing enqueued,
// and GET reports a done ticket with its result.
func TestTicketRouteRefusesAndReportsState(t *testing.T) {
	t.Parallel()
	s := newStores(t)
	env, api := s.inProcess(t, onceflow.Config{})
	bad := Ticket{Customer: "not-an-address", OrderID: "A-17", Message: "Money back."}
	if code, _ := post(t, api.URL, "ticket-0003-invalid", bad); code != http.StatusBadRequest {
		t.Fatalf("POST with an invalid customer: %d, want 400", code)
	}
	req, _ := http.NewRequest(http.MethodPost, api.URL+"/v1/tickets", strings.NewReader(`{"customer":"a@example.com","order_id":"A","message":"m","extra":1}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "ticket-0004-unknown-field")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("POST with an unknown field: %d, want 400", resp.StatusCode)
	}
	code, id := post(t, api.URL, "ticket-0005-refund", refundTicket)
	if code != http.StatusAccepted {
		t.Fatalf("POST: %d", code)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the reply", func() bool { return s.mail.Total() == 1 })
	st, err := http.Get(api.URL + "/v1/tickets/" + id)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Body.Close()
	var state struct {
		Status string            `json:"status"`
		Result map[string]string `json:"result"`
	}
	if err := json.NewDecoder(st.Body).Decode(&state); err != nil || st.StatusCode != http.StatusOK || state.Status != "done" || state.Result["category"] != "refund" {
		t.Fatalf("GET: %d %+v %v, want done with category refund", st.StatusCode, state, err)
	}
	if s.model.Requests() != 1 || onceflowtest.Completions(t, env.DB, "") != 1 || s.payments.Total() != 1 {
		t.Fatalf("%d model calls, %d jobs done, %d refunds; want 1 each (the refused POSTs enqueued nothing)",
			s.model.Requests(), onceflowtest.Completions(t, env.DB, ""), s.payments.Total())
	}
}

// The program's bearer authentication: no token or an unknown one is 401.
func TestBearer(t *testing.T) {
	tenant := bearer("k1=acme,k2=globex")
	for header, want := range map[string]string{"Bearer k1": "acme", "Bearer k2": "globex", "Bearer k3": "", "": "", "k1": ""} {
		r := httptest.NewRequest(http.MethodPost, "/v1/tickets", nil)
		if header != "" {
			r.Header.Set("Authorization", header)
		}
		got, err := tenant(r)
		if got != want || (want == "") != errors.Is(err, idempotency.ErrUnauthenticated) {
			t.Errorf("Authorization %q: %q, %v; want %q", header, got, err, want)
		}
	}
}

// A model that calls the tool for another order is refused: the job is dead-lettered
// with the reason after one model call, and nothing is written or sent.
func TestRefundOfAnotherOrderIsDeadLettered(t *testing.T) {
	t.Parallel()
	s := &stores{model: onceflowtest.NewFakeLLM(t, fakeserver.Config{ToolChoice: fakeserver.CallTool("issue_refund", json.RawMessage(`{"order_id":"Z-9","amount_cents":99900}`))}),
		payments: onceflowtest.NewSink(t), mail: onceflowtest.NewSink(t)}
	env, api := s.inProcess(t, onceflow.Config{})
	_, id := post(t, api.URL, "ticket-0006-wrong-order", refundTicket)
	var state *onceflow.JobState
	onceflowtest.WaitFor(t, 20*time.Second, "the dead letter", func() bool {
		var err error
		state, err = env.Client.JobState(context.Background(), "acme", id)
		return err == nil && state.Status == onceflow.StatusFailed
	})
	if !strings.Contains(state.Error, "not a refund of order A-17") {
		t.Fatalf("dead-letter reason %q", state.Error)
	}
	if got := rows(t, env.DB); got != [4]int{} || s.model.Requests() != 1 || s.payments.Total()+s.mail.Total() != 0 {
		t.Fatalf("rows %v, %d model calls, %d deliveries; want none, 1, 0", got, s.model.Requests(), s.payments.Total()+s.mail.Total())
	}
}

// Two tickets about one order (two keys, two jobs, one model call each): one refund,
// and the second ticket's reply says the order was refunded already. Posted at once,
// the two jobs may commit at the same moment; the unique index makes one of them retry
// and answer the same.
func TestOneRefundPerOrderAcrossTickets(t *testing.T) {
	t.Parallel()
	s := newStores(t)
	env, api := s.inProcess(t, onceflow.Config{})
	for _, key := range []string{"ticket-0007-first", "ticket-0008-again"} {
		if code, _ := post(t, api.URL, key, refundTicket); code != http.StatusAccepted {
			t.Fatalf("POST %s: %d", key, code)
		}
	}
	onceflowtest.WaitFor(t, 30*time.Second, "two replies", func() bool { return s.mail.Total() == 2 })
	time.Sleep(500 * time.Millisecond) // a second refund, if any, would be sent by now
	if got := rows(t, env.DB); got != [4]int{2, 1, 2, 3} || s.payments.Total() != 1 || s.model.Requests() != 2 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d refunds sent, %d model calls; want [2 1 2 3], 1, 2",
			got, s.payments.Total(), s.model.Requests())
	}
	if n := env.Count(`SELECT count(*) FROM replies WHERE body = 'Order A-17 was refunded already.'`); n != 1 {
		t.Fatalf("%d replies say the order was refunded already, want 1", n)
	}
}
