package onceflow_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
)

// A job's events over Server-Sent Events, against real Redis and PostgreSQL.

type sseEvent struct{ id, event, data string }

// readEvents GETs url with apiKey and lastID (Last-Event-ID) and returns the events
// until the stream ends or stop says so.
func readEvents(t *testing.T, url, apiKey, lastID string, stop func(sseEvent) bool) (int, []sseEvent) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, nil
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
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
			if stop != nil && stop(cur) {
				return resp.StatusCode, out
			}
			cur = sseEvent{}
		}
	}
	return resp.StatusCode, out
}

// eventsServer serves the job events of e's client for tenant "" under API key "k".
func eventsServer(t *testing.T, e *stepEnv) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle("GET /v1/jobs/{job_id}/events", onceflow.EventsHandler(e.client, bearerTenants(map[string]string{"k": "", "other": "globex"}),
		onceflow.EventsConfig{Poll: 20 * time.Millisecond}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// An agent job's events: each turn's text, each tool call with its result, then the
// end with the job's state; another tenant and an anonymous client get nothing.
func TestEventsStreamAnAgentJobToItsEnd(t *testing.T) {
	t.Parallel()
	agent := newOrderAgent()
	e := newStepEnv(t, refundScript(true), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: agent.tools(), Stream: true})
		if err != nil {
			return err
		}
		return j.Commit(ctx, func(c *onceflow.Commit) error { c.Result(map[string]string{"answer": res.Answer}); return nil })
	})
	base := eventsServer(t, e)
	id := e.enqueue("A-1")
	url := base + "/v1/jobs/" + id + "/events"
	if code, _ := readEvents(t, url, "other", "", nil); code != http.StatusNotFound {
		t.Fatalf("another tenant: %d, want 404", code)
	}
	if code, _ := readEvents(t, url, "", "", nil); code != http.StatusUnauthorized {
		t.Fatalf("no API key: %d, want 401", code)
	}
	e.start()
	code, evs := readEvents(t, url, "k", "", nil)
	if code != http.StatusOK || len(evs) == 0 {
		t.Fatalf("%d, %d events", code, len(evs))
	}
	var kinds []string
	var text strings.Builder
	for _, ev := range evs {
		kinds = append(kinds, ev.event)
		if ev.event == "text" {
			var d struct{ Text string }
			if err := json.Unmarshal([]byte(ev.data), &d); err != nil {
				t.Fatal(err)
			}
			text.WriteString(d.Text)
		}
	}
	if got := strings.Join(kinds, ","); got != "tool,tool,text,end" {
		t.Fatalf("events %s, want the two tool calls, the answer's text, the end", got)
	}
	if text.String() != "Your refund of 12.50 is on its way." {
		t.Fatalf("text %q", text.String())
	}
	last := evs[len(evs)-1]
	if last.id != "end" || !strings.Contains(last.data, `"status":"done"`) {
		t.Fatalf("end event %+v", last)
	}
	if _, again := readEvents(t, url, "k", "end", nil); len(again) != 0 {
		t.Fatalf("after the end, a reconnect got %d events", len(again))
	}
}

// A client that reconnects with Last-Event-ID gets what follows, nothing twice; one
// that reconnects while a step is being generated gets the rest of its text; when the
// generation is abandoned for a new attempt (its worker died), a restart says so.
func TestEventsResumeFromLastEventIDAndSayRestart(t *testing.T) {
	t.Parallel()
	proceed := make(chan struct{})
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		<-proceed
		return nil
	})
	base := eventsServer(t, e)
	id := e.enqueue("A-2")
	e.start()
	ctx := context.Background()
	key := "llm-" + strings.Repeat("a", 64)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := e.pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	// A streamed step in flight, as the ledger writes it: attempt 1's partial output.
	exec(`INSERT INTO llm_calls (idem_key, work, state, request_hash, attempt, partial, partial_attempt, expires_at)
VALUES ($1, $2, 'in_flight', 'h', 1, 'Hello wor', 1, now() + interval '1 hour')`, key, "reply/"+id)
	url := base + "/v1/jobs/" + id + "/events"
	_, first := readEvents(t, url, "k", "", func(ev sseEvent) bool { return ev.event == "text" })
	if len(first) != 1 || !strings.Contains(first[0].data, `"text":"Hello wor"`) {
		t.Fatalf("first connection: %+v", first)
	}
	exec(`UPDATE llm_calls SET partial = 'Hello world, and' WHERE idem_key = $1`, key)
	_, second := readEvents(t, url, "k", first[0].id, func(ev sseEvent) bool { return ev.event == "text" })
	if len(second) != 1 || !strings.Contains(second[0].data, `"text":"ld, and"`) {
		t.Fatalf("resumed: %+v, want the rest of the text only", second)
	}
	// The worker died; another delivery's attempt 2 generates anew, and finishes.
	resp, _ := json.Marshal(llm.Response{Content: "Hi there."})
	exec(`UPDATE llm_calls SET attempt = 2, partial = 'Hi', partial_attempt = 2 WHERE idem_key = $1`, key)
	_, third := readEvents(t, url, "k", second[0].id, func(ev sseEvent) bool { return ev.event == "text" })
	if len(third) != 2 || third[0].event != "restart" || !strings.Contains(third[1].data, `"text":"Hi"`) {
		t.Fatalf("after a takeover: %+v, want a restart then attempt 2's text", third)
	}
	exec(`UPDATE llm_calls SET state = 'succeeded', response = $2 WHERE idem_key = $1`, key, resp)
	close(proceed)
	e.waitStatus(id, onceflow.StatusDone)
	_, rest := readEvents(t, url, "k", third[1].id, nil)
	var kinds []string
	for _, ev := range rest {
		kinds = append(kinds, ev.event+":"+ev.data)
	}
	if len(rest) != 2 || !strings.Contains(rest[0].data, `"text":" there."`) || rest[1].event != "end" {
		t.Fatalf("the rest: %s", strings.Join(kinds, " | "))
	}
	if code, _ := readEvents(t, url, "k", "bogus", nil); code != http.StatusBadRequest {
		t.Fatalf("a Last-Event-ID this stream never sent: %d, want 400", code)
	}
}
