package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// Every test counts effects: model requests (the fake model), reads of the orders API,
// POSTs and their keys at the payments API and the mailer (sinks), replies rows.

// approvalAbove is REFUND_APPROVAL_ABOVE in the tests: 1299 cents is refunded at
// once, 25000 waits for an operator.
const approvalAbove = 10000

// world is one test's outside world: the fake model scripted for one order and
// amount, the orders API, the payments API (a sink that honours Idempotency-Key) and
// the mailer.
type world struct {
	order          string
	model          *onceflowtest.FakeLLM
	orders         *httptest.Server
	reads          atomic.Int64
	payments, mail *onceflowtest.Sink

	mu    sync.Mutex
	asked [][]llm.Message // the messages of every model request, in arrival order
}

// newWorld starts the world of a support request about order, whose model asks to
// refund amount cents. cfg configures the fake model (ToolCallIDs, faults); its
// ToolChoice is the script.
func newWorld(t *testing.T, cfg fakeserver.Config, order string, amount int) *world {
	t.Helper()
	w := &world{order: order, payments: onceflowtest.NewSink(t), mail: onceflowtest.NewSink(t)}
	cfg.ToolChoice = w.script(amount)
	w.model = onceflowtest.NewFakeLLM(t, cfg)
	w.payments.SetAnswer(func(key string, body []byte) []byte {
		return fmt.Appendf(nil, `{"refund_id":"re_%s","status":"succeeded"}`, key[len(key)-12:])
	})
	mux := http.NewServeMux()
	mux.HandleFunc("GET /orders/{id}", func(rw http.ResponseWriter, r *http.Request) {
		if r.PathValue("id") != order {
			http.Error(rw, `{"detail":"no such order"}`, http.StatusNotFound)
			return
		}
		if r.URL.Query().Get("fields") == "customer" { // the refund's check of the order's customer
			fmt.Fprintf(rw, `{"customer":"acme"}`)
			return
		}
		n := w.reads.Add(1) // updated_at changes at every read, as an etag or a timestamp does
		rw.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(rw, `{"order":%q,"customer":"acme","status":"delivered","amount_paid":30000,"updated_at":%q,"read":%d}`,
			order, time.Now().UTC().Format(time.RFC3339Nano), n)
	})
	w.orders = httptest.NewServer(mux)
	t.Cleanup(w.orders.Close)
	return w
}

// script is the fake model's agent loop, by the tool results in the conversation: none
// yet, look the order up; one, refund amount; two or more, answer in text.
func (w *world) script(amount int) fakeserver.ToolChooser {
	return func(req *llm.Request) (string, json.RawMessage, bool) {
		w.mu.Lock()
		w.asked = append(w.asked, slices.Clone(req.Messages))
		w.mu.Unlock()
		results := 0
		for _, m := range req.Messages {
			if m.Role == llm.RoleTool {
				results++
			}
		}
		switch results {
		case 0:
			return "lookup_order", fmt.Appendf(nil, `{"order":%q}`, w.order), true
		case 1:
			return "issue_refund", fmt.Appendf(nil, `{"order":%q,"amount":%d}`, w.order, amount), true
		}
		return "", nil, false
	}
}

// lastToolResult returns the last tool result the model was sent.
func (w *world) lastToolResult() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := len(w.asked) - 1; i >= 0; i-- {
		for j := len(w.asked[i]) - 1; j >= 0; j-- {
			if m := w.asked[i][j]; m.Role == llm.RoleTool {
				return m.Content
			}
		}
	}
	return ""
}

// toolCallIDs returns the id of the tool call that each second-turn request (one tool
// result) carries in its history, in arrival order.
func (w *world) toolCallIDs() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var ids []string
	for _, msgs := range w.asked {
		var results int
		var id string
		for _, m := range msgs {
			if m.Role == llm.RoleTool {
				results++
			}
			if len(m.ToolCalls) == 1 {
				id = m.ToolCalls[0].ID
			}
		}
		if results == 1 {
			ids = append(ids, id)
		}
	}
	return ids
}

// options are the workflow's options on w.
func (w *world) options(t *testing.T) Options {
	return Options{Tenant: bearer("secret=acme"), Operator: bearer("admin=acme"),
		Shop:   &Shop{HTTP: &http.Client{Timeout: 10 * time.Second}, OrdersURL: w.orders.URL, PaymentsURL: w.payments.URL},
		Mailer: w.mail.Sender(t, webhook.PayloadOnly), ApprovalAbove: approvalAbove}
}

