package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

// Real processes (fake-llm, serve, work, relay, and a work with a wrong Redis password)
// run with known secret values configured and exercised: API keys, a wrong bearer key,
// Idempotency-Keys (the same one from two tenants), a Redis password against a Redis
// with requirepass (and a wrong one), a PostgreSQL password, a provider key, a webhook
// URL with a password and a token that answers 503 and 400, an OTLP endpoint with a
// password and an exporter header that cannot be reached, Redis going down and coming
// back. None of the secret strings may appear in any log or in /readyz; every log line
// about a job carries job_id and tenant.
func TestSecretsNeverReachTheLogsAndJobLinesNameJobAndTenant(t *testing.T) {
	t.Parallel()
	const (
		redisPW   = "redis-pw-S3CRET-7f1c"
		wrongPW   = "wrong-redis-pw-S3CRET-0b2e"
		pgPW      = "pg-pw-S3CRET-91aa"
		openaiKey = "sk-openai-S3CRET-5d77"
		acmeKey   = "acme-api-key-S3CRET-4e21"
		globexKey = "globex-api-key-S3CRET-c3d0"
		badKey    = "unknown-api-key-S3CRET-a9f8"
		hookPW    = "hook-pw-S3CRET-11fe"
		hookToken = "hook-token-S3CRET-62bd"
		otelPW    = "otel-pw-S3CRET-08c4"
		otelToken = "otel-header-S3CRET-d1d9"
	)
	idemKeys := []string{"idem-key-S3CRET-shared-0001", "idem-key-S3CRET-acme-00002", "idem-key-S3CRET-toolong-003", "idem-key-S3CRET-down-000004"}
	secrets := append([]string{redisPW, wrongPW, pgPW, openaiKey, acmeKey, globexKey, badKey, hookPW, hookToken, otelPW, otelToken}, idemKeys...)

	// Redis of its own, with a password.
	rsrv := testenv.PrivateRedis(t)
	admin := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", rsrv.Port())})
	if err := admin.ConfigSet(context.Background(), "requirepass", redisPW).Err(); err != nil {
		t.Fatal(err)
	}
	admin.Close()
	redisURL := fmt.Sprintf("redis://:%s@127.0.0.1:%d/0", redisPW, rsrv.Port())
	wrongURL := fmt.Sprintf("redis://:%s@127.0.0.1:%d/0", wrongPW, rsrv.Port())
	_, dsn := testenv.Postgres(t)
	u, _ := url.Parse(dsn)
	u.User = url.UserPassword(u.User.Username(), pgPW) // the test server trusts; the password is only carried
	dsn = u.String()

	// A webhook with a password and a token: 503 on each key's first delivery, then 200;
	// 400 (exhausted) for one recipient.
	var mu sync.Mutex
	seen := map[string]int{}
	statuses := map[int]int{}
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		key := r.Header.Get("Idempotency-Key")
		seen[key]++
		code := http.StatusOK
		switch {
		case bytes.Contains(body, []byte("reject@example.com")):
			code = http.StatusBadRequest
		case seen[key] == 1:
			code = http.StatusServiceUnavailable
		}
		statuses[code]++
		w.WriteHeader(code)
	}))
	t.Cleanup(hook.Close)
	hookURL := strings.Replace(hook.URL, "http://", "http://hook:"+hookPW+"@", 1) + "/hook?token=" + hookToken

	bin := testenv.Binary(t)
	llm := testenv.Start(t, bin, nil, "fake-llm", "--addr", "127.0.0.1:0", "--fail-429", "0.3", "--retry-after", "0",
		"--fail-503", "0.2", "--max-input-chars", "500", "--seed", "7")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	llmBase := fmt.Sprint(llm.WaitLog(ctx, "fake-llm listening")["base_url"])

	env := []string{"ONCEFLOW_REDIS_URL=" + redisURL, "ONCEFLOW_DATABASE_URL=" + dsn,
		"ONCEFLOW_API_KEYS=acme:" + acmeKey + ",globex:" + globexKey, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0",
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + llmBase, "OPENAI_API_KEY=" + openaiKey, "ONCEFLOW_LLM_MAX_ATTEMPTS=2",
		"ONCEFLOW_CLAIM_IDLE=1s", "ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + hookURL, "ONCEFLOW_RELAY_INTERVAL=50ms",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=5s", "ONCEFLOW_METRICS_ADDR=127.0.0.1:0",
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://otel:" + otelPW + "@127.0.0.1:1", "OTEL_EXPORTER_OTLP_HEADERS=x-api-key=" + otelToken,
		"OTEL_BSP_SCHEDULE_DELAY=200", "OTEL_EXPORTER_OTLP_TIMEOUT=500"}
	serve := testenv.Start(t, bin, env, "serve")
	work := testenv.Start(t, bin, env, "work")
	relay := testenv.Start(t, bin, env, "relay")
	base := "http://" + fmt.Sprint(serve.WaitLog(ctx, "http listening")["addr"])
	work.WaitLog(ctx, "worker started")
	wrong := testenv.Start(t, bin, append(append([]string{}, env...), "ONCEFLOW_REDIS_URL="+wrongURL), "work")

	post := func(key, idem, body string) int {
		t.Helper()
		req, _ := http.NewRequest("POST", base+"/v1/summaries", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Idempotency-Key", idem)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	var readyz []string
	getReadyz := func() {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		readyz = append(readyz, string(b))
	}
	body := func(text, to string) string { return fmt.Sprintf(`{"text":%q,"notify":%q}`, text, to) }
	for _, c := range []struct {
		key, idem, body string
		want            int
	}{
		{acmeKey, idemKeys[0], body("acme's text", "a@example.com"), 202},
		{globexKey, idemKeys[0], body("globex's text", "g@example.com"), 202}, // the same key, another tenant
		{acmeKey, idemKeys[0], body("acme's text", "a@example.com"), 202},     // replay
		{acmeKey, idemKeys[0], body("another text", "a@example.com"), 422},
		{badKey, idemKeys[1], body("x", "a@example.com"), 401},
		{acmeKey, idemKeys[1], body("a text for a rejecting inbox", "reject@example.com"), 202},
		{acmeKey, idemKeys[2], body(strings.Repeat("far too long ", 80), "a@example.com"), 202},
		{acmeKey, "short", body("x", "a@example.com"), 400},
	} {
		if got := post(c.key, c.idem, c.body); got != c.want {
			t.Errorf("POST %s: %d, want %d", c.idem, got, c.want)
		}
	}
	testenv.WaitFor(t, 40*time.Second, "the webhook deliveries (503 then 200 for two jobs, 400 for one)", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return statuses[http.StatusOK] >= 2 && statuses[http.StatusBadRequest] >= 1
	})
	getReadyz()

	// Redis goes away: errors everywhere, a 503 to a client, readyz names redis.
	rsrv.Stop()
	if got := post(acmeKey, idemKeys[3], body("while redis is down", "a@example.com")); got != http.StatusServiceUnavailable {
		t.Errorf("POST with redis down: %d, want 503", got)
	}
	getReadyz()
	if !strings.Contains(readyz[1], `"redis":"unavailable`) {
		t.Errorf("readyz with redis down: %s", readyz[1])
	}
	time.Sleep(1500 * time.Millisecond) // let the workers fail and log
	rsrv.Start()
	a2 := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", rsrv.Port())})
	_ = a2.ConfigSet(context.Background(), "requirepass", redisPW).Err() // a restart forgets CONFIG SET
	a2.Close()
	testenv.WaitFor(t, 20*time.Second, "readyz again", func() bool {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})

	for _, p := range []*testenv.Process{serve, work, relay, wrong, llm} {
		p.Signal(syscall.SIGTERM)
		if code := p.Wait(20 * time.Second); code != 0 {
			t.Errorf("exit %d after SIGTERM", code)
		}
	}

	procs := map[string]*testenv.Process{"serve": serve, "work": work, "relay": relay, "work with a wrong password": wrong, "fake-llm": llm}
	var all strings.Builder
	for name, p := range procs {
		out := p.Stderr() + p.Stdout()
		all.WriteString(out)
		for _, s := range secrets {
			if strings.Contains(out, s) {
				t.Errorf("%s logged the secret %q", name, s)
			}
		}
	}
	for _, body := range readyz {
		for _, s := range secrets {
			if strings.Contains(body, s) {
				t.Errorf("/readyz shows the secret %q: %s", s, body)
			}
		}
	}
	if !strings.Contains(wrong.Stderr(), "WRONGPASS") && !strings.Contains(wrong.Stderr(), "invalid password") {
		t.Errorf("the worker with a wrong password logged no authentication error: nothing was exercised")
	}
	if !strings.Contains(all.String(), "opentelemetry") {
		t.Errorf("no exporter error was logged: the OTLP endpoint's secrets were not exercised")
	}

	// Every line about a job names the job and its tenant.
	jobLines := map[string]int{}
	for name, p := range procs {
		for _, line := range strings.Split(p.Stderr(), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(line), &m) != nil {
				continue
			}
			_, hasJob := m["job_id"]
			_, hasKey := m["dedupe_key"]
			_, hasEntry := m["entry"]
			if !hasJob && !hasKey && !hasEntry {
				continue
			}
			jobLines[name]++
			if m["job_id"] == nil || m["job_id"] == "" || m["tenant"] == nil || m["tenant"] == "" {
				t.Errorf("%s: a line about a job lacks job_id or tenant: %s", name, line)
			}
		}
	}
	for _, name := range []string{"work", "relay"} {
		if jobLines[name] == 0 {
			t.Errorf("%s logged no line about a job: nothing checked", name)
		}
	}
}
