package gatewaybench

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// TestGatewayBench is `make bench-gateway`: the gateway's overhead against direct calls
// to fake-llm (latency at concurrency 1; throughput at 16 against an upstream that
// answers at once, beside a bare reverse proxy's, and at 64 against one that takes a
// model's 200 ms) for keyed unary, keyed streaming and keyless requests, then joiners
// of live streams on the same and on another gateway process; about 10 minutes on two
// cores. It runs only with
// ONCEFLOW_GATEWAY_BENCH=1 (so `make test` skips it at once). It builds ./cmd/onceflow
// without test tags, unless GATEWAY_BENCH_BIN names a binary. Knobs:
// GATEWAY_BENCH_MODES (comma-separated AllModes, or none), _PAIRS, _ROUNDS, _DURATION,
// _CONCURRENCY, _TRIALS (0: no join measurement), _UPSTREAM_LATENCY, _MODEL_LATENCY
// (negative: no measurement against a model-like upstream), _MODEL_CONCURRENCY, _GATEWAY_ENV
// (space-separated NAME=VALUE settings of the gateway processes). It prints the
// report and fails when an invariant is broken (a failed request, a joiner that did not
// get the first request's bytes); targets missed are in the report. The processes'
// logs stay in the folder it names when it fails, or always with
// GATEWAY_BENCH_KEEP_LOGS=1.
func TestGatewayBench(t *testing.T) {
	if os.Getenv("ONCEFLOW_GATEWAY_BENCH") != "1" {
		t.Skip("set ONCEFLOW_GATEWAY_BENCH=1 to run the gateway benchmark (make bench-gateway)")
	}
	dir, err := os.MkdirTemp("", "onceflow-gatewaybench-")
	if err != nil {
		t.Fatal(err)
	}
	bin := os.Getenv("GATEWAY_BENCH_BIN")
	if bin == "" {
		bin = build(t, dir)
	}
	cfg := Config{Bin: bin, Dir: dir, DatabaseURL: testenv.DatabaseURL(t), Log: testWriter{t},
		LatencyPairs: envInt(t, "GATEWAY_BENCH_PAIRS"), Rounds: envInt(t, "GATEWAY_BENCH_ROUNDS"),
		Concurrency: envInt(t, "GATEWAY_BENCH_CONCURRENCY"), JoinTrials: envInt(t, "GATEWAY_BENCH_TRIALS"),
		RunDuration: envDuration(t, "GATEWAY_BENCH_DURATION"), UpstreamLatency: envDuration(t, "GATEWAY_BENCH_UPSTREAM_LATENCY"),
		ModelLatency: envDuration(t, "GATEWAY_BENCH_MODEL_LATENCY"), ModelConcurrency: envInt(t, "GATEWAY_BENCH_MODEL_CONCURRENCY"),
		ProxyBin: buildProxy(t, dir)}
	if v, ok := os.LookupEnv("GATEWAY_BENCH_TRIALS"); ok && v == "0" {
		cfg.JoinTrials = -1
	}
	switch v := os.Getenv("GATEWAY_BENCH_MODES"); v {
	case "":
	case "none":
		cfg.Modes = []string{}
	default:
		cfg.Modes = strings.Split(v, ",")
	}
	if v := os.Getenv("GATEWAY_BENCH_GATEWAY_ENV"); v != "" {
		cfg.GatewayEnv = strings.Fields(v)
	}
	rep, err := Run(context.Background(), cfg)
	if rep != nil {
		t.Log("\n" + rep.String())
	}
	if err != nil {
		t.Fatalf("the benchmark could not complete: %v (logs in %s)", err, dir)
	}
	if v := rep.Violations(); len(v) > 0 {
		t.Fatalf("invariants broken (logs in %s):\n- %s", dir, strings.Join(v, "\n- "))
	}
	if os.Getenv("GATEWAY_BENCH_KEEP_LOGS") == "1" {
		t.Logf("logs in %s", dir)
		return
	}
	_ = os.RemoveAll(dir)
}

// build builds ./cmd/onceflow as released (no test tags) into dir.
func build(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "onceflow")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/onceflow") // #nosec G204 -- a temporary path of our own
	cmd.Dir = filepath.Join("..", "..")                             // the test runs in lab/gatewaybench
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/onceflow: %v\n%s", err, out)
	}
	return bin
}

