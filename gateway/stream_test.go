package gateway_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

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

// A long generation streams megabytes (an OpenAI chunk is about 200 bytes a token: 16k
// output tokens are over 3 MiB). A 6 MiB stream that the upstream sends in milliseconds
// passes through the gateway within 20 s more than directly (about 3 s under -race on
// a quiet machine; a loaded one, every test package at once, took 9 s; rewriting the
// whole partial at each write takes minutes).
func TestLargeStreamIsNotSlowedByItsPartials(t *testing.T) {
	up := newBigStream(6 << 10)
	close(up.release)
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	start := time.Now()
	req, _ := http.NewRequest(http.MethodPost, ups.URL+"/v1/chat/completions", strings.NewReader(streamBody))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	direct, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	directTook := time.Since(start)
	if err != nil || string(direct) != up.whole() {
		t.Fatalf("direct: %d bytes %v", len(direct), err)
	}
	fl := gatewaysOn(t, up, 1, gateway.Config{Timeout: 30 * time.Second})
	start = time.Now()
	_, body, err := streamPost(t, fl.urls[0], "large-stream-key-00001")
	took := time.Since(start)
	if err != nil || body != up.whole() {
		t.Fatalf("through the gateway: %d bytes %v", len(body), err)
	}
	t.Logf("%d bytes: direct %v, through the gateway %v", len(body), directTook, took)
	if took > directTook+20*time.Second {
		t.Fatalf("a %d-byte stream took %v through the gateway, %v directly: its partial writes rewrite the whole partial each time",
			len(body), took.Round(time.Millisecond), directTook.Round(time.Millisecond))
	}
}

// A rolling deploy during a PostgreSQL failover: a stream completes while PostgreSQL is
// down, its client gets the end at once (its handler returned), and the HTTP server,
// with no handler left, lets the gateway Close. The answer was generated and passed on
// whole: Close must let its record wait for PostgreSQL (gateway.succeed retries for up
// to succeedPatience), or the row stays in_flight and the retry that follows the lease
// makes a second upstream call.
func TestCloseRightAfterTheEOFRecordsThroughAPostgresRestart(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	pg, g, url, pool := privateGateway(t, up, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "close-after-eof-pg-restart"
	row := keyFor("Bearer sk", key)
	fr := openAnnounced(t, up, url, pool, key)
	pg.Stop()
	close(up.release)
	if tail, err := readAllWithin(fr, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("the client's tail while PostgreSQL is down: %q %v", tail, err)
	}
	closed := make(chan error, 1)
	go func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		closed <- g.Close(cctx)
	}()
	closedEarly := false
	select {
	case err := <-closed:
		closedEarly = true
		closed <- err
	case <-time.After(3 * time.Second):
	}
	pg.Start()
	if err := <-closed; err != nil {
		t.Fatalf("Close: %v", err)
	}
	r := waitRow(t, pool, row, "readable row", func(*ledger.Row) bool { return true })
	if r.State != ledger.StateSucceeded || string(r.Raw) != gatedHead+gatedTail {
		t.Fatalf("after Close (returned while PostgreSQL was down: %v) the row is %s (owner %q): the answer its client got whole was not recorded, "+
			"and the next retry makes a second upstream call", closedEarly, r.State, r.Owner)
	}
}

