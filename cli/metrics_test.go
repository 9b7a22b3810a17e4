package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// scrape returns the samples of a /metrics page by series ("name{labels}", labels as
// Prometheus prints them, sorted) and the metric families it declares.
func scrape(t *testing.T, url string) (map[string]float64, []string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	samples := map[string]float64{}
	var families []string
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if f, ok := strings.CutPrefix(line, "# TYPE "); ok {
			families = append(families, strings.Fields(f)[0])
			continue
		}
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad sample %q", line)
		}
		samples[line[:i]] = v
	}
	return samples, families
}

// documentedMetrics returns the metric names docs/operations.md's tables list.
func documentedMetrics(t *testing.T) []string {
	t.Helper()
	doc, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range regexp.MustCompile("(?m)^\\| `(onceflow_[a-z_]+)`").FindAllStringSubmatch(string(doc), -1) {
		names = append(names, m[1])
	}
	return names
}

// A fresh `onceflow run` shows every onceflow family, every counter at zero, before its
// first event, and its /metrics lists exactly the metrics docs/operations.md documents.
// Then a small run with scripted faults moves each family as expected: one /metrics for
// the three roles.
func TestRunMetricsFreshAtZeroThenEachFamilyMoves(t *testing.T) {
	t.Parallel()
	model, err := fakeserver.New(fakeserver.Config{MaxInputChars: 400, RetryAfter: time.Second, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	llmSrv := httptest.NewServer(model)
	t.Cleanup(func() { model.Close(); llmSrv.Close() })

	var mu sync.Mutex
	seen := map[string]int{}
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		seen[r.Header.Get("Idempotency-Key")]++
		switch {
		case bytes.Contains(body, []byte("reject@example.com")):
			w.WriteHeader(http.StatusBadRequest)
		case seen[r.Header.Get("Idempotency-Key")] == 1:
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(hook.Close)

	rdb, prefix := testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		testAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + llmSrv.URL + "/v1", "ONCEFLOW_LLM_TIMEOUT=1s", "ONCEFLOW_LLM_MAX_ATTEMPTS=2",
		"ONCEFLOW_CLAIM_IDLE=1s", "ONCEFLOW_STATS_INTERVAL=200ms",
		"ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + hook.URL, "ONCEFLOW_RELAY_INTERVAL=50ms"}
	p := testenv.Start(t, testenv.Binary(t), env, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	base := "http://" + fmt.Sprint(p.WaitLog(ctx, "http listening")["addr"])
	p.WaitLog(ctx, "worker started")

	// Fresh: every family visible, every counter at zero.
	fresh, families := scrape(t, base+"/metrics")
	var ours []string
	for _, f := range families {
		if strings.HasPrefix(f, "onceflow_") {
			ours = append(ours, f)
		}
	}
	documented := documentedMetrics(t)
	for _, f := range ours {
		if !slices.Contains(documented, f) {
			t.Errorf("%s is exported but not documented in docs/operations.md", f)
		}
	}
	for _, f := range documented {
		if !slices.Contains(ours, f) {
			t.Errorf("%s is documented but a fresh `onceflow run` does not show it", f)
		}
	}
	for series, v := range fresh {
		if strings.HasPrefix(series, "onceflow_") && !strings.HasPrefix(series, "onceflow_build_info") &&
			!strings.HasPrefix(series, "onceflow_http_request") && !strings.Contains(series, "_bucket{") && v != 0 {
			t.Errorf("fresh process: %s = %v, want 0", series, v)
		}
	}

	post := func(idem, text, to string) int {
		t.Helper()
		req, _ := http.NewRequest("POST", base+"/v1/summaries", strings.NewReader(fmt.Sprintf(`{"text":%q,"notify":%q}`, text, to)))
		req.Header.Set("Authorization", "Bearer test-key-acme-0123456789")
		req.Header.Set("Idempotency-Key", idem)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	count := func(sql string) int {
		var n int
		if err := pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// A: one 429 with Retry-After 1s, which pauses the model (the limiter): the job waits
	// in the scheduled set without spending an attempt (no in-process retry), then its
	// call is answered; its email gets a 503, then 200.
	model.Script(fakeserver.Fault{Kind: fakeserver.Fault429})
	if c := post("metrics-job-a-000001", "first text", "a@example.com"); c != 202 {
		t.Fatalf("POST A: %d", c)
	}
	testenv.WaitFor(t, 20*time.Second, "summary A", func() bool { return count(`SELECT count(*) FROM summaries`) == 1 })
	post("metrics-job-a-000001", "first text", "a@example.com")   // replayed
	post("metrics-job-a-000001", "another text", "a@example.com") // 422
	// B: two attempts that hang past ONCEFLOW_LLM_TIMEOUT (ambiguous), so the delivery
	// fails and its next attempt is scheduled (not reclaimed: the failed entry left the
	// worker at once); the second delivery gets an answer. Its
	// email is refused for good (400).
	model.Script(fakeserver.Fault{Kind: fakeserver.FaultHang}, fakeserver.Fault{Kind: fakeserver.FaultHang})
	if c := post("metrics-job-b-000002", "second text", "reject@example.com"); c != 202 {
		t.Fatalf("POST B: %d", c)
	}
	testenv.WaitFor(t, 30*time.Second, "summary B", func() bool { return count(`SELECT count(*) FROM summaries`) == 2 })
	// C: too long for the model: 400, dead-lettered.
	if c := post("metrics-job-c-000003", strings.Repeat("long ", 100), "c@example.com"); c != 202 {
		t.Fatalf("POST C: %d", c)
	}
	// A again in the stream, as after an API crash between XADD and the response.
	var idA string
	if err := pool.QueryRow(context.Background(), `SELECT job_id FROM summaries ORDER BY created_at LIMIT 1`).Scan(&idA); err != nil {
		t.Fatal(err)
	}
	if _, err := queue.Enqueue(context.Background(), rdb, queue.Keys{Prefix: prefix, Queue: summaries.QueueName},
		queue.Message{JobID: idA, Tenant: "acme", Payload: json.RawMessage(`{"text":"first text","notify":"a@example.com"}`)}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 20*time.Second, "the emails settled", func() bool {
		return count(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL OR exhausted_at IS NOT NULL`) == 2
	})

	q := `{queue="summaries"}`
	want := map[string]float64{
		`onceflow_http_requests_total{code="202",route="/v1/summaries"}`:                       4,
		`onceflow_http_requests_total{code="422",route="/v1/summaries"}`:                       1,
		`onceflow_idempotency_requests_total{outcome="new"}`:                                   3,
		`onceflow_idempotency_requests_total{outcome="replayed"}`:                              1,
		`onceflow_idempotency_requests_total{outcome="reused_422"}`:                            1,
		"onceflow_queue_enqueued_total" + q:                                                    3,
		"onceflow_queue_deliveries_total" + q:                                                  6,
		"onceflow_queue_reclaimed_total" + q:                                                   0,
		"onceflow_queue_redeliveries_total" + q:                                                0,
		"onceflow_queue_retries_scheduled_total" + q:                                           1,
		"onceflow_queue_acks_total" + q:                                                        3,
		`onceflow_queue_dead_lettered_total{queue="summaries",reason="permanent"}`:             1,
		`onceflow_queue_handler_duration_seconds_count{outcome="ok",queue="summaries"}`:        3,
		`onceflow_queue_handler_duration_seconds_count{outcome="error",queue="summaries"}`:     1,
		`onceflow_queue_handler_duration_seconds_count{outcome="snoozed",queue="summaries"}`:   1,
		`onceflow_queue_handler_duration_seconds_count{outcome="permanent",queue="summaries"}`: 1,
		"onceflow_queue_in_flight" + q:                                                         0,
		"onceflow_queue_dead_letters" + q:                                                      1,
		`onceflow_summaries_jobs_total{outcome="done"}`:                                        2,
		`onceflow_summaries_jobs_total{outcome="duplicate"}`:                                   1,
		`onceflow_summaries_jobs_total{outcome="retry"}`:                                       1,
		`onceflow_summaries_jobs_total{outcome="permanent"}`:                                   1,
		`onceflow_outbox_written_total{topic="email.summary_ready"}`:                           2,
		`onceflow_llm_calls_total{outcome="ok",provider="openai"}`:                             2,
		`onceflow_llm_calls_total{outcome="rate_limited",provider="openai"}`:                   1,
		`onceflow_llm_calls_total{outcome="timeout",provider="openai"}`:                        2,
		`onceflow_llm_calls_total{outcome="client_error",provider="openai"}`:                   1,
		`onceflow_llm_ambiguous_failures_total{provider="openai"}`:                             2,
		`onceflow_llm_retries_total{class="rate_limited",source="retry_after"}`:                0,
		`onceflow_llm_retries_total{class="timeout",source="backoff"}`:                         1,
		`onceflow_llm_retry_wait_seconds_total{source="retry_after"}`:                          0,
		`onceflow_summaries_jobs_total{outcome="waiting"}`:                                     1,
		`onceflow_llm_pauses_total{model="gpt-4.1-mini"}`:                                      1,
		`onceflow_llm_rate_limited_total{model="gpt-4.1-mini"}`:                                1,
		`onceflow_llm_budget_waits_total{tenant="none"}`:                                       0,
		"onceflow_outbox_sent_total":                                                           1,
		"onceflow_outbox_exhausted_total":                                                      1,
		`onceflow_outbox_send_failures_total{class="retryable"}`:                               1,
		`onceflow_outbox_send_failures_total{class="permanent"}`:                               1,
		"onceflow_outbox_send_duration_seconds_count":                                          3,
	}
	atLeast := map[string]float64{
		"onceflow_outbox_claimed_batches_total":                       2,
		`onceflow_llm_call_duration_seconds_count{provider="openai"}`: 6,
	}
	// The last acknowledgement and the sampled gauges trail the effects a little: wait
	// until the page settles (or time out), then report every difference.
	var mismatches []string
	deadline := time.Now().Add(10 * time.Second)
	for {
		m, _ := scrape(t, base+"/metrics")
		mismatches = mismatches[:0]
		for series, v := range want {
			if got, ok := m[series]; !ok || got != v {
				mismatches = append(mismatches, fmt.Sprintf("%s = %v (present %v), want %v", series, got, ok, v))
			}
		}
		// The stream length gauge is sampled and the worker trims acknowledged entries
		// in the background, so its value may be anything up to the entries written:
		// only its presence is certain.
		if _, ok := m["onceflow_queue_stream_length"+q]; !ok {
			mismatches = append(mismatches, "onceflow_queue_stream_length"+q+" missing")
		}
		for series, v := range atLeast {
			if m[series] < v {
				mismatches = append(mismatches, fmt.Sprintf("%s = %v, want at least %v", series, m[series], v))
			}
		}
		if len(mismatches) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, msg := range mismatches {
		t.Error(msg)
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(20 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
}
