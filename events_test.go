package onceflow_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"github.com/onceflow/onceflow/onceflowtest"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
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

// A tool call's "tool" event must reach an SSE client even when the call finished after
// another call of the same turn that started later (RunAgent runs a turn's calls in
// parallel): one connection followed to the end gets every tool call of the job.
func TestEventsStreamEveryToolCallOfAParallelTurn(t *testing.T) {
	t.Parallel()
	slowStarted := make(chan struct{})
	sawFast := make(chan struct{})
	var once atomic.Bool
	slow := onceflow.MustTool("send_email", "Send an email.", func(ctx context.Context, key string, args lookupArgs) (string, error) {
		close(slowStarted)
		select {
		case <-sawFast:
		case <-time.After(10 * time.Second):
		}
		return "sent", nil
	})
	slow.AtMostOnce = true // an SMTP server honours no key: intent first
	fast := onceflow.MustTool("lookup_order", "Look an order up.", func(ctx context.Context, key string, args lookupArgs) (string, error) {
		<-slowStarted
		return `{"order":"A-1"}`, nil
	})
	model := &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("send_email", lookupArgs{Order: "A-1"}), onceflowtest.Call("lookup_order", lookupArgs{Order: "A-1"})}},
		{Text: "All done."},
	}}
	e := newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: []onceflow.AgentTool{slow, fast}})
		return err
	})
	base := eventsServer(t, e)
	id := e.enqueue("A-1")
	e.start()
	_, evs := readEvents(t, base+"/v1/jobs/"+id+"/events", "k", "", func(ev sseEvent) bool {
		if ev.event == "tool" && strings.Contains(ev.data, "lookup_order") && once.CompareAndSwap(false, true) {
			close(sawFast)
		}
		return false
	})
	var kinds []string
	tools := 0
	for _, ev := range evs {
		kinds = append(kinds, ev.event)
		if ev.event == "tool" {
			tools++
		}
	}
	if tools != 2 {
		t.Fatalf("events %s: %d tool events, want 2 (send_email's result was never streamed)", strings.Join(kinds, ","), tools)
	}
}

// An SSE client that connects and never reads must not hold the handler (its goroutine,
// its buffers, its polling of PostgreSQL) past EventsConfig.MaxDuration: the stream is
// bounded by MaxDuration, whatever the client does.
func TestEventsStreamToAClientThatNeverReadsEndsByMaxDuration(t *testing.T) {
	t.Parallel()
	proceed := make(chan struct{})
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		select {
		case <-proceed:
		case <-ctx.Done():
		}
		return nil
	})
	id := e.enqueue("S-1")
	e.start()
	t.Cleanup(func() { close(proceed) })
	// A streamed step in flight whose text so far is larger than the sockets' buffers.
	big := strings.Repeat("x", 16<<20)
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO llm_calls (idem_key, work, state, request_hash, attempt, partial, partial_attempt, expires_at)
VALUES ($1, $2, 'in_flight', 'h', 1, $3, 1, now() + interval '1 hour')`, "llm-"+strings.Repeat("b", 64), "reply/"+id, big); err != nil {
		t.Fatal(err)
	}
	returned := make(chan struct{})
	h := onceflow.EventsHandler(e.client, bearerTenants(map[string]string{"k": ""}), onceflow.EventsConfig{Poll: 20 * time.Millisecond, MaxDuration: time.Second, Heartbeat: 100 * time.Millisecond})
	mux := http.NewServeMux()
	mux.Handle("GET /v1/jobs/{job_id}/events", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(returned)
		h.ServeHTTP(w, r)
	}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	t.Cleanup(func() { _ = conn.Close() })
	fmt.Fprintf(conn, "GET /v1/jobs/%s/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n", id)
	// The client never reads. Without the bound the handler blocks for as long as the
	// connection lives; with it, it returns once the 16 MB it read are written out or
	// cut, which under -race on a loaded machine took more than 10 s.
	select {
	case <-returned:
	case <-time.After(30 * time.Second):
		t.Fatal("30 s after connecting, the handler of a 1 s MaxDuration stream is still blocked writing to a client that never reads")
	}
}
