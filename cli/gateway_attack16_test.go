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
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// gatedUpstream's first call sends holdHead and then waits for release before it sends
// the rest of fullAgain's events and [DONE]; later calls send fullAgain whole.
type gatedUpstream struct {
	release chan struct{}
	mu      sync.Mutex
	calls   int
}

const gatedRest = "data: {\"choices\":[{\"delta\":{\"content\":\" done\"}}]}\n\ndata: [DONE]\n\n"

func (u *gatedUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	u.calls++
	n := u.calls
	u.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	if n > 1 {
		_, _ = io.WriteString(w, fullAgain)
		return
	}
	_, _ = io.WriteString(w, holdHead)
	http.NewResponseController(w).Flush()
	select {
	case <-u.release:
	case <-r.Context().Done():
		return
	}
	_, _ = io.WriteString(w, gatedRest)
}

func (u *gatedUpstream) Calls() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls
}

// A rolling restart: SIGTERM to the gateway that makes a stream, while requests on it
// and on another gateway process follow it. The draining gateway lets the stream end
// (within ONCEFLOW_SHUTDOWN_TIMEOUT): its client and every joiner get the whole stream,
// the answer is recorded (the other process replays it), one upstream call, and the
// gateway exits 0. Holds (a regression test).
func TestAttack16RollingRestartOfTheOwnerLetsJoinersFinish(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	up := &gatedUpstream{release: make(chan struct{})}
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	a, aURL := startGateway(t, dsn, ups.URL+"/v1")
	_, bURL := startGateway(t, dsn, ups.URL+"/v1")
	key := "rolling-restart-key-0001"
	var clients []*bufio.Reader
	for _, url := range []string{aURL, aURL, bURL} {
		resp, err := streamRequest(t, url, key)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		r := bufio.NewReader(resp.Body)
		head := make([]byte, len(holdHead))
		if _, err := io.ReadFull(r, head); err != nil || string(head) != holdHead {
			t.Fatalf("head: %q %v", head, err)
		}
		clients = append(clients, r)
	}
	a.Signal(syscall.SIGTERM)
	time.Sleep(300 * time.Millisecond) // the gateway drains
	close(up.release)
	for i, r := range clients {
		rest, err := io.ReadAll(r)
		if err != nil || string(rest) != gatedRest {
			t.Fatalf("client %d: rest %q %v; want the stream's end", i, rest, err)
		}
	}
	if code := a.Wait(20 * time.Second); code != 0 {
		t.Fatalf("the restarted gateway exited %d", code)
	}
	resp, err := streamRequest(t, bURL, key)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(b) != holdHead+gatedRest || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay on the other gateway: %v %q %v", resp.Header, b, err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// A rolling restart whose drain is shorter than the stream: the gateway gives the call
// up at ONCEFLOW_SHUTDOWN_TIMEOUT and records it as an ambiguous failure, as documented,
// so that the joiner on the other process is cut at once (it passed a prefix on) and
// the client's retry there takes the call over at once (a new generation, with
// Onceflow-Stream-Restarted), not after a 409 until the lease (15s) runs out. Holds (a
// regression test).
func TestAttack16RestartPastTheDrainHandsTheCallOverAtOnce(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	up := &gatedUpstream{release: make(chan struct{})} // never released: the stream outlives the drain
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	a, aURL := startGateway(t, dsn, ups.URL+"/v1", "ONCEFLOW_SHUTDOWN_TIMEOUT=1s")
	_, bURL := startGateway(t, dsn, ups.URL+"/v1")
	key := "restart-past-drain-0001"
	owner, err := streamRequest(t, aURL, key)
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Body.Close()
	or := bufio.NewReader(owner.Body)
	head := make([]byte, len(holdHead))
	if _, err := io.ReadFull(or, head); err != nil {
		t.Fatal(err)
	}
	joiner, err := streamRequest(t, bURL, key)
	if err != nil {
		t.Fatal(err)
	}
	defer joiner.Body.Close()
	jr := bufio.NewReader(joiner.Body)
	if _, err := io.ReadFull(jr, head); err != nil || joiner.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("joiner: %v %v", joiner.Header, err)
	}
	start := time.Now()
	a.Signal(syscall.SIGTERM)
	if rest, err := io.ReadAll(jr); err == nil {
		t.Fatalf("the joiner's stream of a given-up call ended cleanly (+%q)", rest)
	}
	t.Logf("joiner cut %v after SIGTERM", time.Since(start).Round(time.Millisecond))
	h, body, err := streamAnswer(t, bURL, key)
	took := time.Since(start)
	if err != nil || body != fullAgain || h.Get("Onceflow-Stream-Restarted") != strconv.Itoa(len(holdHead)) {
		t.Fatalf("retry: %v %q %v", h, body, err)
	}
	if took > 8*time.Second {
		t.Fatalf("the retry got the new generation %v after SIGTERM: the given-up call was not handed over at once", took)
	}
	if code := a.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	// The client has its whole stream before the gateway records it (docs/providers.md):
	// wait for the record.
	l, _ := ledger.New(pool, ledger.Config{})
	var row *ledger.Row
	testenv.WaitFor(t, 10*time.Second, "the retry's record", func() bool {
		row, err = l.Get(context.Background(), gatewayKey(key))
		return err == nil && row.State != ledger.StateInFlight
	})
	if row.State != ledger.StateSucceeded || row.Attempt != 2 || row.Ambiguous != 1 {
		t.Fatalf("row %+v; want succeeded at attempt 2 with the given-up one ambiguous", row)
	}
	if n := up.Calls(); n != 2 {
		t.Fatalf("%d upstream calls, want 2", n)
	}
}

