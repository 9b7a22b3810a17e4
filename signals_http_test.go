package onceflow_test

import (
	"context"
	"encoding/json"
	"github.com/onceflow/onceflow/onceflowtest"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
)

// SignalHandler and ApprovalsHandler over real HTTP, Redis and PostgreSQL: the tenant
// comes from the API key, another tenant's job is a 404 that changes nothing, and a
// retried request is answered as the first was.

// apiTenant authenticates the tests' requests: Bearer acme-key is acme, Bearer
// globex-key is globex, anything else is unauthenticated.
func apiTenant(r *http.Request) (string, error) {
	switch r.Header.Get("Authorization") {
	case "Bearer acme-key":
		return "acme", nil
	case "Bearer globex-key":
		return "globex", nil
	}
	return "", idempotency.ErrUnauthenticated
}

// apiServer serves c's signal and approval routes as the docs mount them.
func apiServer(t *testing.T, c *onceflow.Client) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle("POST /v1/jobs/{job_id}/signals/{name}", onceflow.SignalHandler(c, apiTenant))
	approvals := onceflow.ApprovalsHandler(c, apiTenant)
	mux.Handle("GET /v1/approvals", approvals)
	mux.Handle("POST /v1/jobs/{job_id}/approvals/{key}/{decision}", approvals)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// apiCall sends a request with key's Authorization (none for "") and returns the status,
