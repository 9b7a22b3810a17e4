package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/summaries"
)

// API keys of the test tenants (ONCEFLOW_API_KEYS takes TENANT:KEY pairs).
const (
	testKeyAcme   = "acme-api-key-0123456789"
	testKeyGlobex = "globex-api-key-0123456789"
	tenantAPIKeys = "acme:" + testKeyAcme + ",globex:" + testKeyGlobex
)

// apiReply is one answer of the API.
type apiReply struct {
	code   int
	header http.Header
	body   []byte
}

// postSummary sends POST /v1/summaries; the error is a transport error (no answer).
func postSummary(ctx context.Context, client *http.Client, base, apiKey, idemKey, body string) (apiReply, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/summaries", strings.NewReader(body))
	if err != nil {
		return apiReply{}, err
	}
	req.Header.Set("Authorization", "Bearer "+apiKey)
	req.Header.Set("Idempotency-Key", idemKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return apiReply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return apiReply{}, err
	}
	return apiReply{resp.StatusCode, resp.Header, b}, nil
}

// httpGet returns the status and body of GET url, with apiKey as bearer when set.
func httpGet(t *testing.T, url, apiKey string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func summaryBody(text string) string {
	return string(summaries.Request{Text: text, Notify: "team@example.com"}.Canonical())
}

// `onceflow run` is serve, work and relay in one process: a POSTed job ends with its
// email at the webhook, /metrics shows every role's families, and SIGTERM exits 0.
func TestRunServesWorksAndRelays(t *testing.T) {
	t.Parallel()
	_, prefix := testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	sink := webhooksink.New(webhooksink.Options{})
	hook := httptest.NewServer(sink)
	t.Cleanup(hook.Close)
	p := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_LLM=fake",
		"ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + hook.URL, "ONCEFLOW_RELAY_INTERVAL=50ms",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=10s",
	}, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	base := fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])

	r, err := postSummary(ctx, http.DefaultClient, base, testKeyAcme, "run-test-key-000001", summaryBody("Launch review: shipped on time."))
	if err != nil || r.code != http.StatusAccepted {
		t.Fatalf("POST: %v %d %s", err, r.code, r.body)
	}
	var accepted struct {
		JobID string `json:"job_id"`
	}
	if err := json.Unmarshal(r.body, &accepted); err != nil || accepted.JobID == "" {
		t.Fatalf("POST body %s: %v", r.body, err)
	}
	key := summaries.DedupeKey(accepted.JobID)
	testenv.WaitFor(t, 20*time.Second, "the email at the webhook", func() bool { return sink.Count(key) == 1 })
	testenv.WaitFor(t, 5*time.Second, "the row marked sent", func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE dedupe_key = $1 AND sent_at IS NOT NULL`, key).Scan(&n)
		return n == 1
	})
	code, body := httpGet(t, base+"/v1/summaries/"+accepted.JobID, testKeyAcme)
	if code != 200 || !strings.Contains(body, `"status":"done"`) || !strings.Contains(body, `"summary":`) {
		t.Fatalf("GET: %d %s, want done with the summary", code, body)
	}
	if code, body := httpGet(t, base+"/readyz", ""); code != 200 {
		t.Fatalf("/readyz %d %s", code, body)
	}

	code, metrics := httpGet(t, base+"/metrics", "")
	if code != 200 {
		t.Fatalf("/metrics %d", code)
	}
	for _, want := range []string{
		`onceflow_http_requests_total{code="202",route="/v1/summaries"} 1`,
		`onceflow_idempotency_requests_total{outcome="new"} 1`,
		`onceflow_queue_deliveries_total{queue="summaries"} 1`,
		`onceflow_queue_acks_total{queue="summaries"} 1`,
		`onceflow_llm_calls_total{outcome="ok",provider="fake"} 1`,
		`onceflow_llm_retries_total{`,
		`onceflow_outbox_sent_total 1`,
		`onceflow_outbox_claimed_batches_total `,
		`onceflow_build_info{`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if t.Failed() {
		t.Logf("/metrics:\n%s", metrics)
	}

	p.Signal(syscall.SIGTERM)
	if code := p.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	if !strings.Contains(p.Stderr(), `"msg":"run stopped"`) {
		t.Errorf("no clean stop logged")
	}
	if st := sink.Stats(); st.Deliveries != 1 {
		t.Fatalf("%d deliveries, want 1", st.Deliveries)
	}
}
