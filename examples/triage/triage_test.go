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
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

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

// stores are one test's fake model, receivers and database schema, and the refund
// limit its workflow holds refunds over (0: none).
type stores struct {
	model          *onceflowtest.FakeLLM
	payments, mail *onceflowtest.Sink
	holdOver       int
}

func newStores(t *testing.T) *stores {
	return &stores{model: onceflowtest.NewFakeLLM(t, fakeserver.Config{ToolChoice: refundWhenAsked}),
		payments: onceflowtest.NewSink(t), mail: onceflowtest.NewSink(t)}
}

func tenant(*http.Request) (string, error) { return "acme", nil }

// inProcess runs the workflow in the test's process with cfg's extras (Middleware,
// Registerer) and returns its environment and API.
func (s *stores) inProcess(t *testing.T, cfg onceflow.Config) (*onceflowtest.Env, *httptest.Server) {
	opts := Options{Tenant: tenant, Operator: bearer("admin=acme"), HoldRefundsOverCents: s.holdOver,
		Queue:    onceflow.QueueConfig{ClaimIdle: 300 * time.Millisecond},
		Payments: s.payments.Sender(t, webhook.PayloadOnly), Mailer: s.mail.Sender(t, webhook.PayloadOnly)}
	cfg.Model, cfg.Provider = s.model.Client(), "openai"
	cfg.Workflows, cfg.Gates = []onceflow.Workflow{Workflow(opts)}, opts.Gates()
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
		"PAYMENTS_URL=" + s.payments.URL, "MAILER_URL=" + s.mail.URL, "ONCEFLOW_CLAIM_IDLE=1s", "ONCEFLOW_RELAY_LEASE=2s",
		"TRIAGE_ADMIN_KEYS=admin=acme", "TRIAGE_HOLD_REFUNDS_OVER_CENTS=" + strconv.Itoa(s.holdOver)}
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
func TestBearerGivesAKnownTokensTenantAndRefusesAnyOther(t *testing.T) {
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

// do sends method to url with the bearer token and body (JSON, unless ""), decodes the
// answer into out (when not nil) and returns its status.
func do(t *testing.T, method, url, token, body string, out any) int {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if out != nil {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatalf("%s %s: %d, the answer does not decode: %v", method, url, resp.StatusCode, err)
		}
	}
	return resp.StatusCode
}

// ticketState is GET /v1/tickets/{id}, with the customer's key.
func ticketState(t *testing.T, api, id string) (int, onceflow.JobState) {
	t.Helper()
	var st onceflow.JobState
	code := do(t, http.MethodGet, api+"/v1/tickets/"+id, "secret", "", &st)
	return code, st
}

// heldTickets is GET /v1/held, with the operator's key.
func heldTickets(t *testing.T, api string) []onceflow.Held {
	t.Helper()
	var out struct {
		Held []onceflow.Held `json:"held"`
	}
	if code := do(t, http.MethodGet, api+"/v1/held", "admin", "", &out); code != http.StatusOK {
		t.Fatalf("GET /v1/held: %d", code)
	}
	return out.Held
}

// waitHeld waits until GET says ticket id is held and GET /v1/held lists it, and
// returns that entry.
func waitHeld(t *testing.T, api, id string) onceflow.Held {
	t.Helper()
	var held []onceflow.Held
	onceflowtest.WaitFor(t, 20*time.Second, "the ticket held", func() bool {
		if _, st := ticketState(t, api, id); st.Status != onceflow.StatusHeld {
			return false
		}
		held = heldTickets(t, api)
		return len(held) == 1 && held[0].JobID == id
	})
	return held[0]
}

// decide is POST /v1/tickets/{id}/{decision} (release, reject) with the operator's key
// and the body {"key", "note"}; it returns the status and the answer's detail.
func decide(t *testing.T, api, id, decision, key, note string) (int, string) {
	t.Helper()
	body, _ := json.Marshal(map[string]string{"key": key, "by": "ops", "note": note})
	var out struct {
		Detail   string `json:"detail"`
		Decision string `json:"decision"`
	}
	code := do(t, http.MethodPost, api+"/v1/tickets/"+id+"/"+decision, "admin", string(body), &out)
	return code, out.Detail + out.Decision
}