// buildProxy builds the reference proxy (./lab/gatewaybench/bareproxy) into dir.
func buildProxy(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "bareproxy")
	cmd := exec.Command("go", "build", "-o", bin, "./bareproxy") // #nosec G204 -- a temporary path of our own
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./lab/gatewaybench/bareproxy: %v\n%s", err, out)
	}
	return bin
}

func envInt(t *testing.T, name string) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return n
}

func envDuration(t *testing.T, name string) time.Duration {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return d
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// A joiner's catch-up is when it first holds the bytes the first request had when it
// was sent, and each later byte's lag is how much after the first request it got it.
func TestTimelines(t *testing.T) {
	t.Parallel()
	ms := func(v int) time.Duration { return time.Duration(v) * time.Millisecond }
	var first, joiner timeline
	for i, n := range []int{2, 2, 2, 2} { // bytes 0-1 at 10ms, 2-3 at 20ms, ...
		first.add(ms(10*(i+1)), n)
	}
	joiner.add(ms(25), 4) // the 4 bytes so far at once, at 25ms
	joiner.add(ms(32), 3) // bytes 4-6
	joiner.add(ms(45), 1) // byte 7
	if got, ok := joiner.reached(4); !ok || got != ms(25) {
		t.Errorf("reached(4) = %v, %v; want 25ms", got, ok)
	}
	if got, ok := joiner.reached(5); !ok || got != ms(32) {
		t.Errorf("reached(5) = %v, %v; want 32ms", got, ok)
	}
	if _, ok := joiner.reached(9); ok {
		t.Error("reached(9) of 8 bytes")
	}
	// Bytes 4-5 came to the first at 30ms, 6-7 at 40ms.
	want := []time.Duration{ms(2), ms(2), ms(-8), ms(5)}
	if got := lags(&first, &joiner, 4); !slices.Equal(got, want) {
		t.Errorf("lags = %v, want %v", got, want)
	}
	if got := quantile([]time.Duration{1, 2, 3, 4}, 0.5); got != 2 {
		t.Errorf("p50 of 1..4 = %v, want 2 (nearest rank)", got)
	}
	if got := quantile([]time.Duration{1, 2, 3, 4}, 0.99); got != 4 {
		t.Errorf("p99 of 1..4 = %v, want 4", got)
	}
}

// The gateway's ledger commits are read from its /metrics: the count of its group
// transactions; a process that records nothing is not asked, and a gateway whose
// metrics lack the series is an error, not zero commits.
func TestLedgerCommitsReadsTheGatewaysGroupTransactions(t *testing.T) {
	t.Parallel()
	var metrics atomic.Value
	metrics.Store("# TYPE onceflow_llm_ledger_group_writes histogram\n" +
		"onceflow_llm_ledger_group_writes_bucket{le=\"1\"} 3\n" +
		"onceflow_llm_ledger_group_writes_sum 41\n" +
		"onceflow_llm_ledger_group_writes_count 12\n")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, metrics.Load())
	}))
	t.Cleanup(srv.Close)
	ctx := context.Background()
	if n, err := ledgerCommits(ctx, srv.Client(), srv.URL, true); err != nil || n != 12 {
		t.Fatalf("ledgerCommits = %d, %v; want 12", n, err)
	}
	if n, err := ledgerCommits(ctx, srv.Client(), "http://127.0.0.1:1", false); err != nil || n != 0 {
		t.Fatalf("ledgerCommits of a process that records nothing = %d, %v; want 0 without asking", n, err)
	}
	metrics.Store("onceflow_http_requests_total 3\n")
	if _, err := ledgerCommits(ctx, srv.Client(), srv.URL, true); err == nil {
		t.Fatal("metrics without the ledger's group series read as zero commits")
	}
	rs := &ThroughputResult{Rounds: []Round{{Gateway: RunResult{Requests: 100, Commits: 50}}, {Gateway: RunResult{Requests: 100, Commits: 70}}, {Gateway: RunResult{Requests: 100, Commits: 60}}}}
	if got := commitsText(rs); got != "0.60" {
		t.Fatalf("commits per request %s, want the median 0.60", got)
	}
	if got := commitsText(&ThroughputResult{Rounds: []Round{{Gateway: RunResult{Requests: 100}}}}); got != "–" {
		t.Fatalf("commits per request through a process that records nothing: %s, want –", got)
	}
}