// the headers and the body.
func apiCall(t *testing.T, method, url, key, contentType, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// signalRows counts the signals recorded for job id.
func (e *stepEnv) signalRows(id string) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM job_steps WHERE job_id = $1 AND name LIKE 'signal:%'`, id).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// A POST of a signal wakes the job that waits for it, which gets the body as its
// payload, byte for byte in value (a number past float64's precision stays whole); the
// same POST again is answered 202 as replayed, and another payload 409.
func TestSignalRouteWakesTheWaitingJob(t *testing.T) {
	t.Parallel()
	got := make(chan string, 2)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		p, err := onceflow.WaitSignal(ctx, j, "payment", time.Hour)
		if err != nil {
			return err
		}
		got <- string(p)
		return nil
	})
	res, err := e.client.Enqueue(context.Background(), orderArgs{Order: "A-1"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	e.start()
	testenv.WaitFor(t, 10*time.Second, "the job to wait for its signal", func() bool {
		st, err := e.client.JobState(context.Background(), "acme", res.JobID)
		return err == nil && st.Waiting == "signal payment"
	})
	url := apiServer(t, e.client) + "/v1/jobs/" + res.JobID + "/signals/payment"
	const body = "{\"cents\": 12345678901234567890,\n \"by\": \"card <visa>\"}"
	code, h, out := apiCall(t, "POST", url, "acme-key", "application/json; charset=utf-8", body)
	if code != http.StatusAccepted || h.Get("Idempotent-Replayed") != "" ||
		strings.TrimSpace(out) != `{"job_id":"`+res.JobID+`","signal":"payment","status":"signalled"}` {
		t.Fatalf("signal: %d %q", code, out)
	}
	select {
	case p := <-got:
		var v struct {
			Cents json.Number `json:"cents"`
			By    string      `json:"by"`
		}
		dec := json.NewDecoder(strings.NewReader(p))
		dec.UseNumber()
		if err := dec.Decode(&v); err != nil || v.Cents != "12345678901234567890" || v.By != "card <visa>" {
			t.Fatalf("the job got the payload %s (%v)", p, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the signal did not wake the job")
	}
	// A retry of the same request: answered as the first, nothing recorded twice.
	if code, h, out := apiCall(t, "POST", url, "acme-key", "application/json", body); code != http.StatusAccepted || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the same signal again: %d %q, want 202 replayed", code, out)
	}
	if code, _, out := apiCall(t, "POST", url, "acme-key", "application/json", `{"cents": 1}`); code != http.StatusConflict || !strings.Contains(out, "first one stands") {
		t.Fatalf("another payload: %d %q, want 409", code, out)
	}
	if n := e.signalRows(res.JobID); n != 1 {
		t.Fatalf("%d signals recorded, want 1", n)
	}
}

// The tenant of a signal is the API key's: another tenant's job and an unknown id are
// 404 and record nothing, a request without a key is 401, and bad names and bodies are
// refused (400, 413, 415) before anything is recorded.
func TestSignalRouteRefusesOtherTenantsAndBadRequests(t *testing.T) {
	t.Parallel()
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.WaitSignal(ctx, j, "payment", time.Hour)
		return err
	})
	res, err := e.client.Enqueue(context.Background(), orderArgs{Order: "A-2"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	base := apiServer(t, e.client) + "/v1/jobs/"
	url := base + res.JobID + "/signals/payment"
	for _, tc := range []struct {
		what, url, key, ctype, body string
		code                        int
	}{
		{"another tenant's job", url, "globex-key", "application/json", `{}`, http.StatusNotFound},
		{"an unknown job", base + "00000000-0000-4000-8000-000000000009/signals/payment", "acme-key", "application/json", `{}`, http.StatusNotFound},
		{"no key", url, "", "application/json", `{}`, http.StatusUnauthorized},
		{"an unknown key", url, "mallory-key", "application/json", `{}`, http.StatusUnauthorized},
		{"a name with onceflow's prefix", base + res.JobID + "/signals/approval:tool-x", "acme-key", "application/json", `{}`, http.StatusBadRequest},
		{"a name with a control character", base + res.JobID + "/signals/pay%0Ament", "acme-key", "application/json", `{}`, http.StatusBadRequest},
		{"a name too long", base + res.JobID + "/signals/" + strings.Repeat("n", onceflow.MaxStepNameLen+1), "acme-key", "application/json", `{}`, http.StatusBadRequest},
		{"text/plain", url, "acme-key", "text/plain", `{}`, http.StatusUnsupportedMediaType},
		{"no Content-Type", url, "acme-key", "", `{}`, http.StatusUnsupportedMediaType},
		{"an empty body", url, "acme-key", "application/json", ``, http.StatusBadRequest},
		{"not JSON", url, "acme-key", "application/json", `{cents: 1}`, http.StatusBadRequest},
		{"a duplicate name", url, "acme-key", "application/json", `{"cents": 1, "cents": 2}`, http.StatusBadRequest},
		{"trailing data", url, "acme-key", "application/json", `{"cents": 1} {}`, http.StatusBadRequest},
		{"an unpaired surrogate", url, "acme-key", "application/json", `"\ud800"`, http.StatusBadRequest},
		{"a body too large", url, "acme-key", "application/json", `"` + strings.Repeat("x", onceflow.MaxSignalBytes) + `"`, http.StatusRequestEntityTooLarge},
	} {
		code, h, out := apiCall(t, "POST", tc.url, tc.key, tc.ctype, tc.body)
		if code != tc.code || h.Get("Content-Type") != "application/json" || !strings.Contains(out, `"detail"`) {
			t.Errorf("%s: %d %q, want %d with a detail", tc.what, code, out, tc.code)
		}
		if tc.code == http.StatusUnauthorized && h.Get("WWW-Authenticate") == "" {
			t.Errorf("%s: 401 without WWW-Authenticate", tc.what)
		}
	}
	if code, h, _ := apiCall(t, "GET", url, "acme-key", "", ""); code != http.StatusMethodNotAllowed || h.Get("Allow") == "" {
		t.Errorf("GET of a signal: %d, want 405 with Allow", code)
	}
	if n := e.signalRows(res.JobID); n != 0 {
		t.Fatalf("refused requests recorded %d signals", n)
	}
	// The job's own tenant can still send it.
	if code, _, out := apiCall(t, "POST", url, "acme-key", "application/json", `"paid"`); code != http.StatusAccepted {
		t.Fatalf("the owner's signal after the refusals: %d %q", code, out)
	}
}

// The approvals route lists a tenant's pending calls (with the conversation so far) and
// nobody else's; a decision through it resumes the job, a retry of the same decision is
// answered as the first, the other decision is 409, and another tenant's is 404 and
// changes nothing.
func TestApprovalsRouteListsAndDecidesForItsTenantOnly(t *testing.T) {
	t.Parallel()
	for _, approve := range []bool{true, false} {
		t.Run(map[bool]string{true: "approved", false: "rejected"}[approve], func(t *testing.T) {
			t.Parallel()
			agent := newOrderAgent()
			tools := agent.tools()
			tools[1] = onceflow.NeedsApproval(tools[1], func(refundToolArgs) bool { return true })
			answers := make(chan []llm.Message, 1)
			e := newStepEnv(t, refundScript(false), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
				res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: tools})
				if err != nil {
					return err
				}
				answers <- res.Messages
				return nil
			})
			res, err := e.client.Enqueue(context.Background(), orderArgs{Order: "A-3"}, &onceflow.EnqueueOpts{Tenant: "acme"})
			if err != nil {
				t.Fatal(err)
			}
			e.start()
			base := apiServer(t, e.client)
			var list struct {
				Approvals []onceflow.Approval `json:"approvals"`
			}
			testenv.WaitFor(t, 10*time.Second, "the approval in acme's list", func() bool {
				code, _, out := apiCall(t, "GET", base+"/v1/approvals", "acme-key", "", "")
				return code == http.StatusOK && json.Unmarshal([]byte(out), &list) == nil && len(list.Approvals) == 1
			})
			a := list.Approvals[0]
			if a.JobID != res.JobID || a.Tenant != "acme" || a.Tool != "issue_refund" || !strings.Contains(a.Arguments, "1250") ||
				len(a.Messages) < 3 || a.AskedAt.IsZero() || a.Deadline.Before(a.AskedAt) {
				t.Fatalf("acme's approval: %+v", a)
			}
			if code, _, out := apiCall(t, "GET", base+"/v1/approvals", "globex-key", "", ""); code != http.StatusOK || strings.TrimSpace(out) != `{"approvals":[]}` {
				t.Fatalf("globex's list: %d %s", code, out)
			}
			for _, q := range []string{"?limit=0", "?limit=1001", "?limit=x"} {
				if code, _, _ := apiCall(t, "GET", base+"/v1/approvals"+q, "acme-key", "", ""); code != http.StatusBadRequest {
					t.Errorf("GET %s: %d, want 400", q, code)
				}
			}
			if code, _, _ := apiCall(t, "GET", base+"/v1/approvals", "", "", ""); code != http.StatusUnauthorized {
				t.Errorf("GET without a key: %d, want 401", code)
			}
			decision := map[bool]string{true: "approve", false: "reject"}[approve]
			other := map[bool]string{true: "reject", false: "approve"}[approve]
			url := base + "/v1/jobs/" + res.JobID + "/approvals/" + a.Key + "/"
			for _, tc := range []struct {
				what, url, key, ctype, body string
				code                        int
			}{
				{"another tenant", url + decision, "globex-key", "", "", http.StatusNotFound},
				{"another tenant, the other way", url + other, "globex-key", "application/json", `{"by":"mallory"}`, http.StatusNotFound},
				{"an unknown call", base + "/v1/jobs/" + res.JobID + "/approvals/tool-0000/" + decision, "acme-key", "", "", http.StatusNotFound},
				{"not a call's key", base + "/v1/jobs/" + res.JobID + "/approvals/wait:approval:x/" + decision, "acme-key", "", "", http.StatusNotFound},
				{"an unknown decision", url + "maybe", "acme-key", "", "", http.StatusNotFound},
				{"no key", url + decision, "", "", "", http.StatusUnauthorized},
				{"an unknown field", url + decision, "acme-key", "application/json", `{"by":"ann","approved":false}`, http.StatusBadRequest},
				{"a note too long", url + decision, "acme-key", "application/json", `{"note":"` + strings.Repeat("é", onceflow.MaxDecisionNote+1) + `"}`, http.StatusBadRequest},
				{"a by with a newline", url + decision, "acme-key", "application/json", `{"by":"ann\nroot"}`, http.StatusBadRequest},
				{"a body of text/plain", url + decision, "acme-key", "text/plain", `{"by":"ann"}`, http.StatusUnsupportedMediaType},
				{"a body too large", url + decision, "acme-key", "application/json", `{"note":"` + strings.Repeat("x", 20<<10) + `"}`, http.StatusRequestEntityTooLarge},
			} {
				if code, _, out := apiCall(t, "POST", tc.url, tc.key, tc.ctype, tc.body); code != tc.code {
					t.Errorf("%s: %d %q, want %d", tc.what, code, out, tc.code)
				}
			}
			if still, _ := e.client.Inspector().Approvals(context.Background(), "acme", false, 10); len(still) != 1 {
				t.Fatalf("the refused decisions changed the pending approvals: %d left", len(still))
			}
			code, h, out := apiCall(t, "POST", url+decision, "acme-key", "application/json", `{"by":"ann@acme.example","note":"checked <the order>"}`)
			var got struct {
				JobID    string    `json:"job_id"`
				Key      string    `json:"key"`
				Approved bool      `json:"approved"`
				By       string    `json:"by"`
				Note     string    `json:"note"`
				At       time.Time `json:"at"`
			}
			if code != http.StatusOK || h.Get("Idempotent-Replayed") != "" || json.Unmarshal([]byte(out), &got) != nil ||
				got.JobID != res.JobID || got.Key != a.Key || got.Approved != approve || got.By != "ann@acme.example" || got.Note != "checked <the order>" || got.At.IsZero() {
				t.Fatalf("%s: %d %s", decision, code, out)
			}
			// A retry of the decision: the recorded one again; the other: 409.
			if code, h, again := apiCall(t, "POST", url+decision, "acme-key", "", ""); code != http.StatusOK || h.Get("Idempotent-Replayed") != "true" || again != out {
				t.Fatalf("the same decision again: %d %q, want 200 replayed with %q", code, again, out)
			}
			if code, _, out := apiCall(t, "POST", url+other, "acme-key", "", ""); code != http.StatusConflict || !strings.Contains(out, "decided already") {
				t.Fatalf("the other decision after one: %d %q, want 409", code, out)
			}
			var msgs []llm.Message
			select {
			case msgs = <-answers:
			case <-time.After(10 * time.Second):
				t.Fatal("the decision did not resume the job")
			}
			refunds, requests := agent.effects()
			if approve && (refunds != 1 || requests != 1) || !approve && requests != 0 {
				t.Fatalf("%s: %d refunds from %d requests", decision, refunds, requests)
			}
			transcript, _ := json.Marshal(msgs)
			if !approve && !strings.Contains(string(transcript), "checked \\u003cthe order\\u003e") {
				t.Fatalf("the model was not told the note: %s", transcript)
			}
		})
	}
}

// With PostgreSQL stopped, the signal and approval routes answer 503 with Retry-After,
// promptly, and a signal that could not be recorded is accepted once PostgreSQL is back.
func TestSignalAndApprovalRoutesWhilePostgresIsDown(t *testing.T) {
	t.Parallel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	rdb, prefix := testenv.Redis(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.Enqueue(context.Background(), orderArgs{Order: "A-4"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	base := apiServer(t, c)
	signal := base + "/v1/jobs/" + res.JobID + "/signals/payment"
	pg.Stop()
	for _, tc := range []struct{ method, url, ctype, body string }{
		{"POST", signal, "application/json", `{"cents":1}`},
		{"GET", base + "/v1/approvals", "", ""},
		{"POST", base + "/v1/jobs/" + res.JobID + "/approvals/tool-" + strings.Repeat("a", 64) + "/approve", "", ""},
	} {
		t0 := time.Now()
		code, h, out := apiCall(t, tc.method, tc.url, "acme-key", tc.ctype, tc.body)
		if code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" || time.Since(t0) > 5*time.Second {
			t.Errorf("%s %s with PostgreSQL down: %d %q (Retry-After %q) after %s", tc.method, tc.url, code, out, h.Get("Retry-After"), time.Since(t0))
		}
	}
	pg.Start()
	testenv.WaitFor(t, 10*time.Second, "the signal accepted once PostgreSQL is back", func() bool {
		code, _, _ := apiCall(t, "POST", signal, "acme-key", "application/json", `{"cents":1}`)
		return code == http.StatusAccepted
	})
}

// A signal's name is 1 to MaxStepNameLen printable ASCII characters (docs/api.md): a
// longer one is a 400 that records nothing.
func TestSignalRouteRefusesANameLongerThanMaxStepNameLen(t *testing.T) {
	t.Parallel()
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.WaitSignal(ctx, j, "payment", time.Hour)
		return err
	})
	res, err := e.client.Enqueue(context.Background(), orderArgs{Order: "N-1"}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	base := apiServer(t, e.client) + "/v1/jobs/" + res.JobID + "/signals/"
	if code, _, out := apiCall(t, "POST", base+strings.Repeat("n", onceflow.MaxStepNameLen+1), "acme-key", "application/json", `{}`); code != http.StatusBadRequest {
		t.Fatalf("a signal name of %d characters: %d %s, want 400", onceflow.MaxStepNameLen+1, code, out)
	}
	if code, _, out := apiCall(t, "POST", base+strings.Repeat("n", onceflow.MaxStepNameLen), "acme-key", "application/json", `{}`); code != http.StatusAccepted {
		t.Fatalf("a signal name of %d characters: %d %s, want 202", onceflow.MaxStepNameLen, code, out)
	}
	if n := onceflowtest.Count(t, e.pool, `SELECT count(*) FROM job_steps WHERE name LIKE 'signal:%'`); n != 1 {
		t.Fatalf("%d signals recorded, want the one with a name within the bound", n)
	}
}