// The refund limit's check: a refund over the limit fails it, one at or under the
// limit, a text answer, or a call the worker refuses anyway passes.
func TestRefundLimitFailsOnlyARefundOverIt(t *testing.T) {
	o := Options{HoldRefundsOverCents: 1000}
	refund := func(args string) *llm.Response {
		return &llm.Response{ToolCalls: []llm.ToolCall{{ID: "c1", Name: "issue_refund", Arguments: args}}}
	}
	for name, tc := range map[string]struct {
		resp *llm.Response
		held bool
	}{
		"over":          {refund(`{"order_id":"A-17","amount_cents":1001}`), true},
		"at the limit":  {refund(`{"order_id":"A-17","amount_cents":1000}`), false},
		"under":         {refund(`{"order_id":"A-17","amount_cents":1}`), false},
		"text":          {&llm.Response{Content: "It ships tomorrow."}, false},
		"another tool":  {&llm.Response{ToolCalls: []llm.ToolCall{{Name: "wire_money", Arguments: `{"amount_cents":99999}`}}}, false},
		"bad arguments": {refund(`{"order_id":"A-17","amount_cents":99999,"to":"me"}`), false},
		"second call over": {&llm.Response{ToolCalls: []llm.ToolCall{{Name: "issue_refund", Arguments: `{"order_id":"A-17","amount_cents":5}`},
			{Name: "issue_refund", Arguments: `{"order_id":"A-17","amount_cents":5000}`}}}, true},
	} {
		if err := o.checkRefund(tc.resp); (err != nil) != tc.held {
			t.Errorf("%s: %v, want held %v", name, err, tc.held)
		}
	}
	if gates := (Options{}).Gates(); gates != nil {
		t.Errorf("no limit: gates %+v, want none", gates)
	}
}

// A refund at the limit is not held: the gate checks the answer and passes it, and the
// refund and the reply go out once.
func TestRefundAtTheLimitIsNotHeld(t *testing.T) {
	t.Parallel()
	s := newStores(t)
	s.holdOver = 1299 // the fake model refunds 1299
	reg := prometheus.NewRegistry()
	env, api := s.inProcess(t, onceflow.Config{Registerer: reg})
	if code, _ := post(t, api.URL, "ticket-0009-at-limit", refundTicket); code != http.StatusAccepted {
		t.Fatalf("POST: %d", code)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the refund and the reply", func() bool { return s.payments.Total() == 1 && s.mail.Total() == 1 })
	if got := rows(t, env.DB); got != [4]int{1, 1, 1, 2} || s.model.Requests() != 1 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and 1", got, s.model.Requests())
	}
	if passed, held := counter(t, reg, "onceflow_gate_answers_total", "outcome", "passed"), counter(t, reg, "onceflow_gate_answers_total", "outcome", "held"); passed != 1 || held != 0 {
		t.Fatalf("the gate passed %v answers and held %v, want 1 and 0", passed, held)
	}
	if held := heldTickets(t, api.URL); len(held) != 0 {
		t.Fatalf("held %+v, want none", held)
	}
}

// A refund over the limit holds its ticket before anything is written or sent (no
// worker held); released, the ticket goes on with the held answer: one model call, one
// refund, one reply. The same release again is a retry; a rejection after it is 409.
func TestRefundOverTheLimitIsHeldUntilReleased(t *testing.T) {
	t.Parallel()
	s := newStores(t)
	s.holdOver = 1000
	env, api := s.inProcess(t, onceflow.Config{})
	_, id := post(t, api.URL, "ticket-0010-over-limit", refundTicket)
	h := waitHeld(t, api.URL, id)
	if h.Gate != "refund-limit" || h.Reason != "refund of 1299 cents over the limit of 1000, order A-17" || h.Key == "" {
		t.Fatalf("held %+v", h)
	}
	if got := rows(t, env.DB); got != [4]int{} || s.payments.Total()+s.mail.Total() != 0 || s.model.Requests() != 1 {
		t.Fatalf("held: rows %v, %d deliveries, %d model calls; want none, 0, 1", got, s.payments.Total()+s.mail.Total(), s.model.Requests())
	}
	if n := onceflowtest.Pending(t, env.Redis, env.Prefix, "triage"); n != 0 {
		t.Fatalf("%d entries held by workers while the ticket is held, want 0", n)
	}
	if code, got := decide(t, api.URL, id, "release", h.Key, "approved by the shift lead"); code != http.StatusOK || got != "released" {
		t.Fatalf("release: %d %q", code, got)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the ticket done", func() bool {
		_, st := ticketState(t, api.URL, id)
		return st.Status == onceflow.StatusDone
	})
	if code, got := decide(t, api.URL, id, "release", h.Key, "approved by the shift lead"); code != http.StatusOK || got != "released" {
		t.Fatalf("the same release again: %d %q, want 200 (a retry)", code, got)
	}
	if code, got := decide(t, api.URL, id, "reject", h.Key, ""); code != http.StatusConflict || !strings.Contains(got, "it is done") {
		t.Fatalf("reject after the release: %d %q, want 409 saying it is done", code, got)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the refund and the reply", func() bool { return s.payments.Total() == 1 && s.mail.Total() == 1 })
	if got := rows(t, env.DB); got != [4]int{1, 1, 1, 2} || s.model.Requests() != 1 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d model calls; want [1 1 1 2] and 1 (the held answer replayed)", got, s.model.Requests())
	}
	s.payments.RequireOncePerKey(t, 1)
	s.mail.RequireOncePerKey(t, 1)
}

