package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/migrations"
)

const testAPIKeys = "ONCEFLOW_API_KEYS=acme:test-key-acme-0123456789"

func TestUsageAndConfigErrorsExit2(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	cases := []struct {
		env      []string
		args     []string
		code     int
		contains string
	}{
		{[]string{"ONCEFLOW_CLAIM_IDLE=abc", testAPIKeys}, []string{"serve"}, 2, `invalid ONCEFLOW_CLAIM_IDLE="abc"`},
		{nil, []string{"serve", "--claim-idle", "abc"}, 2, `invalid --claim-idle="abc"`},
		{nil, []string{"serve"}, 2, "ONCEFLOW_API_KEYS"},
		{[]string{"ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS=X-Key,bad header"}, []string{"gateway"}, 2, `invalid ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS="X-Key,bad header"`},
		{nil, []string{"migrate", "--no-such-flag"}, 2, "flag provided but not defined"},
		{nil, []string{"no-such-command"}, 2, `unknown command "no-such-command"`},
		{nil, nil, 2, "missing command"},
		{nil, []string{"help"}, 0, ""},
		{nil, []string{"serve", "-h"}, 0, "-api-keys"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			p := testenv.Start(t, bin, tc.env, tc.args...)
			if code := p.Wait(10 * time.Second); code != tc.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, tc.code, p.Stderr())
			}
			if tc.code == 2 && strings.Count(strings.TrimSpace(p.Stderr()), "\n") > 0 && !strings.Contains(tc.contains, "flag") {
				t.Errorf("error is not one line:\n%s", p.Stderr())
			}
			if !strings.Contains(p.Stderr(), tc.contains) {
				t.Fatalf("stderr does not contain %q:\n%s", tc.contains, p.Stderr())
			}
		})
	}
}

func TestVersionPrintsTheVersionAndTheGoVersion(t *testing.T) {
	t.Parallel()
	p := testenv.Start(t, testenv.Binary(t), nil, "version")
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if !strings.HasPrefix(p.Stdout(), "onceflow ") || !strings.Contains(p.Stdout(), "go1.") {
		t.Fatalf("version output %q", p.Stdout())
	}
}

