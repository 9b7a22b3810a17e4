package cli

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/probe"
)

// startGateway runs `onceflow gateway` in front of upstream on a free port and returns
// it and its /v1 URL.
func startGateway(t *testing.T, dsn, upstream string, env ...string) (*testenv.Process, string) {
	t.Helper()
	env = append([]string{"ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_LLM_BASE_URL=" + upstream, "ONCEFLOW_GATEWAY_ADDR=127.0.0.1:0",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=20s"}, env...)
	p := testenv.Start(t, testenv.Binary(t), env, "gateway")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	line := p.WaitLog(ctx, "gateway listening")
	return p, fmt.Sprint(line["base_url"])
}

// gatewayKey is the gateway's key of an Idempotency-Key sent by keyedPost.
func gatewayKey(key string) string {
	return gateway.KeyFor(gateway.CredentialScope(http.Header{"Authorization": {"Bearer sk-test"}}), key)
}

func keyedPost(url, key string) (int, string, error) {
	req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", strings.NewReader(`{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"hello"}]}`))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk-test")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// `onceflow probe` against the gateway in front of a fake-llm that ignores keys says
// honoured; against the fake-llm itself, ignored.
func TestProbeThroughTheGatewaySaysHonoured(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	_, fake := startFakeLLM(t)
	gw, gwURL := startGateway(t, dsn, fake)
	code, r, p := runProbeCmd(t, nil, "--base-url", gwURL, "--model", "gpt-4.1-mini", "--json")
	if code != 0 || r == nil || r.Verdict != probe.Honoured || !r.Second.Replayed {
		t.Fatalf("probe through the gateway: exit %d %+v\n%s\ngateway:\n%s", code, r, p.Stderr(), gw.Stderr())
	}
	if code, r, _ := runProbeCmd(t, nil, "--base-url", fake, "--model", "gpt-4.1-mini", "--json"); code != 3 || r.Verdict != probe.Ignored {
		t.Fatalf("probe of the upstream itself: exit %d %+v", code, r)
	}
	st, err := fakeserver.FetchStats(context.Background(), nil, fake)
	if err != nil || st.ByIdempotencyKey[gateway.KeyFor(gateway.Scope{}, r.Key)] != 1 || st.ByIdempotencyKey[r.Key] != 0 {
		t.Fatalf("upstream stats %+v %v: the gateway's probe key must reach the upstream once", st, err)
	}
	resp, err := http.Get(strings.TrimSuffix(gwURL, "/v1") + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `onceflow_gateway_requests_total{result="replayed"} 1`) || !strings.Contains(string(b), "onceflow_llm_ledger_begins_total") {
		t.Fatalf("metrics:\n%s", b)
	}
}

// SIGTERM while a call is in flight: the call completes, is recorded and answered, and
// the gateway exits 0.
func TestGatewayShutsDownGracefully(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	_, fake := startFakeLLM(t, "--latency", "1500ms")
	gw, gwURL := startGateway(t, dsn, fake)
	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		code, _, err := keyedPost(gwURL, "graceful-key-000000001")
		done <- result{code, err}
	}()
	waitInFlight(t, fake)
	gw.Signal(syscall.SIGTERM)
	r := <-done
	if r.err != nil || r.code != 200 {
		t.Fatalf("the in-flight call: %d %v", r.code, r.err)
	}
	if code := gw.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	l, _ := ledger.New(pool, ledger.Config{})
	row, err := l.Get(context.Background(), gatewayKey("graceful-key-000000001"))
	if err != nil || row.State != ledger.StateSucceeded {
		t.Fatalf("row %+v %v", row, err)
	}
}

// kill -9 of the gateway mid-call leaves an in_flight row; once its lease runs out the
// client's retry takes it over (the dead attempt counted as ambiguous). No row stays
// in_flight for ever.
func TestKilledGatewayLeavesNoRowStuck(t *testing.T) {
	t.Parallel()
	pool, dsn := testenv.Postgres(t)
	_, fake := startFakeLLM(t, "--latency", "1s")
	gw, gwURL := startGateway(t, dsn, fake, "ONCEFLOW_LEDGER_LEASE=2s")
	key := "killed-key-00000000001"
	errc := make(chan error, 1)
	go func() { _, _, err := keyedPost(gwURL, key); errc <- err }()
	waitInFlight(t, fake)
	gw.Kill()
	if err := <-errc; err == nil {
		t.Fatal("the client got an answer from a killed gateway")
	}
	l, _ := ledger.New(pool, ledger.Config{})
	if row, err := l.Get(context.Background(), gatewayKey(key)); err != nil || row.State != ledger.StateInFlight || row.Owner == "" {
		t.Fatalf("row after the kill: %+v %v", row, err)
	}
	_, gwURL = startGateway(t, dsn, fake, "ONCEFLOW_LEDGER_LEASE=2s")
	deadline := time.Now().Add(30 * time.Second)
	conflicts := 0
	for {
		code, body, err := keyedPost(gwURL, key)
		if err == nil && code == 200 {
			break
		}
		if err != nil || code != 409 || time.Now().After(deadline) {
			t.Fatalf("retry: %d %s %v", code, body, err)
		}
		conflicts++
		time.Sleep(250 * time.Millisecond)
	}
	row, _ := l.Get(context.Background(), gatewayKey(key))
	if row.State != ledger.StateSucceeded || row.Attempt != 2 || row.Ambiguous != 1 {
		t.Fatalf("row %+v (after %d conflicts)", row, conflicts)
	}
	st, _ := fakeserver.FetchStats(context.Background(), nil, fake)
	if n := st.ByIdempotencyKey[gatewayKey(key)]; n != 2 {
		t.Fatalf("upstream requests for the key: %d, want 2 (the killed one and the take-over)", n)
	}
}

func waitInFlight(t *testing.T, fake string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		st, err := fakeserver.FetchStats(context.Background(), nil, fake)
		if err == nil && st.InFlight > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no call in flight at the upstream: %+v %v", st, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS adds a header that scopes keys: two callers whose
// credentials differ only in it get two upstream calls, and each its own replay.
func TestGatewayCredentialHeadersSettingScopesKeys(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	_, fake := startFakeLLM(t)
	_, gwURL := startGateway(t, dsn, fake, "ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS=X-Custom-Key")
	post := func(credential string) (string, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, gwURL+"/chat/completions", strings.NewReader(`{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"hello"}]}`))
		req.Header.Set("Idempotency-Key", "custom-header-key-0001")
		req.Header.Set("X-Custom-Key", credential)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return string(b), resp.Header.Get("Idempotent-Replayed")
	}
	a, _ := post("alice")
	b, replayed := post("bob")
	if a == b || replayed != "" {
		t.Fatalf("bob got alice's answer (replayed %q)", replayed)
	}
	if again, replayed := post("alice"); again != a || replayed != "true" {
		t.Fatalf("alice's retry: replayed %q", replayed)
	}
	st, err := fakeserver.FetchStats(context.Background(), nil, fake)
	if err != nil || st.Requests != 2 {
		t.Fatalf("upstream requests %d %v, want 2", st.Requests, err)
	}
}

// A rolling restart of `onceflow gateway` (SIGTERM) while calls are in flight: what
// ends within ONCEFLOW_SHUTDOWN_TIMEOUT is passed on whole and recorded; what does not
// is given up as an ambiguous failure, so that a retry on another process takes it
// over at once, never a 409 until the lease (ONCEFLOW_LEDGER_LEASE) runs out.
func TestGatewayRollingRestart(t *testing.T) {
	t.Parallel()
	// A rolling restart: SIGTERM to the gateway that makes a stream, while requests on it
	// and on another gateway process follow it. The draining gateway lets the stream end
	// (within ONCEFLOW_SHUTDOWN_TIMEOUT): its client and every joiner get the whole stream,
	// the answer is recorded (the other process replays it), one upstream call, and the
	// gateway exits 0.
	t.Run("the owner's drain lets joiners finish", func(t *testing.T) {
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
	})
	// A rolling restart whose drain is shorter than the stream: the gateway gives the call
	// up at ONCEFLOW_SHUTDOWN_TIMEOUT and records it as an ambiguous failure, as documented,
	// so that the joiner on the other process is cut at once (it passed a prefix on) and
	// the client's retry there takes the call over at once (a new generation, with
	// Onceflow-Stream-Restarted), not after a 409 until the lease (15s) runs out. Holds (a
	// regression test).
	t.Run("past the drain the call is handed over at once", func(t *testing.T) {
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
	})
	// A call that outlasts ONCEFLOW_SHUTDOWN_TIMEOUT (a long generation, a slow stream) is
	// released as ambiguous when the old gateway gives it up and exits 0, as one that hits
	// ONCEFLOW_GATEWAY_TIMEOUT is: the client's retry to the new gateway takes it over at
	// once, within the OpenAI SDKs' default retries, not 409 for up to the 15s lease.
	t.Run("the calls SIGTERM gives up are released", func(t *testing.T) {
		t.Parallel()
		_, dsn := testenv.Postgres(t)
		_, fake := startFakeLLM(t, "--drip", "1") // the answer arrives one byte a second
		gw, gwURL := startGateway(t, dsn, fake, "ONCEFLOW_SHUTDOWN_TIMEOUT=1s")
		key := "rolling-restart-key-01"
		go func() { _, _, _ = keyedPost(gwURL, key) }()
		waitInFlight(t, fake)
		gw.Signal(syscall.SIGTERM)
		if code := gw.Wait(15 * time.Second); code != 0 {
			t.Fatalf("gateway exit %d", code)
		}
		_, gwURL = startGateway(t, dsn, fake)
		// The client's retry, at once. Taken over, it drips too: give it a few seconds to
		// get past the 409, not the minutes the answer takes.
		req, _ := http.NewRequest(http.MethodPost, gwURL+"/chat/completions", strings.NewReader(`{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"hello"}]}`))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Authorization", "Bearer sk-test")
		resp, err := (&http.Client{Timeout: 3 * time.Second}).Do(req)
		if err == nil {
			defer resp.Body.Close()
			if resp.StatusCode == http.StatusConflict {
				t.Fatal("the retry after a graceful restart got 409: the call the old gateway abandoned still holds its row")
			}
		}
	})
}

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

// A new user puts the gateway in front of Anthropic as docs/providers.md says ("Running
// onceflow gateway": ONCEFLOW_LLM_BASE_URL=https://api.anthropic.com/v1, "ONCEFLOW_LLM
// does not matter to it") and caps each caller at one call in flight
// (ONCEFLOW_TENANT_CONCURRENCY=1, "Limits for a whole organisation"); the Anthropic
// SDKs authenticate with x-api-key only. Two concurrent calls with the same x-api-key
// get one answer and one 429.
func TestAnthropicGatewayFromTheDocsCapsTenants(t *testing.T) {
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

// A new user who starts `onceflow gateway` on a database that `onceflow migrate` never
// ran on (docs/providers.md: "It needs PostgreSQL (ONCEFLOW_DATABASE_URL, migrated by
// onceflow migrate)") is told where an operator looks: /readyz is not 200 and names the
// migration, so that a load balancer sends it nothing, rather than 503
// ledger_unavailable "retry later" on every keyed request, which the SDKs retry and
// report as an outage.
func TestGatewayOnAnUnmigratedDatabaseIsNotReady(t *testing.T) {
	t.Parallel()
	dsn := testenv.EmptySchema(t)
	_, fake := startFakeLLM(t)
	_, v1 := startGateway(t, dsn, fake, "ONCEFLOW_SHUTDOWN_TIMEOUT=5s")
	base := strings.TrimSuffix(v1, "/v1")
	status, body := 0, ""
	for range 20 { // /readyz may take a moment to notice
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		status, body = resp.StatusCode, string(b)
		if status != http.StatusOK {
			if !strings.Contains(body, "onceflow migrate") {
				t.Fatalf("/readyz answers %d %s: it should name `onceflow migrate`", status, body)
			}
			return // holds
		}
		time.Sleep(100 * time.Millisecond)
	}
	code, answer, err := keyedPost(v1, "unmigrated-key-0001")
	t.Fatalf("on an unmigrated database the gateway started and /readyz answers %d %s; a keyed request gets %d %s (%v): "+
		"a missing schema looks like a passing outage, retried by every SDK", status, body, code, answer, err)
}