// The operators' routes refuse what they must: a customer's key (401), an unknown
// ticket (404), a bad body (415, 400, 413), another answer's key (409), and a decision
// on a ticket that is not held (409); nothing is decided by them.
func TestHeldTicketRoutesRefuseBadRequests(t *testing.T) {
	t.Parallel()
	s := newStores(t)
	s.holdOver = 1000
	env, api := s.inProcess(t, onceflow.Config{})
	_, id := post(t, api.URL, "ticket-0011-refused-decisions", refundTicket)
	h := waitHeld(t, api.URL, id)
	release := api.URL + "/v1/tickets/" + id + "/release"
	key := `{"key":"` + h.Key + `"}`
	for _, tc := range []struct {
		name, method, url, token, body string
		want                           int
	}{
		{"list with a customer's key", http.MethodGet, api.URL + "/v1/held", "secret", "", http.StatusUnauthorized},
		{"release with a customer's key", http.MethodPost, release, "secret", key, http.StatusUnauthorized},
		{"an unknown ticket", http.MethodPost, api.URL + "/v1/tickets/no-such-ticket/release", "admin", key, http.StatusNotFound},
		{"no body", http.MethodPost, release, "admin", "", http.StatusUnsupportedMediaType},
		{"no key", http.MethodPost, release, "admin", `{"note":"ok"}`, http.StatusBadRequest},
		{"an unknown field", http.MethodPost, release, "admin", `{"key":"` + h.Key + `","amount":1}`, http.StatusBadRequest},
		{"two objects", http.MethodPost, release, "admin", key + `{}`, http.StatusBadRequest},
		{"a control character in by", http.MethodPost, release, "admin", `{"key":"` + h.Key + `","by":"a\u0007"}`, http.StatusBadRequest},
		{"a body too large", http.MethodPost, release, "admin", `{"key":"` + h.Key + `","note":"` + strings.Repeat("x", 20<<10) + `"}`, http.StatusRequestEntityTooLarge},
		{"another answer's key", http.MethodPost, release, "admin", `{"key":"` + h.Key + `0"}`, http.StatusConflict},
	} {
		if code := do(t, tc.method, tc.url, tc.token, tc.body, nil); code != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, code, tc.want)
		}
	}
	if held := heldTickets(t, api.URL); len(held) != 1 {
		t.Fatalf("held %+v after the refused decisions, want the ticket still held", held)
	}
	question := Ticket{Customer: "bob@example.com", OrderID: "B-2", Message: "When does my parcel arrive?"}
	_, qid := post(t, api.URL, "ticket-0012-question", question)
	onceflowtest.WaitFor(t, 20*time.Second, "the question's reply", func() bool { return s.mail.Total() == 1 })
	if code, got := decide(t, api.URL, qid, "release", h.Key, ""); code != http.StatusConflict || !strings.Contains(got, "not held") {
		t.Fatalf("release of a ticket never held: %d %q, want 409", code, got)
	}
	if got := rows(t, env.DB); got != [4]int{1, 0, 1, 1} || s.payments.Total() != 0 {
		t.Fatalf("rows (tickets, refunds, replies, outbox) %v, %d refunds sent; want the question's only", got, s.payments.Total())
	}
}