// PostgreSQL is killed (SIGKILL) after the owner's client got the end of a complete
// stream and before its record committed (held up by a row lock, which the crash
// ends): the record commits once PostgreSQL is back, and a retry replays the same
// bytes. One upstream call.
func TestPostgresKilledBetweenTheEOFAndTheCommit(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	pg, _, url, pool := privateGateway(t, up, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "pg-killed-after-eof"
	row := keyFor("Bearer sk", key)
	fr := openAnnounced(t, up, url, pool, key)
	holdRecord(t, pool, row)
	close(up.release)
	if tail, err := readAllWithin(fr, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("tail: %q %v", tail, err)
	}
	time.Sleep(100 * time.Millisecond) // the record waits on the lock
	pg.Kill()
	pg.Start()
	waitRow(t, pool, row, "the record after the crash", func(r *ledger.Row) bool {
		return r.State == ledger.StateSucceeded && string(r.Raw) == gatedHead+gatedTail
	})
	r, body, err := streamPost(t, url, key)
	if err != nil || body != gatedHead+gatedTail || r.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: replayed %q, %v\n%q", r.Header.Get("Idempotent-Replayed"), err, body)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// An upstream that drops mid-stream cuts the client's connection too, and the row keeps
// what came before the cut.
func TestCutStream(t *testing.T) {
	t.Parallel()
	// An upstream that drops mid-stream: the owner's client still sees its connection cut
	// (an error, not a clean end), and the row records the cut as before, with everything
	// received up to the last complete event kept as its partial output (finish(true)
	// writes it whole although no batch was due), for the retry's Onceflow-Stream-Restarted.
	t.Run("aborts the client and keeps its output", func(t *testing.T) {
		t.Parallel()
		const e1, e2, torn = "data: {\"choices\":[{\"delta\":{\"content\":\"one\"}}]}\n\n", "data: {\"choices\":[{\"delta\":{\"content\":\" two\"}}]}\n\n", "data: {\"choi"
		up := &sseUpstream{script: func(call int) ([]string, bool) {
			if call == 0 {
				return []string{e1, e2, torn}, true
			}
			return []string{goodStream}, false
		}}
		fl := gatewaysOn(t, up, 1, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
		const key = "cut-stream-keeps-output"
		_, body, err := streamPost(t, fl.urls[0], key)
		if err == nil || body != e1+e2+torn {
			t.Fatalf("the cut stream's client: %q, err %v; want every byte received, then an error", body, err)
		}
		r := waitRow(t, fl.pool, keyFor("Bearer sk", key), "row", func(*ledger.Row) bool { return true })
		if r.State != ledger.StateInFlight || r.Owner != "" || r.Ambiguous != 1 || r.Partial != e1+e2 || r.PartialAttempt != 1 {
			t.Fatalf("the record of the cut: state %s owner %q ambiguous %d partial %q (attempt %d); want in_flight, released, 1, %q (1)",
				r.State, r.Owner, r.Ambiguous, r.Partial, r.PartialAttempt, e1+e2)
		}
		resp, body, err := streamPost(t, fl.urls[0], key)
		if err != nil || body != goodStream || resp.Header.Get(gateway.HeaderRestarted) != strconv.Itoa(len(e1+e2)) {
			t.Fatalf("retry: %q %v, restarted %q", body, err, resp.Header.Get(gateway.HeaderRestarted))
		}
		if n := up.Calls(); n != 2 {
			t.Fatalf("%d upstream calls, want 2", n)
		}
	})
	// A stream cut after more than maxPartialBytes (1 MiB): the client's connection is
	// cut after every byte received, and the row's partial output is an exact prefix of the
	// stream that ends at an event boundary, within the 1 MiB bound.
	t.Run("beyond 1 MiB keeps an exact prefix", func(t *testing.T) {
		t.Parallel()
		var b strings.Builder
		for i := range 1500 {
			b.WriteString(bigEvent(i))
		}
		sent := b.String() + "data: {\"choi"
		up := &sseUpstream{script: func(call int) ([]string, bool) {
			if call == 0 {
				return []string{sent}, true
			}
			return []string{goodStream}, false
		}}
		fl := gatewaysOn(t, up, 1, gateway.Config{Timeout: 30 * time.Second})
		const key = "cut-stream-beyond-1mib"
		_, body, err := streamPost(t, fl.urls[0], key)
		if err == nil || body != sent {
			t.Fatalf("the cut stream's client: %d of %d bytes, err %v", len(body), len(sent), err)
		}
		r := waitRow(t, fl.pool, keyFor("Bearer sk", key), "row", func(*ledger.Row) bool { return true })
		if r.State != ledger.StateInFlight || r.Ambiguous != 1 || len(r.Partial) > 1<<20 || !strings.HasPrefix(sent, r.Partial) ||
			(r.Partial != "" && !strings.HasSuffix(r.Partial, "\n\n")) {
			t.Fatalf("the record of the cut: state %s ambiguous %d, partial of %d bytes (prefix %v)", r.State, r.Ambiguous, len(r.Partial), strings.HasPrefix(sent, r.Partial))
		}
		t.Logf("partial kept: %d bytes", len(r.Partial))
	})
}

// A stream that is not valid UTF-8 (and holds a NUL): the partial column is text, so
// the persister stops before the first invalid segment; the owner's client, a joiner on
// its process and one on another process each get every byte as sent, and a retry
// replays them. One upstream call.
func TestNonUTF8StreamIsPassedOnJoinedAndReplayedWhole(t *testing.T) {
	t.Parallel()
	up := newPhased(
		"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"\xff\xfe bad\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"nul \x00 here\"}}]}\n\ndata: [DONE]\n\n")
	fl := gatewaysOn(t, up, 2, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: 10 * time.Millisecond}})
	const key = "non-utf8-stream-0001"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, fl.urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 1); got != up.parts[0] {
		t.Fatalf("first event: %q", got)
	}
	waitRow(t, fl.pool, row, "the first event persisted", func(r *ledger.Row) bool { return r.Partial == up.parts[0] })
	close(up.gates[0])
	if got := readEvents(t, or, 1); got != up.parts[1] {
		t.Fatalf("second event: %q", got)
	}
	var joiners []*http.Response
	for i := range 2 {
		j := openStream(t, fl.urls[i], key)
		if j.Header.Get("Onceflow-Joined") != "true" {
			t.Fatalf("gateway %d: no join: %d", i, j.StatusCode)
		}
		joiners = append(joiners, j)
	}
	fl.waitJoining(t, 0, 1)
	fl.waitJoining(t, 1, 1)
	close(up.gates[1])
	if rest, err := readAllWithin(or, 15*time.Second); err != nil || rest != up.parts[2] {
		t.Fatalf("the owner's tail: %q %v", rest, err)
	}
	for i, j := range joiners {
		if got, err := readAllWithin(j.Body, 15*time.Second); err != nil || got != up.whole() {
			t.Fatalf("joiner on gateway %d: %q %v", i, got, err)
		}
	}
	r, body, err := streamPost(t, fl.urls[1], key)
	if err != nil || body != up.whole() || r.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %q %v", body, err)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// A stream carrying an error event is not a complete answer, even when it ends with
// data: [DONE], as vLLM (the usual self-hosted OpenAI-compatible upstream) ends a failed
// one (its serving_chat: `yield f"data: {error}"` then `yield "data: [DONE]"`): it is
// not recorded, so a retry of the key is not answered that error for
// ONCEFLOW_LEDGER_RETENTION.
func TestStreamWithAnErrorEventIsNotRecorded(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}`+"\n\n"+
			`data: {"error":{"object":"error","message":"CUDA out of memory","type":"InternalServerError","param":null,"code":500}}`+"\n\n"+
			"data: [DONE]\n\n")
	})
	url, _, _ := loggedGateway(t, upstream)
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"Say one random word."}]}`
	h := http.Header{"Idempotency-Key": {"vllm-error-key-000001"}, "Authorization": {"Bearer sk-alice"}}
	rawPost(t, url+"/chat/completions", body, h)
	_, replayed, b := rawPost(t, url+"/chat/completions", body, h)
	if replayed == "true" || calls.Load() != 2 {
		t.Fatalf("the retry got the failed stream replayed (%d upstream calls): %.200s", calls.Load(), b)
	}
}
