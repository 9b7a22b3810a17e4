package gateway_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// sseUpstream is an upstream that answers every request with a scripted event stream:
// the n-th call (from 0) writes the chunks of script(n), flushing after each, then
// drops the connection if drop, else closes cleanly. It counts its calls.
type sseUpstream struct {
	script func(call int) (chunks []string, drop bool)
	mu     sync.Mutex
	calls  int
}

func (u *sseUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	n := u.calls
	u.calls++
	u.mu.Unlock()
	chunks, drop := u.script(n)
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	for _, c := range chunks {
		_, _ = io.WriteString(w, c)
		http.NewResponseController(w).Flush()
	}
	if drop {
		panic(http.ErrAbortHandler) // the connection closes without the chunked terminator
	}
}

func (u *sseUpstream) Calls() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls
}

// streamGateway runs a gateway in front of up and returns its /v1 URL and ledger.
func streamGateway(t *testing.T, up http.Handler) (string, *ledger.Ledger) {
	t.Helper()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: pool, Logger: testenv.Logger(t), Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	return gs.URL + "/v1", g.Ledger()
}

const streamBody = `{"model":"gpt-4.1-mini","stream":true,"messages":[{"role":"user","content":"Say one random word."}]}`

// streamPost sends a keyed streaming request with Authorization "Bearer sk" and reads
// the answer whole; err is the read error of a stream that was cut.
func streamPost(t *testing.T, url, key string) (resp *http.Response, body string, err error) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", strings.NewReader(streamBody))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

const goodStream = "data: {\"choices\":[{\"delta\":{\"content\":\"word\"}}]}\n\ndata: [DONE]\n\n"

// A stream is complete only when its last event is the provider's final one and the
// connection closed cleanly. A terminator inside an earlier event's text, one followed
// by another event, one that is only the first line of an event's data, or one never
// dispatched (no blank line after it) does not count: the stream is not recorded, and
// the retry calls the upstream again.
func TestStreamIsCompleteOnlyWhenItsLastEventEndsIt(t *testing.T) {
	t.Parallel()
	for name, cut := range map[string]string{
		"openai terminator inside a content string":    "data: {\"choices\":[{\"delta\":{\"content\":\"say data: [DONE]\\n\\n\"}}]}\n\n",
		"anthropic terminator inside a content string": "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"event: message_stop\"}}\n\n",
		"terminator followed by another event":         "data: [DONE]\n\ndata: {\"choices\":[]}\n\n",
		"terminator as the first of two data lines":    "data: [DONE]\ndata: {\"choices\":[]}\n\n",
		"terminator never dispatched":                  "data: {\"choices\":[]}\n\ndata: [DONE]\n",
		"terminator then an unfinished event":          "data: [DONE]\n\ndata: {\"choi",
		"anthropic event name without its blank line":  "event: message_stop\ndata: {\"type\":\"message_stop\"}",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			up := &sseUpstream{script: func(call int) ([]string, bool) {
				if call == 0 {
					return []string{cut}, false // closes cleanly, without its final event
				}
				return []string{goodStream}, false
			}}
			url, l := streamGateway(t, up)
			key := "terminator-key-000001"
			_, _, _ = streamPost(t, url, key)
			row, err := l.Get(context.Background(), gateway.KeyFor(gateway.CredentialScope(http.Header{"Authorization": {"Bearer sk"}}), key))
			if err != nil {
				t.Fatal(err)
			}
			if row.State == ledger.StateSucceeded {
				t.Fatalf("a stream without its final event was recorded as complete (row %s)", row.State)
			}
			resp, body, err := streamPost(t, url, key)
			if err != nil || up.Calls() != 2 || resp.Header.Get("Idempotent-Replayed") != "" || body != goodStream {
				t.Fatalf("retry: %d upstream calls, replayed %q, %v\n%q", up.Calls(), resp.Header.Get("Idempotent-Replayed"), err, body)
			}
		})
	}
}

// Streams that end with their final event are recorded, whatever follows it that is
// not an event (comments, blank lines) and however the final event is spelled.
func TestStreamEndingWithItsFinalEventIsRecorded(t *testing.T) {
	t.Parallel()
	for name, whole := range map[string]string{
		"openai with a comment after":          "data: {\"choices\":[]}\n\ndata: [DONE]\n\n: bye\n\n\n",
		"anthropic message_stop":               "event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
		"anthropic message_stop by type alone": "data: {\"type\":\"message_start\"}\n\ndata: {\"type\":\"message_stop\"}\n\n",
		"comments between events":              ": ping\n\ndata: {\"choices\":[]}\n: ping\n\ndata: [DONE]\n\n",
		"openai responses":                     "event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\"}\n\n",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			up := &sseUpstream{script: func(int) ([]string, bool) { return []string{whole}, false }}
			url, _ := streamGateway(t, up)
			key := "final-event-key-00001"
			if _, body, err := streamPost(t, url, key); err != nil || body != whole {
				t.Fatalf("first: %v %q", err, body)
			}
			resp, body, err := streamPost(t, url, key)
			if err != nil || body != whole || resp.Header.Get("Idempotent-Replayed") != "true" || up.Calls() != 1 {
				t.Fatalf("retry: %d upstream calls, replayed %q, %v %q", up.Calls(), resp.Header.Get("Idempotent-Replayed"), err, body)
			}
		})
	}
}

