package fakeserver_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm/fakeserver"
)

// testClock is a clock the test moves.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func newTestClock() *testClock {
	return &testClock{now: time.Date(2026, 3, 2, 9, 0, 0, 0, time.UTC)}
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// startBatches serves a fake server whose batch clock the test moves; BatchDelay is
// 10s unless cfg sets it.
func startBatches(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, string, *testClock) {
	t.Helper()
	clock := newTestClock()
	cfg.Clock = clock.Now
	if cfg.BatchDelay == 0 {
		cfg.BatchDelay = 10 * time.Second
	}
	s, url := start(t, cfg)
	return s, url, clock
}

func TestConfig_BatchOutcome_IsDeterministicAndAboutOneInN(t *testing.T) {
	t.Parallel()
	cfg := fakeserver.Config{BatchFailEvery: 4, BatchExpireEvery: 5}
	counts := map[string]int{}
	for i := range 4000 {
		id := fmt.Sprintf("req-%d", i)
		got := cfg.BatchOutcome(id)
		if again := cfg.BatchOutcome(id); again != got {
			t.Fatalf("BatchOutcome(%q) = %q then %q", id, got, again)
		}
		counts[got]++
	}
	// Expired: about 1 in 5 (800); errored: about 1 in 4 of the rest (800).
	for outcome, want := range map[string]int{fakeserver.BatchExpired: 800, fakeserver.BatchErrored: 800, fakeserver.BatchSucceeded: 2400} {
		if got := counts[outcome]; got < want*8/10 || got > want*12/10 {
			t.Errorf("%s: %d of 4000, want about %d", outcome, got, want)
		}
	}
	if got := (fakeserver.Config{}).BatchOutcome("req-1"); got != fakeserver.BatchSucceeded {
		t.Errorf("without knobs: %q, want succeeded", got)
	}
}

func TestConfig_Validate_RefusesNegativeBatchKnobs(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]fakeserver.Config{
		"batch-delay":            {BatchDelay: -time.Second},
		"batch-window":           {BatchWindow: -time.Second},
		"batch-retention":        {BatchRetention: -time.Second},
		"batch-fail-every":       {BatchFailEvery: -1},
		"batch-expire-every":     {BatchExpireEvery: -1},
		"batch-max-bytes":        {BatchMaxBytes: -1},
		"batch-max-stored-bytes": {BatchMaxStoredBytes: -1},
	} {
		err := cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: Validate() = %v, want an error naming it", name, err)
		}
	}
}

// A batch counts in Stats once it ends, whether or not a client polls it.
func TestStats_CountsEndedBatchesWithoutPolling(t *testing.T) {
	t.Parallel()
	s, url, clock := startBatches(t, fakeserver.Config{})
	resp, body := post(t, url+"/v1/messages/batches", anBatchBody("a", "b", "c"))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	st := s.Stats()
	if st.BatchesCreated["anthropic"] != 1 || st.BatchByCustomID["a"] != 1 || len(st.BatchBilledByCustomID) != 0 || st.BatchItems["succeeded"] != 0 {
		t.Fatalf("before the end: %+v", st)
	}
	clock.Advance(10 * time.Second)
	st = s.Stats()
	if st.BatchItems["succeeded"] != 3 || st.BatchBilledByCustomID["b"] != 1 {
		t.Fatalf("after the end: items %v billed %v", st.BatchItems, st.BatchBilledByCustomID)
	}
	// Submitting a custom_id again counts it again, in either provider.
	post(t, url+"/v1/messages/batches", anBatchBody("a"))
	if got := s.Stats().BatchByCustomID["a"]; got != 2 {
		t.Errorf("batch_by_custom_id[a] = %d, want 2", got)
	}
	// GET /stats carries the same fields.
	st2, err := fakeserver.FetchStats(t.Context(), nil, url)
	if err != nil || st2.BatchByCustomID["a"] != 2 || st2.BatchesCreated["anthropic"] != 2 {
		t.Errorf("FetchStats: %+v, %v", st2, err)
	}
}

// Batches belong to the credential that created them.
func TestBatches_AreVisibleToTheirCredentialOnly(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{})
	_, body := post(t, url+"/v1/messages/batches", anBatchBody("a"), "X-Api-Key", "key-one")
	var b struct{ ID string }
	if err := json.Unmarshal(body, &b); err != nil || b.ID == "" {
		t.Fatalf("create: %s", body)
	}
	if resp, _ := get(t, url+"/v1/messages/batches/"+b.ID, "X-Api-Key", "key-two"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("another key: %d, want 404", resp.StatusCode)
	}
	if resp, _ := get(t, url+"/v1/messages/batches/"+b.ID, "X-Api-Key", "key-one"); resp.StatusCode != http.StatusOK {
		t.Errorf("its key: %d, want 200", resp.StatusCode)
	}
}

// An ended batch is dropped BatchRetention after its end; one in progress is kept.
func TestBatches_AreDroppedAfterRetention(t *testing.T) {
	t.Parallel()
	_, url, clock := startBatches(t, fakeserver.Config{BatchRetention: time.Minute})
	_, body := post(t, url+"/v1/messages/batches", anBatchBody("a"))
	var old struct{ ID string }
	_ = json.Unmarshal(body, &old)
	clock.Advance(10 * time.Second) // ended
	get(t, url+"/v1/messages/batches/"+old.ID)
	clock.Advance(2 * time.Minute)
	_, body = post(t, url+"/v1/messages/batches", anBatchBody("b")) // a creation sweeps
	var young struct{ ID string }
	_ = json.Unmarshal(body, &young)
	if resp, _ := get(t, url+"/v1/messages/batches/"+old.ID); resp.StatusCode != http.StatusNotFound {
		t.Errorf("ended batch past retention: %d, want 404", resp.StatusCode)
	}
	clock.Advance(2 * time.Minute) // young has ended but not been swept
	if resp, _ := get(t, url+"/v1/messages/batches/"+young.ID); resp.StatusCode != http.StatusOK {
		t.Errorf("batch not swept yet: %d, want 200", resp.StatusCode)
	}
}

// The store refuses what it cannot keep, in the provider's error shape.
func TestBatches_FullStoreAnswers429(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{BatchMaxStoredBytes: 500})
	body := anBatchBody("a", "b")
	if resp, b := post(t, url+"/v1/messages/batches", body); resp.StatusCode != http.StatusOK {
		t.Fatalf("first: %d %s", resp.StatusCode, b)
	}
	resp, b := post(t, url+"/v1/messages/batches", body)
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(string(b), `"rate_limit_error"`) {
		t.Errorf("second: %d %s, want 429 rate_limit_error", resp.StatusCode, b)
	}
}

func get(t *testing.T, url string, header ...string) (*http.Response, []byte) {
	t.Helper()
	return do(t, http.MethodGet, url, "", header...)
}

func do(t *testing.T, method, url, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp, b
}
