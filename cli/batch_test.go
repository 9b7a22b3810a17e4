package cli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/onceflowtest"
)

// holdingProvider is fake-llm's batch API behind a switch that holds one kind of
// request where a crash is to happen: before it reaches the fake, after the fake
// answered (the answer kept from the caller), or with half of a results file written.
// Once released, requests pass.
type holdingProvider struct {
	fake    *fakeserver.Server
	mu      sync.Mutex
	at      string // "before-upload", "before-create", "after-create", "download", "half-results"
	reached chan struct{}
	once    sync.Once
	freed   chan struct{} // closed by release: held requests end
	free    sync.Once
}

func (h *holdingProvider) hold(r *http.Request) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch h.at {
	case "before-upload":
		return r.Method == http.MethodPost && r.URL.Path == "/v1/files"
	case "before-create", "after-create":
		return r.Method == http.MethodPost && r.URL.Path == "/v1/batches"
	case "download", "half-results":
		return r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/content")
	}
	return false
}

func (h *holdingProvider) release() {
	h.mu.Lock()
	h.at = ""
	h.mu.Unlock()
	h.free.Do(func() { close(h.freed) })
}

func (h *holdingProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.hold(r) {
		h.fake.ServeHTTP(w, r)
		return
	}
	h.mu.Lock()
	at := h.at
	h.mu.Unlock()
	switch at {
	case "after-create", "half-results": // the fake does the work; the caller hears nothing, or half
		rec := httptest.NewRecorder()
		h.fake.ServeHTTP(rec, r)
		if at == "half-results" {
			lines := bytes.SplitAfter(rec.Body.Bytes(), []byte("\n"))
			w.WriteHeader(rec.Code)
			w.Write(bytes.Join(lines[:len(lines)/2], nil))
			w.(http.Flusher).Flush()
		}
	}
	io.Copy(io.Discard, r.Body) // read: a kill of the caller then ends r's context
	h.once.Do(func() { close(h.reached) })
	select { // held until the caller is killed, or the test ends
	case <-r.Context().Done():
	case <-h.freed:
	}
}

// batchRun starts `onceflow run` with the summaries in the batch lane of provider base.
func batchRun(t *testing.T, dsn, prefix, base string) (*testenv.Process, string) {
	t.Helper()
	p := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_CLAIM_IDLE=1s",
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + base, "OPENAI_API_KEY=sk-test-batch", "ONCEFLOW_SUMMARIES_LANE=batch",
		"ONCEFLOW_BATCH_MAX_AGE=200ms", "ONCEFLOW_BATCH_POLL_INTERVAL=100ms", "ONCEFLOW_BATCH_SUBMIT_TIMEOUT=1s", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
	}, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return p, fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])
}

// `onceflow run` with ONCEFLOW_SUMMARIES_LANE=batch, killed (kill -9) at each point of a
// batch's life and started again: before the upload, after it, after the provider
// created the batch but before its id was recorded, while the results download, and
// with half of them recorded. In the end every summary is stored once, every request
// was submitted in one batch only and billed once, and no model call was made outside
// a batch.
func TestBatchLaneKilledAtEachPointAnswersEverySummaryOnce(t *testing.T) {
	testenv.Long(t) // ten processes
	t.Parallel()
	testenv.Binary(t)
	for _, at := range []string{"before-upload", "before-create", "after-create", "download", "half-results"} {
		t.Run(at, func(t *testing.T) {
			t.Parallel()
			fake, err := fakeserver.New(fakeserver.Config{BatchDelay: 200 * time.Millisecond, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fake.Close)
			h := &holdingProvider{fake: fake, at: at, reached: make(chan struct{}), freed: make(chan struct{})}
			srv := httptest.NewServer(h)
			t.Cleanup(srv.Close)
			t.Cleanup(h.release) // before srv.Close, which waits for held requests
			_, prefix := testenv.Redis(t)
			pool, dsn := testenv.Postgres(t)
			a, api := batchRun(t, dsn, prefix, srv.URL+"/v1")
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			const jobs = 6
			for i := range jobs {
				r, err := postSummary(ctx, http.DefaultClient, api, testKeyAcme, fmt.Sprintf("batch-%s-%d", at, i),
					summaryBody(fmt.Sprintf("Ticket %d: the export stalls at night.", i)))
				if err != nil || r.code != http.StatusAccepted {
					t.Fatalf("POST %d: %v %d %s", i, err, r.code, r.body)
				}
			}
			select {
			case <-h.reached:
			case <-ctx.Done():
				t.Fatalf("the lane never reached %s", at)
			}
			if at == "half-results" { // the kill comes with some answers recorded, not all
				testenv.WaitFor(t, 20*time.Second, "the first half of the answers recorded", func() bool {
					return onceflowtest.Count(t, pool, `SELECT count(*) FROM llm_calls WHERE provider = 'openai-batch'`) > 0
				})
				if n := onceflowtest.Count(t, pool, `SELECT count(*) FROM llm_calls WHERE provider = 'openai-batch'`); n >= jobs {
					t.Fatalf("%d answers recorded before the kill, want fewer than %d", n, jobs)
				}
			}
			a.Kill()
			h.release()
			b, _ := batchRun(t, dsn, prefix, srv.URL+"/v1")
			testenv.WaitFor(t, 30*time.Second, "every summary stored", func() bool {
				return onceflowtest.Count(t, pool, `SELECT count(*) FROM summaries`) == jobs
			})
			b.Signal(syscall.SIGTERM)
			st := fake.Stats()
			if len(st.BatchByCustomID) != jobs {
				t.Fatalf("%d custom_ids in batches, want %d", len(st.BatchByCustomID), jobs)
			}
			for id, n := range st.BatchByCustomID {
				if n != 1 || st.BatchBilledByCustomID[id] != 1 {
					t.Errorf("custom_id %s submitted %d times and billed %d, want once each", id, n, st.BatchBilledByCustomID[id])
				}
			}
			if n := st.ByEndpoint["chat_completions"]; n != 0 {
				t.Errorf("%d synchronous model calls, want none", n)
			}
			if n := onceflowtest.Count(t, pool, `SELECT count(DISTINCT job_id) FROM summaries`); n != jobs {
				t.Errorf("%d jobs with a summary, want %d", n, jobs)
			}
		})
	}
}
