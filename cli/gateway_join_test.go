package cli

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
)

// streamAnswer sends streamRequest and reads its answer whole; err is the read error of
// a stream that was cut.
func streamAnswer(t *testing.T, url, key string) (http.Header, string, error) {
	t.Helper()
	resp, err := streamRequest(t, url, key)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.Header, string(b), err
}

// A streaming upstream for the kill test: its first call sends two events and then
// holds the stream open until its client goes; later calls send a whole stream.
type holdingStream struct {
	mu    sync.Mutex
	calls int
	keys  []string
}

const (
	holdHead  = "data: {\"choices\":[{\"delta\":{\"content\":\"dead\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" attempt\"}}]}\n\n"
	fullAgain = "data: {\"choices\":[{\"delta\":{\"content\":\"new\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" generation\"}}]}\n\ndata: [DONE]\n\n"
)

func (u *holdingStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	u.calls++
	n := u.calls
	u.keys = append(u.keys, r.Header.Get("Idempotency-Key"))
	u.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	if n == 1 {
		_, _ = io.WriteString(w, holdHead)
		http.NewResponseController(w).Flush()
		<-r.Context().Done() // the gateway that made the call dies
		return
	}
	_, _ = io.WriteString(w, fullAgain)
}

func streamRequest(t *testing.T, url, key string) (*http.Response, error) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions",
		strings.NewReader(`{"model":"gpt-4.1-mini","stream":true,"messages":[{"role":"user","content":"hello"}]}`))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk-test")
	return http.DefaultClient.Do(req)
}

// Two gateway processes; a stream is made by the first and joined on the second; the
// first is killed with kill -9 mid-stream. The joiner, which passed the dead attempt's
// events on, is cut once the lease runs out (its client must not take a prefix for an
// answer); the client's retry takes the call over with a new upstream call, whose
// answer says it restarted (Onceflow-Stream-Restarted) and is a whole stream; it is
// what every later retry gets. Two upstream calls for the key, one recorded answer.
func TestGatewayKilledMidStreamJoinerCutRetryRestarts(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	up := &holdingStream{}
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	a, aURL := startGateway(t, dsn, ups.URL+"/v1", "ONCEFLOW_LEDGER_LEASE=2s")
	_, bURL := startGateway(t, dsn, ups.URL+"/v1", "ONCEFLOW_LEDGER_LEASE=2s")
	key := "killed-mid-stream-0001"
	first, err := streamRequest(t, aURL, key)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Body.Close()
	fr := bufio.NewReader(first.Body)
	head := make([]byte, len(holdHead))
	if _, err := io.ReadFull(fr, head); err != nil || string(head) != holdHead {
		t.Fatalf("first request's head: %q %v", head, err)
	}
	joiner, err := streamRequest(t, bURL, key)
	if err != nil {
		t.Fatal(err)
	}
	defer joiner.Body.Close()
	if joiner.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("the second request did not join: %d %v", joiner.StatusCode, joiner.Header)
	}
	jhead := make([]byte, len(holdHead))
	if _, err := io.ReadFull(joiner.Body, jhead); err != nil || string(jhead) != holdHead {
		t.Fatalf("joiner's head (from the other process, through llm_calls): %q %v", jhead, err)
	}
	a.Kill()
	if _, err := io.ReadAll(fr); err == nil {
		t.Fatal("the killed gateway's stream ended cleanly")
	}
	start := time.Now()
	rest, err := io.ReadAll(joiner.Body)
	if err == nil {
		t.Fatalf("the joiner's stream of a dead attempt ended cleanly (+%q): its client would take a prefix for the answer", rest)
	}
	t.Logf("joiner cut %v after the kill", time.Since(start).Round(time.Millisecond))
	// The client's retry: a new generation from its first event, and it says so.
	h, body, err := streamAnswer(t, bURL, key)
	if err != nil || body != fullAgain || h.Get("Onceflow-Stream-Restarted") != strconv.Itoa(len(holdHead)) {
		t.Fatalf("retry: %v %q %v; want the new stream whole, with Onceflow-Stream-Restarted: %d", h, body, err, len(holdHead))
	}
	if h, body, err := streamAnswer(t, bURL, key); err != nil || body != fullAgain || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %v %q %v", h, body, err)
	}
	l, _ := ledger.New(pool, ledger.Config{})
	row, err := l.Get(context.Background(), gatewayKey(key))
	if err != nil || row.State != ledger.StateSucceeded || row.Attempt != 2 || row.Ambiguous != 1 {
		t.Fatalf("row %+v %v; want succeeded at attempt 2 with the killed one ambiguous", row, err)
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	if up.calls != 2 {
		t.Fatalf("%d upstream calls, want 2 (the killed one and the take-over)", up.calls)
	}
}