// inProcess runs the workflow in the test's process and returns its environment and
// API.
func (w *world) inProcess(t *testing.T) (*onceflowtest.Env, string) {
	env := onceflowtest.New(t, onceflow.Config{Model: w.model.Client(), Provider: "openai",
		Workflows: []onceflow.Workflow{Workflow(w.options(t))}})
	mux := http.NewServeMux()
	if err := env.Client.Mount(mux); err != nil {
		t.Fatal(err)
	}
	api := httptest.NewServer(mux)
	t.Cleanup(api.Close)
	env.Start()
	return env, api.URL
}

// processEnv is the environment of the agent program on the given stores and w.
func (w *world) processEnv(redisURL, prefix, dsn string) []string {
	return []string{"ONCEFLOW_REDIS_URL=" + redisURL, "ONCEFLOW_PREFIX=" + prefix, "ONCEFLOW_DATABASE_URL=" + dsn,
		"OPENAI_BASE_URL=" + w.model.URL + "/v1", "OPENAI_API_KEY=test", "ORDERS_URL=" + w.orders.URL,
		"PAYMENTS_URL=" + w.payments.URL, "MAILER_URL=" + w.mail.URL, "AGENT_API_KEYS=secret=acme", "AGENT_ADMIN_KEYS=admin=acme",
		fmt.Sprintf("REFUND_APPROVAL_ABOVE=%d", approvalAbove), "ONCEFLOW_HTTP_ADDR=127.0.0.1:0",
		"ONCEFLOW_CLAIM_IDLE=1s", "ONCEFLOW_RELAY_LEASE=2s", "ONCEFLOW_LEDGER_LEASE=2s"}
}

// stores returns a Redis URL and key prefix and a migrated PostgreSQL schema of the
// test's own for the program, with a pool on the schema.
func stores(t *testing.T) (redisURL, prefix string, db *pgxpool.Pool, dsn string) {
	t.Helper()
	_, prefix = onceflowtest.Redis(t)
	db, dsn = onceflowtest.Postgres(t, *Workflow(Options{}).Migrations)
	return onceflowtest.RedisURL(t), prefix, db, dsn
}

// startProcess runs the agent program and returns it with its API's URL.
func startProcess(t *testing.T, env []string) (*onceflowtest.Process, string) {
	t.Helper()
	p := onceflowtest.Start(t, onceflowtest.Build(t, "."), env)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return p, "http://" + p.WaitLog(ctx, "agent listening")["addr"].(string)
}

// do sends a request with a bearer token (and a JSON body, when body is not "") and
// returns the status, decoding a JSON answer into out when it is not nil.
func do(t *testing.T, method, url, token, idemKey, body string, out any) int {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if idemKey != "" {
		req.Header.Set("Idempotency-Key", idemKey)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if out != nil && resp.StatusCode < 300 {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatalf("%s %s: %v", method, url, err)
		}
	}
	return resp.StatusCode
}

const supportBody = `{"message":"It arrived broken; I want my money back.","email":"ann@example.com"}`

// post asks for support about order under the Idempotency-Key key and returns the job
// id, failing the test unless the answer is 202.
func post(t *testing.T, api, key, order string) string {
	t.Helper()
	var out struct {
		JobID string `json:"job_id"`
	}
	if code := do(t, http.MethodPost, api+"/v1/orders/"+order+"/support", "secret", key, supportBody, &out); code != http.StatusAccepted {
		t.Fatalf("POST support: %d", code)
	}
	return out.JobID
}

// jobState is GET /v1/jobs/{id}'s answer.
type jobState struct {
	Status string `json:"status"`
	Result struct {
		Reply     string `json:"reply"`
		ToolCalls int    `json:"tool_calls"`
	} `json:"result"`
}

// waitDone waits until job id is done and its email sent, and returns its state.
func waitDone(t *testing.T, api string, w *world, id string) jobState {
	t.Helper()
	var st jobState
	onceflowtest.WaitFor(t, 20*time.Second, "the job done and its email sent", func() bool {
		st = jobState{}
		return do(t, http.MethodGet, api+"/v1/jobs/"+id, "secret", "", "", &st) == http.StatusOK && st.Status == "done" && w.mail.Total() >= 1
	})
	return st
}

