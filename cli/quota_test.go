package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/summaries"
)

// An exhausted quota under `onceflow run`: the job is not dead-lettered, /readyz stays
// 200 and names the stopped provider, the breaker metrics and an error log say so, and
// when the quota is back the job completes with one email.
func TestRunQuotaStopIsReportedAndSpendsNothing(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	sink := webhooksink.New(webhooksink.Options{})
	hook := httptest.NewServer(sink)
	t.Cleanup(hook.Close)
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	var exhausted atomic.Bool
	var refused atomic.Int64
	exhausted.Store(true)
	model := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/chat/completions" && exhausted.Load() {
			refused.Add(1)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprint(w, `{"error":{"message":"You exceeded your current quota.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}`)
			return
		}
		fs.ServeHTTP(w, r)
	}))
	t.Cleanup(model.Close)

	p := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0",
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + model.URL + "/v1", "OPENAI_API_KEY=sk-test-quota",
		"ONCEFLOW_LLM_QUOTA_PROBE=300ms", "ONCEFLOW_CLAIM_IDLE=300ms", "ONCEFLOW_MAX_DELIVERIES=1",
		"ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + hook.URL, "ONCEFLOW_RELAY_INTERVAL=50ms",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=10s",
	}, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	base := fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])

	r, err := postSummary(ctx, http.DefaultClient, base, testKeyAcme, "quota-test-key-00001", summaryBody("Quarterly numbers, to summarise."))
	if err != nil || r.code != http.StatusAccepted {
		t.Fatalf("POST: %v %d %s", err, r.code, r.body)
	}
	var accepted struct {
		JobID string `json:"job_id"`
	}
	if err := json.Unmarshal(r.body, &accepted); err != nil {
		t.Fatal(err)
	}
	if l := p.WaitLog(ctx, "dependency unavailable: stopped calling it and taking work that needs it, until a probe succeeds"); l["level"] != "ERROR" || l["dependency"] != "llm" {
		t.Fatalf("stop logged as %v, want an ERROR naming the llm", l)
	}
	var ready struct {
		Status string            `json:"status"`
		Checks map[string]string `json:"checks"`
	}
	code, body := httpGet(t, base+"/readyz", "")
	if err := json.Unmarshal([]byte(body), &ready); err != nil || code != 200 || ready.Status != "degraded" ||
		!strings.Contains(ready.Checks["llm"], "unavailable since") || !strings.Contains(ready.Checks["llm"], "insufficient_quota") {
		t.Fatalf("/readyz during the stop: %d %s, want 200 degraded naming the llm and the quota", code, body)
	}
	_, metrics := httpGet(t, base+"/metrics", "")
	if !strings.Contains(metrics, `onceflow_breaker_open{dependency="llm"} 1`) {
		t.Fatalf("/metrics lacks the open breaker:\n%s", grepLines(metrics, "breaker"))
	}
	// With MaxDeliveries 1, a delivery spent by the stop would dead-letter the job at
	// once; let several probe and claim periods pass.
	time.Sleep(2 * time.Second)
	if n := rdb.XLen(ctx, prefix+":{summaries}:dead").Val(); n != 0 {
		t.Fatalf("%d dead letters during the quota stop", n)
	}
	if code, body := httpGet(t, base+"/v1/summaries/"+accepted.JobID, testKeyAcme); code != 200 || !strings.Contains(body, `"status":"queued"`) {
		t.Fatalf("GET during the stop: %d %s, want queued", code, body)
	}
	if strings.Contains(p.Stderr(), "sk-test-quota") {
		t.Fatal("the provider key reached the logs")
	}

	exhausted.Store(false)
	key := summaries.DedupeKey(accepted.JobID)
	testenv.WaitFor(t, 30*time.Second, "the email once the quota is back", func() bool { return sink.Count(key) == 1 })
	code, body = httpGet(t, base+"/readyz", "")
	if code != 200 || !strings.Contains(body, `"status":"ok"`) || !strings.Contains(body, `"llm":"ok"`) {
		t.Fatalf("/readyz after the stop: %d %s", code, body)
	}
	if n := refused.Load(); n < 1 || n > 12 {
		t.Fatalf("the provider refused %d calls; want the first and a few probes", n)
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	if st := sink.Stats(); st.Deliveries != 1 {
		t.Fatalf("%d emails, want 1", st.Deliveries)
	}
}

// grepLines returns the lines of s containing sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
