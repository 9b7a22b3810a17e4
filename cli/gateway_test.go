package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
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