// Whatever the line endings (CRLF, bare CR, LF), a stream dropped mid-event leaves its
// complete events, byte for byte, as the row's partial output; the complete stream of
// the retry is recorded with its events counted and replayed byte for byte.
func TestStreamFramingDoesNotMatter(t *testing.T) {
	t.Parallel()
	for name, eol := range map[string]string{"crlf": "\r\n", "cr": "\r", "lf": "\n"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ev := func(s string) string { return "data: " + s + eol + eol }
			first := []string{ev(`{"n":1}`) + ev(`{"n":2}`)[:3], ev(`{"n":2}`)[3:] + ": keep-alive" + eol + eol, ev(`{"n":3}`) + `data: {"n":`}
			whole := "event: chunk" + eol + ev(`{"n":1,`+"\"text\":\"a multi\"}"+eol+"data: {\"line\":true}") + ev(`{"n":2}`) + ev("[DONE]")
			up := &sseUpstream{script: func(call int) ([]string, bool) {
				if call == 0 {
					return first, true
				}
				// Split the complete stream between every CR and LF of a CRLF.
				return strings.SplitAfter(whole, "\r"), false
			}}
			url, l := streamGateway(t, up)
			key := "framing-key-000000001"
			_, cut, err := streamPost(t, url, key)
			if err == nil {
				t.Fatal("the dropped stream reached the client as complete")
			}
			wantPartial := ev(`{"n":1}`) + ev(`{"n":2}`) + ": keep-alive" + eol + eol + ev(`{"n":3}`)
			if cut != strings.Join(first, "") {
				t.Fatalf("the client got %q", cut)
			}
			gk := gateway.KeyFor(gateway.CredentialScope(http.Header{"Authorization": {"Bearer sk"}}), key)
			row, _ := l.Get(context.Background(), gk)
			if row.State != ledger.StateInFlight || row.Ambiguous != 1 || row.Partial != wantPartial {
				t.Fatalf("row after the drop: state %s ambiguous %d\npartial %q\nwant    %q", row.State, row.Ambiguous, row.Partial, wantPartial)
			}
			_, got, err := streamPost(t, url, key)
			if err != nil || got != whole {
				t.Fatalf("retry: %v\n%q\n%q", err, got, whole)
			}
			resp, again, err := streamPost(t, url, key)
			if err != nil || again != whole || resp.Header.Get("Idempotent-Replayed") != "true" || up.Calls() != 2 {
				t.Fatalf("replay: %d upstream calls, %v\n%q", up.Calls(), err, again)
			}
			row, _ = l.Get(context.Background(), gk)
			var summary struct{ Bytes, Events int }
			if err := json.Unmarshal(row.Response, &summary); err != nil || row.State != ledger.StateSucceeded || summary.Events != 3 || summary.Bytes != len(whole) {
				t.Fatalf("recorded row %s summary %s", row.State, row.Response)
			}
		})
	}
}

// fake-llm's Anthropic stream (message_start ... message_stop) is recorded and replayed.
func TestAnthropicStreamIsRecorded(t *testing.T) {
	t.Parallel()
	e := setup(t, fakeserver.Config{}, gateway.Config{})
	body := strings.Replace(messagesBody, `"max_tokens":64,`, `"max_tokens":64,"stream":true,`, 1)
	h := header("x-api-key", "sk-ant")
	_, first := send(t, e.url+"/messages", "anthropic-stream-key-01", body, h)
	r, again := send(t, e.url+"/messages", "anthropic-stream-key-01", body, h)
	if !strings.Contains(string(first), "event: message_stop") || string(again) != string(first) || r.Header.Get("Idempotent-Replayed") != "true" || e.up.Stats().Requests != 1 {
		t.Fatalf("replayed %q, %d upstream requests\n%s", r.Header.Get("Idempotent-Replayed"), e.up.Stats().Requests, first)
	}
}

// The client that made a streamed call gets the end of its response once it has every
// byte of the complete stream, without waiting for the answer's record to commit; the
// record is made after the handler returned, and Gateway.Close waits for it. The
// record's commit is held up here by a row lock taken after the stream was announced.
func TestStreamClientGetsItsEndBeforeTheRecordCommits(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: pool, Logger: testenv.Logger(t), Registerer: prometheus.NewRegistry(),
		Ledger: ledger.Config{StreamFlushInterval: time.Hour}}) // no partial write to wait on the lock
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	ctx := context.Background()
	const key = "stream-end-before-record"
	row := keyFor("Bearer sk", key)
	fr := openAnnounced(t, up, gs.URL+"/v1", pool, key)
	release := holdRecord(t, pool, row)
	close(up.release)
	if tail, err := readAllWithin(fr, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("the client's stream did not end while the record of its answer waited for a lock: %q %v", tail, err)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM llm_calls WHERE idem_key = $1`, row).Scan(&state); err != nil || state != ledger.StateInFlight {
		t.Fatalf("state while the record waits: %q %v", state, err)
	}

	closed := make(chan error, 1)
	go func() {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		closed <- g.Close(cctx)
	}()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while an answer was still being recorded", err)
	case <-time.After(300 * time.Millisecond):
	}
	release()
	if err := <-closed; err != nil {
		t.Fatalf("Close: %v", err)
	}
	r, err := g.Ledger().Get(ctx, row)
	if err != nil || r.State != ledger.StateSucceeded || string(r.Raw) != gatedHead+gatedTail {
		t.Fatalf("the record after Close: %+v %v", r, err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls", n)
	}
}