// requireOneReply fails the test unless job id has exactly one replies row, its body
// the reply its state reports, and exactly one email, keyed by the job, with that body.
func requireOneReply(t *testing.T, db *pgxpool.Pool, w *world, id string, st jobState) {
	t.Helper()
	if n := onceflowtest.Count(t, db, `SELECT count(*) FROM replies`); n != 1 {
		t.Fatalf("%d replies rows, want 1", n)
	}
	if n := onceflowtest.Count(t, db, `SELECT count(*) FROM replies WHERE job_id = $1 AND body = $2 AND body <> ''`, id, st.Result.Reply); n != 1 {
		t.Fatalf("no replies row of job %s with its reply %q", id, st.Result.Reply)
	}
	w.mail.RequireOncePerKey(t, 1)
	var email Reply
	if d := w.mail.Deliveries()[0]; d.Key != "reply:"+id || json.Unmarshal(d.Body, &email) != nil || email != (Reply{To: "ann@example.com", Body: st.Result.Reply}) {
		t.Fatalf("the mailer got %s keyed %s, want the reply to ann@example.com keyed reply:%s", d.Body, d.Key, id)
	}
}

// sseEvent is one Server-Sent Event.
type sseEvent struct{ id, event, data string }

// readEvents GETs a job's events with Last-Event-ID lastID and returns them until the
// stream ends or breaks; each event is passed to seen first.
func readEvents(t *testing.T, url, lastID string, seen func(sseEvent)) []sseEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("Authorization", "Bearer secret")
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET events: %d", resp.StatusCode)
	}
	var out []sseEvent
	var cur sseEvent
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "id: "):
			cur.id = strings.TrimPrefix(line, "id: ")
		case strings.HasPrefix(line, "event: "):
			cur.event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			cur.data = strings.TrimPrefix(line, "data: ")
		case line == "" && cur.event != "":
			out = append(out, cur)
			if seen != nil {
				seen(cur)
			}
			cur = sseEvent{}
		}
	}
	return out
}

// A refund under the threshold, asked twice with the same Idempotency-Key: one job,
// three model turns (look up, refund, answer), one read of the order, one refund keyed
// by its tool-call key, one reply row and one email.
func TestRefundUnderTheThresholdRunsOnce(t *testing.T) {
	t.Parallel()
	w := newWorld(t, fakeserver.Config{}, "A-17", 1299)
	env, api := w.inProcess(t)
	id := post(t, api, "support-0001-refund", "A-17")
	if again := post(t, api, "support-0001-refund", "A-17"); again != id {
		t.Fatalf("the same POST again made job %s, want %s", again, id)
	}
	st := waitDone(t, api, w, id)
	requireOneReply(t, env.DB, w, id, st)
	w.payments.RequireOncePerKey(t, 1)
	if reads, calls := w.reads.Load(), w.model.Requests(); reads != 1 || calls != 3 || st.Result.ToolCalls != 2 {
		t.Fatalf("%d order reads, %d model calls, %d tool calls; want 1, 3, 2", reads, calls, st.Result.ToolCalls)
	}
	d := w.payments.Deliveries()[0]
	var refund RefundArgs
	if !strings.HasPrefix(d.Key, "tool-") || json.Unmarshal(d.Body, &refund) != nil || refund != (RefundArgs{Order: "A-17", Amount: 1299}) {
		t.Fatalf("payments got %s keyed %s, want the refund of 1299 on A-17 keyed by its tool call", d.Body, d.Key)
	}
	if r := w.lastToolResult(); !strings.Contains(r, `"status":"succeeded"`) {
		t.Fatalf("the model read %q as the refund's result, want the payments API's answer", r)
	}
}

