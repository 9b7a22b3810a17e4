package anthropic_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
)

// batchClock is the fake server's batch clock, moved by the test.
type batchClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *batchClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *batchClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// startFake serves fake-llm with cfg over HTTP and returns it with the adapter's batch
// API on it.
func startFake(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, *anthropic.Batches) {
	t.Helper()
	fs, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(fs)
	t.Cleanup(func() { srv.Close(); fs.Close() })
	return fs, anthropic.New(anthropic.Config{BaseURL: srv.URL, APIKey: "sk-ant-test-not-real", Model: "claude-haiku-4-5"}).Batches()
}

// submission is a batch of n requests, custom_id item-<i> asking to summarise
// "note <i>".
func submission(n int) llm.BatchSubmission {
	s := llm.BatchSubmission{ID: "sub-1", Model: "claude-haiku-4-5"}
	for i := range n {
		s.Items = append(s.Items, llm.BatchItem{CustomID: fmt.Sprint("item-", i),
			Request: &llm.Request{Model: "claude-haiku-4-5", MaxTokens: 200, Messages: []llm.Message{{Role: llm.RoleUser, Content: fmt.Sprint("note ", i)}}}})
	}
	return s
}

// A batch of 40 is in progress until it ends (Get says so, with its 40 items), then
// Results yields each custom_id once: the outcome fake-llm gives it under
// BatchFailEvery and BatchExpireEvery, and each success the answer, with usage, that
// the Messages endpoint gives the same request.
func TestBatchResultsYieldEachItemOnce(t *testing.T) {
	t.Parallel()
	cfg := fakeserver.Config{BatchDelay: 200 * time.Millisecond, BatchFailEvery: 5, BatchExpireEvery: 7}
	fs, b := startFake(t, cfg)
	const n = 40
	info, err := b.Submit(t.Context(), submission(n))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(info.ID, "msgbatch_") || info.Ended || info.Status != "in_progress" || info.Items != n || info.Submission != "" ||
		time.Since(info.CreatedAt) > time.Minute {
		t.Fatalf("created %+v", info)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !info.Ended {
		if time.Now().After(deadline) {
			t.Fatalf("not ended: %+v", info)
		}
		time.Sleep(20 * time.Millisecond)
		if info, err = b.Get(t.Context(), info.ID); err != nil {
			t.Fatal(err)
		}
	}
	if info.Status != "ended" || info.Items != n {
		t.Fatalf("ended %+v, want %d items", info, n)
	}
	seen := map[string]int{}
	counts := map[string]int{}
	for r, err := range b.Results(t.Context(), info.ID) {
		if err != nil {
			t.Fatal(err)
		}
		seen[r.CustomID]++
		counts[r.Outcome]++
		if want := cfg.BatchOutcome(r.CustomID); r.Outcome != want {
			t.Errorf("%s: %s (%s), want %s", r.CustomID, r.Outcome, r.Error, want)
		}
		switch r.Outcome {
		case llm.BatchSucceeded:
			var i int
			fmt.Sscanf(r.CustomID, "item-%d", &i)
			if resp := r.Response; resp == nil || resp.Content != fake.Summary(fmt.Sprint("note ", i)) || resp.FinishReason != llm.FinishStop ||
				resp.Usage.InputTokens == 0 || resp.Usage.OutputTokens == 0 || !strings.HasPrefix(resp.ID, "msg_") || !json.Valid(resp.Raw) {
				t.Errorf("%s: answer %+v", r.CustomID, r.Response)
			}
		case llm.BatchErrored:
			if r.Response != nil || !strings.HasPrefix(r.Error, "api_error: ") {
				t.Errorf("%s: errored %+v", r.CustomID, r)
			}
		case llm.BatchExpired:
			if r.Response != nil || r.Error == "" {
				t.Errorf("%s: expired %+v", r.CustomID, r)
			}
		}
	}
	for i := range n {
		if id := fmt.Sprint("item-", i); seen[id] != 1 {
			t.Errorf("%s yielded %d times, want once", id, seen[id])
		}
	}
	if len(seen) != n || counts[llm.BatchSucceeded] == 0 || counts[llm.BatchErrored] == 0 || counts[llm.BatchExpired] == 0 {
		t.Fatalf("%d custom_ids, outcomes %v: want %d, some of each", len(seen), counts, n)
	}
	st := fs.Stats()
	for id, k := range st.BatchByCustomID {
		if k != 1 {
			t.Errorf("%s submitted %d times", id, k)
		}
	}
	if len(st.BatchByCustomID) != n || len(st.BatchBilledByCustomID) != counts[llm.BatchSucceeded] || st.ByEndpoint["messages"] != 0 {
		t.Errorf("stats: submitted %d, billed %d (want %d), synchronous %d", len(st.BatchByCustomID), len(st.BatchBilledByCustomID),
			counts[llm.BatchSucceeded], st.ByEndpoint["messages"])
	}
}

// Submit sends each item as the params Complete sends for the same request: system
// prompt, tools, tool calls and their results, max_tokens, model.
func TestBatchSubmitSendsTheParamsCompleteSends(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	bodies := map[string][]byte{}
	fs, err := fakeserver.New(fakeserver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies[r.URL.Path] = body
		mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body))
		fs.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { srv.Close(); fs.Close() })
	c := anthropic.New(anthropic.Config{BaseURL: srv.URL, APIKey: "k", Model: "claude-haiku-4-5", MaxTokens: 333})
	req := &llm.Request{Model: "claude-sonnet-4-5", Messages: []llm.Message{
		{Role: llm.RoleSystem, Content: "Be brief."},
		{Role: llm.RoleUser, Content: "What is the weather in Paris?"},
		{Role: llm.RoleAssistant, ToolCalls: []llm.ToolCall{{ID: "toolu_1", Name: "weather", Arguments: `{"city":"Paris"}`}}},
		{Role: llm.RoleTool, ToolCallID: "toolu_1", Content: "sunny"},
		{Role: llm.RoleUser, Content: "And so?"},
	}, Tools: []llm.Tool{{Name: "weather", Description: "The weather of a city.",
		Parameters: json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`)}}}
	if _, err := c.Complete(t.Context(), req); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Batches().Submit(t.Context(), llm.BatchSubmission{ID: "s", Model: req.Model, Items: []llm.BatchItem{{CustomID: "a", Request: req}}}); err != nil {
		t.Fatal(err)
	}
	var batch struct {
		Requests []struct {
			CustomID string          `json:"custom_id"`
			Params   json.RawMessage `json:"params"`
		} `json:"requests"`
	}
	mu.Lock()
	defer mu.Unlock()
	if err := json.Unmarshal(bodies["/v1/messages/batches"], &batch); err != nil || len(batch.Requests) != 1 || batch.Requests[0].CustomID != "a" {
		t.Fatalf("batch body %s: %v", bodies["/v1/messages/batches"], err)
	}
	var sync, batched any
	if err := json.Unmarshal(bodies["/v1/messages"], &sync); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(batch.Requests[0].Params, &batched); err != nil {
		t.Fatal(err)
	}
	s, _ := json.Marshal(sync)
	bt, _ := json.Marshal(batched)
	if !bytes.Equal(s, bt) {
		t.Fatalf("batch params\n%s\nComplete's\n%s", bt, s)
	}
}

// List returns the batches created since a time, newest first, across pages (the
// adapter asks 100 a page), and none created before it.
func TestBatchListFindsTheBatchesCreatedSince(t *testing.T) {
	t.Parallel()
	clock := &batchClock{now: time.Date(2026, 3, 2, 9, 0, 0, 0, time.UTC)}
	_, b := startFake(t, fakeserver.Config{Clock: clock.Now, BatchDelay: time.Hour})
	var ids []string // newest first
	var since time.Time
	for i := range 130 {
		if i == 5 {
			since = clock.Now()
		}
		info, err := b.Submit(t.Context(), submission(1+i%3))
		if err != nil {
			t.Fatal(err)
		}
		ids = append([]string{info.ID}, ids...)
		clock.Advance(time.Second)
	}
	got, err := b.List(t.Context(), since)
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, in := range got {
		listed = append(listed, in.ID)
		if in.CreatedAt.Before(since) || in.Ended || in.Items < 1 || in.Items > 3 || in.Submission != "" {
			t.Errorf("listed %+v", in)
		}
	}
	if want := ids[:125]; !slices.Equal(listed, want) {
		t.Fatalf("listed %d batches, want the %d created since, newest first", len(listed), len(want))
	}
	if got, err := b.List(t.Context(), clock.Now()); err != nil || len(got) != 0 {
		t.Fatalf("since now: %v %v, want none", got, err)
	}
}

// Cancel makes a batch canceling (not ended), then ended with the requests not done by
// then canceled; a second cancel is an error.
func TestBatchCancelCancelsTheRequestsNotDone(t *testing.T) {
	t.Parallel()
	clock := &batchClock{now: time.Date(2026, 3, 2, 9, 0, 0, 0, time.UTC)}
	_, b := startFake(t, fakeserver.Config{Clock: clock.Now, BatchDelay: 10 * time.Second})
	info, err := b.Submit(t.Context(), submission(4))
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(4 * time.Second) // item-0 (2s) and item-1 (4s) are done
	if err := b.Cancel(t.Context(), info.ID); err != nil {
		t.Fatal(err)
	}
	if info, err = b.Get(t.Context(), info.ID); err != nil || info.Status != "canceling" || info.Ended {
		t.Fatalf("after the cancel: %+v %v", info, err)
	}
	if err := b.Cancel(t.Context(), info.ID); err == nil {
		t.Error("a second cancel succeeded")
	}
	clock.Advance(time.Second)
	if info, err = b.Get(t.Context(), info.ID); err != nil || !info.Ended || info.Items != 4 {
		t.Fatalf("after the cancel ended: %+v %v", info, err)
	}
	for r, err := range b.Results(t.Context(), info.ID) {
		if err != nil {
			t.Fatal(err)
		}
		want := map[bool]string{true: llm.BatchSucceeded, false: llm.BatchCanceled}[r.CustomID < "item-2"]
		if r.Outcome != want || (want == llm.BatchCanceled && r.Error == "") {
			t.Errorf("%s: %+v, want %s", r.CustomID, r, want)
		}
	}
	if err := b.Cancel(t.Context(), "msgbatch_nope"); err == nil {
		t.Error("cancelling an unknown batch succeeded")
	}
}

// endedBatch is GET /v1/messages/batches/msgbatch_1 of an ended batch whose
// results_url is resultsURL ("" for one still in progress).
func endedBatch(resultsURL string) string {
	status, results := "ended", "null"
	if resultsURL != "" {
		results = fmt.Sprintf("%q", resultsURL)
	} else {
		status = "in_progress"
	}
	return fmt.Sprintf(`{"id":"msgbatch_1","type":"message_batch","processing_status":%q,"request_counts":{"processing":0,"succeeded":0,"errored":0,"canceled":0,"expired":1},`+
		`"created_at":"2026-03-02T09:00:00Z","expires_at":"2026-03-03T09:00:00Z","ended_at":null,"archived_at":null,"cancel_initiated_at":null,"results_url":%s}`, status, results)
}

// resultsServer serves batch msgbatch_1, its results_url resultsURL (with %s for the
// server's own URL), and body at GET resultsPath to the key "k" (the SDK sends it as
// a bearer token); it counts the reads of the results.
func resultsServer(t *testing.T, resultsURL, resultsPath, body string) (*anthropic.Batches, *int) {
	t.Helper()
	var mu sync.Mutex
	reads := 0
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/v1/messages/batches/msgbatch_1":
			w.Header().Set("Content-Type", "application/json")
			u := resultsURL
			if strings.Contains(u, "%s") {
				u = fmt.Sprintf(u, srv.URL)
			}
			_, _ = io.WriteString(w, endedBatch(u))
		case r.URL.RequestURI() == resultsPath && (r.Header.Get("X-Api-Key") == "k" || r.Header.Get("Authorization") == "Bearer k"):
			mu.Lock()
			reads++
			mu.Unlock()
			w.Header().Set("Content-Type", "application/x-jsonl")
			_, _ = io.WriteString(w, body)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return anthropic.New(anthropic.Config{BaseURL: srv.URL, APIKey: "k"}).Batches(), &reads
}

// A results line that is not a result, or one beyond 16 MiB, ends Results with an
// A result line Results cannot read (not JSON, an unknown result type, a line over the
// limit) yields an error matching llm.ErrBatchResult, and the lines after it are still
// read: one bad line does not hide the batch's other answers.
func TestBatchResultsGoOnPastAnUnreadableLine(t *testing.T) {
	t.Parallel()
	good := `{"custom_id":"a","result":{"type":"expired"}}`
	last := "\n" + `{"custom_id":"c","result":{"type":"canceled"}}` + "\n"
	for name, body := range map[string]string{
		"not json":     good + "\n\n" + `{"custom_id":"b","result":` + last,
		"unknown type": good + "\n" + `{"custom_id":"b","result":{"type":"pending"}}` + last,
		"too long":     good + "\n" + `{"custom_id":"b","result":{"type":"expired","x":"` + strings.Repeat("x", 17<<20) + `"}}` + last,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b, _ := resultsServer(t, "%s/v1/messages/batches/msgbatch_1/results", "/v1/messages/batches/msgbatch_1/results", body)
			var ids []string
			var errs []error
			for r, err := range b.Results(t.Context(), "msgbatch_1") {
				if err != nil {
					errs = append(errs, err)
					continue
				}
				ids = append(ids, r.CustomID)
			}
			if !slices.Equal(ids, []string{"a", "c"}) || len(errs) != 1 || !errors.Is(errs[0], llm.ErrBatchResult) {
				t.Fatalf("yielded %v and errors %v, want a and c, and one error matching llm.ErrBatchResult", ids, errs)
			}
		})
	}
}

// Results reads the batch's results_url, wherever on the API's origin it points; a
// results_url on another origin is read at its path and query on the configured one
// (the key goes nowhere else); a batch still in progress has no results to read.
func TestBatchResultsAreReadFromTheResultsURL(t *testing.T) {
	t.Parallel()
	line := `{"custom_id":"a","result":{"type":"expired"}}` + "\n"
	for _, tc := range []struct{ resultsURL, path string }{
		{"%s/v1/messages/batches/msgbatch_1/results", "/v1/messages/batches/msgbatch_1/results"},
		{"%s/v2/results/msgbatch_1.jsonl?part=all", "/v2/results/msgbatch_1.jsonl?part=all"},
		{"https://results.example.invalid/v2/results/msgbatch_1.jsonl?part=all", "/v2/results/msgbatch_1.jsonl?part=all"},
	} {
		b, reads := resultsServer(t, tc.resultsURL, tc.path, line)
		var got []string
		for r, err := range b.Results(t.Context(), "msgbatch_1") {
			if err != nil {
				t.Fatalf("results_url %s: %v", tc.resultsURL, err)
			}
			got = append(got, r.CustomID+" "+r.Outcome)
		}
		if !slices.Equal(got, []string{"a expired"}) || *reads != 1 {
			t.Errorf("results_url %s: %v after %d reads of %s, want a expired from one", tc.resultsURL, got, *reads, tc.path)
		}
	}
	b, reads := resultsServer(t, "", "/v1/messages/batches/msgbatch_1/results", line)
	for _, err := range b.Results(t.Context(), "msgbatch_1") {
		if err == nil || !strings.Contains(err.Error(), "in_progress") || *reads != 0 {
			t.Errorf("a batch in progress: %v after %d reads, want an error and none", err, *reads)
		}
	}
}

// An error answer to a batch request is mapped as Complete's are: a 429, a 500 and
// Anthropic's 529 overloaded are retryable, a 400 and a 404 are not.
func TestBatchServerErrorsAreRetryable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status    int
		typ       string
		retryable bool
	}{
		{http.StatusInternalServerError, "api_error", true},
		{529, "overloaded_error", true},
		{http.StatusTooManyRequests, "rate_limit_error", true},
		{http.StatusBadRequest, "invalid_request_error", false},
		{http.StatusNotFound, "not_found_error", false},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Request-Id", "req_1")
			w.WriteHeader(tc.status)
			fmt.Fprintf(w, `{"type":"error","error":{"type":%q,"message":"no"},"request_id":"req_1"}`, tc.typ)
		}))
		b := anthropic.New(anthropic.Config{BaseURL: srv.URL, APIKey: "k"}).Batches()
		_, err := b.Submit(t.Context(), submission(2))
		var apiErr *llm.APIError
		if err == nil || !errors.As(err, &apiErr) || apiErr.StatusCode != tc.status || apiErr.Type != tc.typ || retry.Retryable(err) != tc.retryable {
			t.Errorf("create answered %d: %v (%+v), want retryable %t", tc.status, err, retry.Classify(err), tc.retryable)
		}
		_, err = b.Get(t.Context(), "msgbatch_1")
		if err == nil || retry.Retryable(err) != tc.retryable {
			t.Errorf("get answered %d: %v, want retryable %t", tc.status, err, tc.retryable)
		}
		for _, err := range b.Results(t.Context(), "msgbatch_1") {
			if err == nil || retry.Retryable(err) != tc.retryable {
				t.Errorf("results answered %d: %v, want retryable %t", tc.status, err, tc.retryable)
			}
		}
		srv.Close()
	}
}

// ParseBatchResult reads each result type of the results file, and refuses lines that
// are none of them.
func TestParseBatchResult(t *testing.T) {
	t.Parallel()
	answer := `{"custom_id":"abc","result":{"type":"succeeded","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-haiku-4-5",` +
		`"content":[{"type":"text","text":"hi"},{"type":"tool_use","id":"toolu_1","name":"f","input":{"a":1}}],"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":1}}}}`
	for _, tc := range []struct {
		line, outcome, want string
	}{
		{answer, llm.BatchSucceeded, ""},
		{`{"custom_id":"abc","result":{"type":"errored","error":{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: Field required"},"request_id":"req_1"}}}`, llm.BatchErrored, ""},
		{`{"custom_id":"abc","result":{"type":"errored"}}`, llm.BatchErrored, ""},
		{`{"custom_id":"abc","result":{"type":"canceled"}}`, llm.BatchCanceled, ""},
		{`{"custom_id":"abc","result":{"type":"expired"}}`, llm.BatchExpired, ""},
		{`{"custom_id":"abc","result":{"type":"succeeded","message":{"type":"message"}}}`, llm.BatchErrored, ""},
		{`{"custom_id":"abc","result":{"type":"succeeded"}}`, llm.BatchErrored, ""},
		{`{"custom_id":"abc","result":{"type":"processing"}}`, "", "unknown type"},
		{`{"custom_id":"abc"}`, "", "no result"},
		{`{"result":{"type":"expired"}}`, "", "no custom_id"},
		{`not json`, "", "not JSON"},
		{`{"custom_id":"abc","result":{"type":"expired"}} {}`, "", "not JSON"},
	} {
		r, err := anthropic.ParseBatchResult([]byte(tc.line))
		if tc.want != "" {
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %+v %v, want an error saying %q", tc.line, r, err, tc.want)
			}
			continue
		}
		if err != nil || r.Outcome != tc.outcome || r.CustomID != "abc" || (tc.outcome == llm.BatchSucceeded) != (r.Response != nil) ||
			(tc.outcome != llm.BatchSucceeded && r.Error == "") {
			t.Errorf("%s: %+v %v, want %s", tc.line, r, err, tc.outcome)
		}
	}
	r, _ := anthropic.ParseBatchResult([]byte(answer))
	if resp := r.Response; resp.Content != "hi" || resp.Usage.InputTokens != 3 || resp.Usage.OutputTokens != 1 || resp.FinishReason != llm.FinishToolCalls ||
		len(resp.ToolCalls) != 1 || resp.ToolCalls[0].Arguments != `{"a":1}` || resp.ID != "msg_1" {
		t.Errorf("answer %+v", resp)
	}
	r, _ = anthropic.ParseBatchResult([]byte(`{"custom_id":"abc","result":{"type":"errored","error":{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},"request_id":"req_9"}}}`))
	if r.Error != "overloaded_error: Overloaded (request req_9)" {
		t.Errorf("error %q", r.Error)
	}
}

// ParseBatchResult takes any line without panicking; what it accepts names its item,
// has an outcome, an answer exactly when it succeeded, and says why when it did not.
func FuzzParseBatchResult(f *testing.F) {
	for _, s := range []string{
		`{"custom_id":"a","result":{"type":"succeeded","message":{"type":"message","content":[]}}}`,
		`{"custom_id":"a","result":{"type":"errored","error":{"type":"error","error":{"type":"api_error","message":"x"}}}}`,
		`{"custom_id":"a","result":{"type":"expired"}}`, `{"custom_id":"a","result":{"type":"canceled"}}`,
		`{"custom_id":"a","result":null}`, `{}`, `[]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		r, err := anthropic.ParseBatchResult(line)
		if err != nil {
			return
		}
		if r.CustomID == "" || r.Outcome == "" || (r.Outcome == llm.BatchSucceeded) != (r.Response != nil) || (r.Outcome != llm.BatchSucceeded && r.Error == "") {
			t.Fatalf("%q parsed to %+v", line, r)
		}
		if r.Response == nil {
			return
		}
		for _, tc := range r.Response.ToolCalls {
			if tc.Name == "" || !json.Valid([]byte(tc.Arguments)) {
				t.Fatalf("%q: bad tool call %+v", line, tc)
			}
		}
	})
}