func TestFourConcurrentMigrateProcesses(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	dsn := testenv.EmptySchema(t)
	var procs []*testenv.Process
	for range 4 {
		procs = append(procs, testenv.Start(t, bin, []string{"ONCEFLOW_DATABASE_URL=" + dsn}, "migrate"))
	}
	var latest string // every process reports the same, latest, version
	for i, p := range procs {
		if code := p.Wait(60 * time.Second); code != 0 {
			t.Errorf("migrate %d exit %d:\n%s", i, code, p.Stderr())
		}
		if i == 0 {
			latest = p.Stdout()
		}
		if !strings.HasPrefix(p.Stdout(), "schema at version ") || p.Stdout() != latest {
			t.Errorf("migrate %d stdout %q, migrate 0 %q", i, p.Stdout(), latest)
		}
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var tables, versions int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables
		WHERE table_schema = current_schema() AND table_name IN ('summaries', 'outbox', 'llm_calls')`).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+migrations.VersionTable+` WHERE version_id = 1`).Scan(&versions); err != nil {
		t.Fatal(err)
	}
	var applied, distinct int
	if err := conn.QueryRow(ctx, `SELECT count(*), count(DISTINCT version_id) FROM `+migrations.VersionTable+` WHERE version_id > 0`).Scan(&applied, &distinct); err != nil {
		t.Fatal(err)
	}
	if tables != 3 || versions != 1 || applied != distinct || fmt.Sprintf("schema at version %d\n", distinct) != latest {
		t.Fatalf("tables = %d (want 3), version 1 recorded %d times (want 1), %d migrations recorded for %d versions (reported %q)",
			tables, versions, applied, distinct, latest)
	}
}

// startServe runs `onceflow serve` on a free port and returns the process and base URL.
func startServe(t *testing.T, env ...string) (*testenv.Process, string) {
	t.Helper()
	env = append([]string{testAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s"}, env...)
	p := testenv.Start(t, testenv.Binary(t), env, "serve")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	line := p.WaitLog(ctx, "http listening")
	return p, "http://" + fmt.Sprint(line["addr"])
}

// awaitReady waits for base's /readyz to answer 200, as a readiness probe retries: a
// process just started may not have its first store connections yet, and on a loaded
// machine the first may take longer than the check's own timeout.
func awaitReady(t *testing.T, base string) {
	t.Helper()
	testenv.WaitFor(t, 20*time.Second, "/readyz 200 with the stores up", func() bool {
		code, _, _ := getJSON(t, base+"/readyz")
		return code == http.StatusOK
	})
}

func getJSON(t *testing.T, url string) (int, map[string]any, time.Duration) {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	start := time.Now()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	var body map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatalf("GET %s: decode: %v", url, err)
	}
	return resp.StatusCode, body, time.Since(start)
}

func TestReadyzFollowsRedisWithoutRestart(t *testing.T) {
	t.Parallel()
	redisSrv := testenv.PrivateRedis(t)
	_, dsn := testenv.Postgres(t)
	_, base := startServe(t, "ONCEFLOW_REDIS_URL="+testenv.RedisURLOf(redisSrv), "ONCEFLOW_DATABASE_URL="+dsn)

	awaitReady(t, base)
	redisSrv.Stop()
	code, body, took := getJSON(t, base+"/readyz")
	if code != http.StatusServiceUnavailable {
		t.Fatalf("readyz with redis stopped: %d %v", code, body)
	}
	if took > 2*time.Second {
		t.Errorf("readyz took %v with redis stopped, want within 2s", took)
	}
	checks, _ := body["checks"].(map[string]any)
	if !strings.HasPrefix(fmt.Sprint(checks["redis"]), "unavailable") || checks["postgres"] != "ok" {
		t.Errorf("checks = %v, want redis unavailable and postgres ok", checks)
	}
	if code, _, _ := getJSON(t, base+"/healthz"); code != 200 {
		t.Errorf("healthz with redis stopped: %d", code)
	}
	redisSrv.Start()
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body, _ := getJSON(t, base+"/readyz")
		if code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("readyz still %d %v after redis restarted", code, body)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestReadyzReportsPostgresDown(t *testing.T) {
	t.Parallel()
	pg := testenv.PrivatePostgres(t)
	_, base := startServe(t, "ONCEFLOW_REDIS_URL="+testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL="+testenv.PostgresURLOf(pg))
	awaitReady(t, base)
	pg.Stop()
	code, body, took := getJSON(t, base+"/readyz")
	checks, _ := body["checks"].(map[string]any)
	if code != 503 || !strings.HasPrefix(fmt.Sprint(checks["postgres"]), "unavailable") || checks["redis"] != "ok" {
		t.Fatalf("readyz with postgres stopped: %d %v", code, body)
	}
	if took > 2*time.Second {
		t.Errorf("readyz took %v with postgres stopped, want within 2s", took)
	}
}

func TestServeMetricsAndGracefulShutdown(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	p, base := startServe(t, "ONCEFLOW_REDIS_URL="+testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL="+dsn)
	getJSON(t, base+"/healthz")
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	buf := make([]byte, 32*1024)
	for {
		n, err := resp.Body.Read(buf)
		sb.Write(buf[:n])
		if err != nil {
			break
		}
	}
	resp.Body.Close()
	for _, want := range []string{`onceflow_build_info{`, `onceflow_http_requests_total{code="200",route="/healthz"} 1`, "go_goroutines"} {
		if !strings.Contains(sb.String(), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	// SIGTERM on an idle server: a clean exit 0. (A request in flight at the signal is
	// drained: TestServeSIGTERMDrainsTheRequestInFlight in shutdown_test.go.)
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	if !strings.Contains(p.Stderr(), `"msg":"serve stopped"`) {
		t.Errorf("no clean stop logged:\n%s", p.Stderr())
	}
}

// The summaries routes as the binary serves them: their statuses' series at zero before
// the first request, each request counted under its route's pattern, the API's 401 byte
// for byte (both routes), 405 with Allow for the other method, and no route label for a
// path no route has.
func TestServeSummariesRoutesMetricsAnd401(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	_, prefix := testenv.Redis(t)
	p, base := startServe(t, "ONCEFLOW_REDIS_URL="+testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL="+dsn, "ONCEFLOW_PREFIX="+prefix)
	const post, get = `route="/v1/summaries"`, `route="/v1/summaries/{job_id}"`
	series := func() map[string]float64 {
		m, _ := scrape(t, base+"/metrics")
		return m
	}
	fresh := series()
	for _, s := range []string{
		`onceflow_http_requests_total{code="202",` + post + `}`, `onceflow_http_requests_total{code="401",` + post + `}`,
		`onceflow_http_requests_total{code="503",` + post + `}`, `onceflow_http_requests_total{code="200",` + get + `}`,
		`onceflow_http_requests_total{code="404",` + get + `}`, `onceflow_http_requests_total{code="503",` + get + `}`,
	} {
		if v, ok := fresh[s]; !ok || v != 0 {
			t.Errorf("fresh serve: %s = %v (present %v), want 0", s, v, ok)
		}
	}

	const want401 = `{"detail":"missing or unknown API key (Authorization: Bearer KEY)"}` + "\n"
	for _, req := range []*http.Request{
		func() *http.Request {
			r, _ := http.NewRequest(http.MethodPost, base+"/v1/summaries", strings.NewReader(`{"text":"x","notify":"a@example.com"}`))
			r.Header.Set("Idempotency-Key", "serve-401-key-000001")
			r.Header.Set("Content-Type", "application/json")
			return r
		}(),
		func() *http.Request {
			r, _ := http.NewRequest(http.MethodGet, base+"/v1/summaries/6f1c2d3e-0000-5000-8000-000000000000", nil)
			r.Header.Set("Authorization", "Bearer nobody-0123456789abcdef")
			return r
		}(),
	} {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 401 || string(body) != want401 || resp.Header.Get("WWW-Authenticate") != `Bearer realm="onceflow"` ||
			resp.Header.Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d %q %v, want 401 %q", req.Method, req.URL.Path, resp.StatusCode, body, resp.Header, want401)
		}
	}
	if code, body := httpGet(t, base+"/v1/summaries", testKeyAcme); code != http.StatusMethodNotAllowed || !strings.Contains(body, `"detail"`) {
		t.Errorf("GET /v1/summaries: %d %s, want 405 with a JSON detail", code, body)
	}
	if code, _ := httpGet(t, base+"/nowhere", testKeyAcme); code != http.StatusNotFound {
		t.Errorf("GET /nowhere: %d, want 404", code)
	}
	after := series()
	for s, want := range map[string]float64{
		`onceflow_http_requests_total{code="401",` + post + `}`: 1,
		`onceflow_http_requests_total{code="401",` + get + `}`:  1,
	} {
		if after[s] != want {
			t.Errorf("%s = %v, want %v", s, after[s], want)
		}
	}
	for s := range after {
		if strings.Contains(s, "nowhere") || strings.Contains(s, `route="workflows"`) || strings.Contains(s, `route="/"`) {
			t.Errorf("unexpected route label: %s", s)
		}
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
}