// The routes refuse what they must, with nothing enqueued: no or an unknown key (401),
// an admin key on the customers' route and a customer's key on the operators' (401), a
// body that is not strict JSON or names the order (400), a bad order or email (400). A
// decision nobody waits for is 404.
func TestRoutesRefuseWhatTheyMust(t *testing.T) {
	t.Parallel()
	w := newWorld(t, fakeserver.Config{}, "A-17", 1299)
	env, api := w.inProcess(t)
	support := api + "/v1/orders/A-17/support"
	for _, c := range []struct {
		name, method, url, token, key, body string
		want                                int
	}{
		{"no key", http.MethodPost, support, "", "support-0002-refused", supportBody, http.StatusUnauthorized},
		{"an admin key", http.MethodPost, support, "admin", "support-0002-refused", supportBody, http.StatusUnauthorized},
		{"an unknown field", http.MethodPost, support, "secret", "support-0003-refused", `{"message":"m","email":"a@example.com","x":1}`, http.StatusBadRequest},
		{"the order in the body", http.MethodPost, support, "secret", "support-0004-refused", `{"order":"B-1","message":"m","email":"a@example.com"}`, http.StatusBadRequest},
		{"a bad email", http.MethodPost, support, "secret", "support-0005-refused", `{"message":"m","email":"ann"}`, http.StatusBadRequest},
		{"a bad order", http.MethodPost, api + "/v1/orders/A%2017/support", "secret", "support-0006-refused", supportBody, http.StatusBadRequest},
		{"no Idempotency-Key", http.MethodPost, support, "secret", "", supportBody, http.StatusBadRequest},
		{"approvals, a customer's key", http.MethodGet, api + "/v1/approvals", "secret", "", "", http.StatusUnauthorized},
		{"approve, a customer's key", http.MethodPost, api + "/v1/jobs/j1/approvals/tool-x/approve", "secret", "", "", http.StatusUnauthorized},
		{"approve, nothing waits", http.MethodPost, api + "/v1/jobs/j1/approvals/tool-x/approve", "admin", "", "", http.StatusNotFound},
		{"neither approve nor reject", http.MethodPost, api + "/v1/jobs/j1/approvals/tool-x/maybe", "admin", "", "", http.StatusNotFound},
		{"reject, a bad body", http.MethodPost, api + "/v1/jobs/j1/approvals/tool-x/reject", "admin", "", `{"why":"no"}`, http.StatusBadRequest},
		{"state of no job", http.MethodGet, api + "/v1/jobs/j1", "secret", "", "", http.StatusNotFound},
	} {
		if got := do(t, c.method, c.url, c.token, c.key, c.body, nil); got != c.want {
			t.Errorf("%s: %d, want %d", c.name, got, c.want)
		}
	}
	var list struct{ Approvals []onceflow.Approval }
	if code := do(t, http.MethodGet, api+"/v1/approvals", "admin", "", "", &list); code != http.StatusOK || list.Approvals == nil || len(list.Approvals) != 0 {
		t.Fatalf("GET /v1/approvals: %d %+v, want 200 and an empty list", code, list)
	}
	if n := onceflowtest.Pending(t, env.Redis, env.Prefix, "agent") + w.model.Requests(); n != 0 {
		t.Fatalf("%d jobs pending or model calls after refused requests, want none", n)
	}
}

// The program's keys: a known bearer token gives its tenant, anything else is
// unauthenticated.
func TestBearerGivesAKnownTokensTenantAndRefusesAnyOther(t *testing.T) {
	tenant := bearer("k1=acme, k2=globex")
	for header, want := range map[string]string{"Bearer k1": "acme", "Bearer k2": "globex", "Bearer k3": "", "": "", "k1": ""} {
		r := httptest.NewRequest(http.MethodGet, "/v1/approvals", nil)
		if header != "" {
			r.Header.Set("Authorization", header)
		}
		got, err := tenant(r)
		if got != want || (want == "") != errors.Is(err, idempotency.ErrUnauthenticated) {
			t.Errorf("Authorization %q: %q, %v; want %q", header, got, err, want)
		}
	}
}

// One customer never sees or refunds another's order: a request about an order whose
// customer is another tenant gets "no such order" from both tools (the model reads
// nothing of the order), and no refund is made.
func TestAnotherCustomersOrderIsNeitherShownNorRefunded(t *testing.T) {
	t.Parallel()
	w := newWorld(t, fakeserver.Config{}, "A-17", 1299) // A-17 is acme's
	o := w.options(t)
	o.Tenant = bearer("secret=acme,other=globex")
	env := onceflowtest.New(t, onceflow.Config{Model: w.model.Client(), Provider: "openai", Workflows: []onceflow.Workflow{Workflow(o)}})
	mux := http.NewServeMux()
	if err := env.Client.Mount(mux); err != nil {
		t.Fatal(err)
	}
	api := httptest.NewServer(mux)
	t.Cleanup(api.Close)
	env.Start()
	var out struct {
		JobID string `json:"job_id"`
	}
	if code := do(t, http.MethodPost, api.URL+"/v1/orders/A-17/support", "other", "support-0401-other", supportBody, &out); code != http.StatusAccepted {
		t.Fatalf("POST support: %d", code)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the job done", func() bool {
		var st jobState
		return do(t, http.MethodGet, api.URL+"/v1/jobs/"+out.JobID, "other", "", "", &st) == http.StatusOK && st.Status == "done"
	})
	if n := w.payments.Total(); n != 0 {
		t.Fatalf("%d refunds of another customer's order", n)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	results := 0
	for _, msgs := range w.asked {
		for _, m := range msgs {
			if m.Role == llm.RoleTool {
				results++
				if m.Content != notFound {
					t.Fatalf("the model read %q about another customer's order, want %q", m.Content, notFound)
				}
			}
		}
	}
	if results == 0 {
		t.Fatal("no tool result reached the model")
	}
}