// A new user puts the gateway in front of Anthropic as docs/providers.md says
// ("Running onceflow gateway": ONCEFLOW_LLM_BASE_URL=https://api.anthropic.com/v1,
// "ONCEFLOW_LLM does not matter to it") and caps each caller at one call in flight
// (ONCEFLOW_TENANT_CONCURRENCY=1, "Limits for a whole organisation"); the Anthropic
// SDKs authenticate with x-api-key only. Two concurrent calls with the same x-api-key
// get one answer and one 429. Found on 8befa99 (fixed by 25aed04): the tenant header
// defaulted to x-api-key only with ONCEFLOW_LLM=anthropic, else Authorization, so every
// such caller had no tenant and no cap applied to anyone.
func TestAttack16AnthropicGatewayFromTheDocsCapsTenants(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	_, fake := startFakeLLM(t, "--latency", "1500ms")
	_, gwURL := startGateway(t, dsn, fake, "ONCEFLOW_REDIS_URL="+testenv.RedisURL(t), "ONCEFLOW_PREFIX="+testenv.Prefix(t),
		"ONCEFLOW_TENANT_CONCURRENCY=1", "ONCEFLOW_LLM_ADMISSION_WAIT=50ms")
	send := func() (int, string) {
		req, _ := http.NewRequest(http.MethodPost, gwURL+"/messages",
			strings.NewReader(`{"model":"claude-sonnet-4-0","max_tokens":64,"messages":[{"role":"user","content":"hello"}]}`))
		req.Header.Set("X-Api-Key", "sk-ant-team-a")
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// The limiter's first call to a model is a probe that the next calls wait for: one
	// call first, so that a 429 below is the cap's.
	if code, b := send(); code != http.StatusOK {
		t.Fatalf("warm-up call: %d %s", code, b)
	}
	first := make(chan int, 1)
	go func() { code, _ := send(); first <- code }()
	waitInFlight(t, fake)
	if code, b := send(); code != http.StatusTooManyRequests || !strings.Contains(b, "ONCEFLOW_TENANT_CONCURRENCY") {
		t.Errorf("a second call with the same x-api-key under ONCEFLOW_TENANT_CONCURRENCY=1: %d %s, want the cap's 429", code, b)
	}
	select {
	case code := <-first:
		if code != http.StatusOK {
			t.Fatalf("first call: %d", code)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the first call did not end")
	}
	st, err := fakeserver.FetchStats(t.Context(), nil, fake)
	if err != nil || st.Requests != 2 {
		t.Errorf("%d upstream calls (%v): the warm-up and one for a caller capped at one in flight, want 2", st.Requests, err)
	}
}
