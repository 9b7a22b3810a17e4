package fakeserver_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// anBatchBody is a message batch of one request per custom_id, each asking to
// summarise "note <custom_id>".
func anBatchBody(ids ...string) string {
	var reqs []string
	for _, id := range ids {
		reqs = append(reqs, fmt.Sprintf(`{"custom_id":%q,"params":{"model":"claude-haiku-4-5","max_tokens":256,"messages":[{"role":"user","content":"note %s"}]}}`, id, id))
	}
	return `{"requests":[` + strings.Join(reqs, ",") + `]}`
}

func anSDK(url, key string) anthropic.Client {
	return anthropic.NewClient(option.WithBaseURL(url), option.WithAPIKey(key), option.WithMaxRetries(0))
}

func anParams(id, text string) anthropic.MessageBatchNewParamsRequest {
	return anthropic.MessageBatchNewParamsRequest{CustomID: id, Params: anthropic.MessageBatchNewParamsRequestParams{
		Model: "claude-haiku-4-5", MaxTokens: 256, Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(text))}}}
}

// anResults reads a message batch's results through the SDK, in the order sent.
func anResults(t *testing.T, c anthropic.Client, id string) []anthropic.MessageBatchIndividualResponse {
	t.Helper()
	stream := c.Messages.Batches.ResultsStreaming(t.Context(), id, anthropic.MessageBatchResultsParams{})
	var out []anthropic.MessageBatchIndividualResponse
	for stream.Next() {
		out = append(out, stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("results of %s: %v", id, err)
	}
	return out
}

// Through the official SDK: a batch is in progress until BatchDelay has passed on
// the server's clock, then ended with one result per request, in an order that is
// not the submission order, each answered as POST /v1/messages answers it.
func TestMessageBatches_CreatePollResultsThroughTheSDK(t *testing.T) {
	t.Parallel()
	s, url, clock := startBatches(t, fakeserver.Config{})
	c := anSDK(url, "sk-ant-test")
	var reqs []anthropic.MessageBatchNewParamsRequest
	var ids []string
	for i := range 20 {
		id := fmt.Sprintf("req-%02d", i)
		ids = append(ids, id)
		reqs = append(reqs, anParams(id, "note "+id))
	}
	b, err := c.Messages.Batches.New(t.Context(), anthropic.MessageBatchNewParams{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(b.ID, "msgbatch_") || b.Type != "message_batch" || b.ProcessingStatus != anthropic.MessageBatchProcessingStatusInProgress ||
		b.RequestCounts.Processing != 20 || b.ResultsURL != "" || !b.EndedAt.IsZero() || !b.CreatedAt.Equal(clock.Now()) ||
		!b.ExpiresAt.Equal(clock.Now().Add(24*time.Hour)) {
		t.Fatalf("created: %s", b.RawJSON())
	}
	if resp, body := get(t, url+"/v1/messages/batches/"+b.ID+"/results", "X-Api-Key", "sk-ant-test"); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "invalid_request_error") {
		t.Errorf("results while in progress: %d %s, want 400", resp.StatusCode, body)
	}
	clock.Advance(9 * time.Second)
	if b, _ = c.Messages.Batches.Get(t.Context(), b.ID, anthropic.MessageBatchGetParams{}); b.ProcessingStatus != "in_progress" {
		t.Fatalf("before BatchDelay: %s", b.ProcessingStatus)
	}
	clock.Advance(time.Second)
	b, err = c.Messages.Batches.Get(t.Context(), b.ID, anthropic.MessageBatchGetParams{})
	if err != nil {
		t.Fatal(err)
	}
	if b.ProcessingStatus != "ended" || b.RequestCounts.Succeeded != 20 || b.RequestCounts.Processing != 0 || !b.EndedAt.Equal(clock.Now()) ||
		b.ResultsURL != url+"/v1/messages/batches/"+b.ID+"/results" {
		t.Fatalf("ended: %s", b.RawJSON())
	}
	results := anResults(t, c, b.ID)
	var got []string
	for _, r := range results {
		got = append(got, r.CustomID)
		if r.Result.Type != "succeeded" {
			t.Fatalf("%s: %s", r.CustomID, r.Result.RawJSON())
		}
		m := r.Result.AsSucceeded().Message
		if want := fake.Summary("note " + r.CustomID); len(m.Content) != 1 || m.Content[0].Text != want || m.StopReason != "end_turn" ||
			m.Usage.InputTokens == 0 || m.Usage.OutputTokens == 0 || !strings.HasPrefix(m.ID, "msg_") {
			t.Errorf("%s: %s, want the summary %q with usage", r.CustomID, r.Result.RawJSON(), want)
		}
	}
	if slices.Equal(got, ids) {
		t.Errorf("results in submission order %v: they are unordered", got)
	}
	if slices.Sort(got); !slices.Equal(got, ids) {
		t.Errorf("results %v, want one per request %v", got, ids)
	}
	again := anResults(t, c, b.ID)
	for i := range again {
		if again[i].RawJSON() != results[i].RawJSON() {
			t.Fatalf("second read differs at %d: %s vs %s", i, again[i].RawJSON(), results[i].RawJSON())
		}
	}
	// The answer is the synchronous endpoint's for the same body.
	_, sync := post(t, url+"/v1/messages", `{"model":"claude-haiku-4-5","max_tokens":256,"messages":[{"role":"user","content":"note req-03"}]}`)
	var m anthropic.Message
	if err := json.Unmarshal(sync, &m); err != nil {
		t.Fatal(err)
	}
	for _, r := range results {
		if r.CustomID == "req-03" {
			if bm := r.Result.Message; bm.Content[0].Text != m.Content[0].Text || bm.Usage.InputTokens != m.Usage.InputTokens || bm.Usage.OutputTokens != m.Usage.OutputTokens {
				t.Errorf("batch answer %s, synchronous %s", r.Result.Message.RawJSON(), sync)
			}
		}
	}
	st := s.Stats()
	if st.BatchItems["succeeded"] != 20 || st.BatchBilledByCustomID["req-07"] != 1 || st.BatchByCustomID["req-07"] != 1 || st.Requests != 1 {
		t.Errorf("stats: items %v billed %v submitted %v requests %d", st.BatchItems, st.BatchBilledByCustomID, st.BatchByCustomID, st.Requests)
	}
}

// BatchFailEvery and BatchExpireEvery pick the requests Config.BatchOutcome names;
// an invalid request is errored with the endpoint's invalid_request_error.
func TestMessageBatches_PartialFailureAndExpiry(t *testing.T) {
	t.Parallel()
	cfg := fakeserver.Config{BatchFailEvery: 3, BatchExpireEvery: 4}
	s, url, clock := startBatches(t, cfg)
	c := anSDK(url, "k")
	var reqs []anthropic.MessageBatchNewParamsRequest
	want := map[string]string{}
	for i := range 40 {
		id := fmt.Sprintf("item-%d", i)
		reqs = append(reqs, anParams(id, "note "+id))
		want[id] = cfg.BatchOutcome(id)
	}
	bad := anParams("bad", "hello")
	bad.Params.MaxTokens = 0 // refused by POST /v1/messages
	reqs = append(reqs, bad)
	if cfg.BatchOutcome("bad") == fakeserver.BatchSucceeded {
		want["bad"] = fakeserver.BatchErrored
	} else {
		want["bad"] = cfg.BatchOutcome("bad")
	}
	b, err := c.Messages.Batches.New(t.Context(), anthropic.MessageBatchNewParams{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	counts := map[string]int64{}
	for _, r := range anResults(t, c, b.ID) {
		counts[r.Result.Type]++
		if r.Result.Type != want[r.CustomID] {
			t.Errorf("%s: %s, want %s", r.CustomID, r.Result.Type, want[r.CustomID])
		}
		if r.Result.Type != "errored" {
			continue
		}
		e := r.Result.AsErrored().Error
		wantType := "api_error"
		if r.CustomID == "bad" {
			wantType = "invalid_request_error"
		}
		if e.Type != "error" || e.Error.Type != wantType || e.Error.Message == "" || !strings.HasPrefix(e.RequestID, "req_") {
			t.Errorf("%s: error %s, want %s", r.CustomID, e.RawJSON(), wantType)
		}
	}
	if counts["errored"] == 0 || counts["expired"] == 0 || counts["succeeded"] == 0 {
		t.Fatalf("outcomes %v: want some of each", counts)
	}
	b, _ = c.Messages.Batches.Get(t.Context(), b.ID, anthropic.MessageBatchGetParams{})
	if b.RequestCounts.Succeeded != counts["succeeded"] || b.RequestCounts.Errored != counts["errored"] || b.RequestCounts.Expired != counts["expired"] {
		t.Errorf("request_counts %s, results %v", b.RequestCounts.RawJSON(), counts)
	}
	st := s.Stats()
	if int64(len(st.BatchBilledByCustomID)) != counts["succeeded"] || st.BatchItems["errored"] != counts["errored"] || st.BatchItems["expired"] != counts["expired"] {
		t.Errorf("stats: billed %d items %v, results %v", len(st.BatchBilledByCustomID), st.BatchItems, counts)
	}
}

// A batch whose window ends before its delay expires then: the requests done by
// then succeeded, the others expired.
func TestMessageBatches_WindowShorterThanDelayExpiresTheBatch(t *testing.T) {
	t.Parallel()
	_, url, clock := startBatches(t, fakeserver.Config{BatchWindow: 4 * time.Second})
	c := anSDK(url, "k")
	var reqs []anthropic.MessageBatchNewParamsRequest
	for i := range 10 {
		reqs = append(reqs, anParams(fmt.Sprintf("r%d", i), "note"))
	}
	b, err := c.Messages.Batches.New(t.Context(), anthropic.MessageBatchNewParams{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(4 * time.Second)
	b, _ = c.Messages.Batches.Get(t.Context(), b.ID, anthropic.MessageBatchGetParams{})
	// Request i is done at 0.8·10s·(i+1)/10: r0 to r4 by 4s.
	if b.ProcessingStatus != "ended" || b.RequestCounts.Succeeded != 5 || b.RequestCounts.Expired != 5 {
		t.Fatalf("at the window's end: %s", b.RawJSON())
	}
	for _, r := range anResults(t, c, b.ID) {
		var i int
		fmt.Sscanf(r.CustomID, "r%d", &i)
		if want := map[bool]string{true: "succeeded", false: "expired"}[i < 5]; r.Result.Type != want {
			t.Errorf("%s: %s, want %s", r.CustomID, r.Result.Type, want)
		}
	}
}

// A cancel makes the batch canceling, then ended a tenth of BatchDelay later, with
// the requests not yet done canceled.
func TestMessageBatches_CancelCancelsTheRequestsNotDone(t *testing.T) {
	t.Parallel()
	s, url, clock := startBatches(t, fakeserver.Config{})
	c := anSDK(url, "k")
	var reqs []anthropic.MessageBatchNewParamsRequest
	for i := range 4 {
		reqs = append(reqs, anParams(fmt.Sprintf("r%d", i), "note"))
	}
	b, err := c.Messages.Batches.New(t.Context(), anthropic.MessageBatchNewParams{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(4 * time.Second) // r0 (2s) and r1 (4s) are done
	b, err = c.Messages.Batches.Cancel(t.Context(), b.ID, anthropic.MessageBatchCancelParams{})
	if err != nil {
		t.Fatal(err)
	}
	if b.ProcessingStatus != "canceling" || !b.CancelInitiatedAt.Equal(clock.Now()) {
		t.Fatalf("cancel: %s", b.RawJSON())
	}
	if _, err := c.Messages.Batches.Cancel(t.Context(), b.ID, anthropic.MessageBatchCancelParams{}); err == nil {
		t.Error("a second cancel: want an error")
	}
	clock.Advance(time.Second)
	b, _ = c.Messages.Batches.Get(t.Context(), b.ID, anthropic.MessageBatchGetParams{})
	if b.ProcessingStatus != "ended" || b.RequestCounts.Succeeded != 2 || b.RequestCounts.Canceled != 2 {
		t.Fatalf("after the cancel: %s", b.RawJSON())
	}
	for _, r := range anResults(t, c, b.ID) {
		if want := map[bool]string{true: "succeeded", false: "canceled"}[r.CustomID < "r2"]; r.Result.Type != want {
			t.Errorf("%s: %s, want %s", r.CustomID, r.Result.Type, want)
		}
	}
	st := s.Stats()
	if st.BatchesCancelled != 1 || st.BatchItems["canceled"] != 2 || st.BatchBilledByCustomID["r2"] != 0 {
		t.Errorf("stats: %d cancelled, items %v, billed %v", st.BatchesCancelled, st.BatchItems, st.BatchBilledByCustomID)
	}
	if _, err := c.Messages.Batches.Delete(t.Context(), b.ID, anthropic.MessageBatchDeleteParams{}); err != nil {
		t.Errorf("delete an ended batch: %v", err)
	}
	if _, err := c.Messages.Batches.Get(t.Context(), b.ID, anthropic.MessageBatchGetParams{}); err == nil {
		t.Error("a deleted batch: want 404")
	}
}

// The list is newest first and pages with after_id and before_id, as the SDK's
// auto-pager reads it.
func TestMessageBatches_ListPagesNewestFirst(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{})
	c := anSDK(url, "k")
	var ids []string
	for i := range 5 {
		b, err := c.Messages.Batches.New(t.Context(), anthropic.MessageBatchNewParams{Requests: []anthropic.MessageBatchNewParamsRequest{anParams(fmt.Sprintf("r%d", i), "x")}})
		if err != nil {
			t.Fatal(err)
		}
		ids = append([]string{b.ID}, ids...)
	}
	var got []string
	pager := c.Messages.Batches.ListAutoPaging(t.Context(), anthropic.MessageBatchListParams{Limit: anthropic.Int(2)})
	for pager.Next() {
		got = append(got, pager.Current().ID)
	}
	if err := pager.Err(); err != nil || !slices.Equal(got, ids) {
		t.Fatalf("listed %v (%v), want %v", got, err, ids)
	}
	_, body := get(t, url+"/v1/messages/batches?limit=2&before_id="+ids[3], "X-Api-Key", "k")
	var page struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
		HasMore bool   `json:"has_more"`
		FirstID string `json:"first_id"`
		LastID  string `json:"last_id"`
	}
	if err := json.Unmarshal(body, &page); err != nil || len(page.Data) != 2 || page.FirstID != ids[1] || page.LastID != ids[2] || !page.HasMore {
		t.Errorf("before_id page: %s", body)
	}
	if resp, _ := get(t, url+"/v1/messages/batches?limit=0"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("limit=0: %d, want 400", resp.StatusCode)
	}
}

func TestMessageBatches_RefusesAnInvalidBatch(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{BatchMaxBytes: 4096})
	params := `"params":{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"x"}]}`
	for name, tc := range map[string]struct {
		body, want string
		status     int
	}{
		"not json":           {`{"requests":`, "invalid JSON body", 400},
		"no requests":        {`{"requests":[]}`, "at least 1 item", 400},
		"unknown field":      {`{"requests":[{"custom_id":"a",` + params + `}],"model":"m"}`, "invalid JSON body", 400},
		"no custom_id":       {`{"requests":[{` + params + `}]}`, "requests.0.custom_id: Field required", 400},
		"custom_id too long": {`{"requests":[{"custom_id":"` + strings.Repeat("a", 65) + `",` + params + `}]}`, "requests.0.custom_id: String should match", 400},
		"custom_id charset":  {`{"requests":[{"custom_id":"a b",` + params + `}]}`, "requests.0.custom_id: String should match", 400},
		"duplicate":          {`{"requests":[{"custom_id":"a",` + params + `},{"custom_id":"a",` + params + `}]}`, "requests.1.custom_id: Duplicate custom_id 'a'", 400},
		"params not object":  {`{"requests":[{"custom_id":"a","params":[1]}]}`, "requests.0.params: Input should be a valid dictionary", 400},
		"too large":          {`{"requests":[{"custom_id":"a",` + params + `,"x":"` + strings.Repeat("y", 5000) + `"}]}`, "--batch-max-bytes", 413},
	} {
		resp, body := post(t, url+"/v1/messages/batches", tc.body)
		var e struct {
			Type  string `json:"type"`
			Error struct {
				Type    string `json:"type"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(body, &e); err != nil || resp.StatusCode != tc.status || e.Type != "error" || !strings.Contains(e.Error.Message, tc.want) {
			t.Errorf("%s: %d %s, want %d naming %q", name, resp.StatusCode, body, tc.status, tc.want)
		}
	}
	if resp, body := get(t, url+"/v1/messages/batches/msgbatch_nope"); resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "not_found_error") {
		t.Errorf("unknown batch: %d %s", resp.StatusCode, body)
	}
}

// The body parser answers 200 or a 400 in Anthropic's error shape, whatever it is
// sent.
func FuzzMessageBatchBody(f *testing.F) {
	f.Add(anBatchBody("a", "b"))
	f.Add(`{"requests":[{"custom_id":"a","params":{}}]}`)
	f.Add(`{"requests":[{"custom_id":"a","params":{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}}]}`)
	f.Add(`{"requests":null}`)
	f.Add(`{"requests":[{"custom_id":"` + strings.Repeat("z", 64) + `","params":{"stream":true}}]} {}`)
	clock := newTestClock()
	s, err := fakeserver.New(fakeserver.Config{Clock: clock.Now, BatchMaxBytes: 1 << 16, BatchMaxStoredBytes: 1 << 40, BatchRetention: time.Nanosecond})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body string) {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/messages/batches", strings.NewReader(body)))
		switch rec.Code {
		case http.StatusOK:
			var b struct {
				ID     string
				Counts struct{ Processing int } `json:"request_counts"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &b); err != nil || b.Counts.Processing < 1 {
				t.Fatalf("200 %s", rec.Body)
			}
			clock.Advance(time.Hour) // end it, produce its results, and let the next creation drop it
			res := httptest.NewRecorder()
			s.ServeHTTP(res, httptest.NewRequest(http.MethodGet, "/v1/messages/batches/"+b.ID+"/results", nil))
			if res.Code != http.StatusOK || strings.Count(res.Body.String(), "\n") != b.Counts.Processing {
				t.Fatalf("results: %d %s", res.Code, res.Body)
			}
		case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
			var e struct {
				Type  string
				Error struct{ Type, Message string }
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Type != "error" || e.Error.Message == "" {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
		default:
			t.Fatalf("%d %s", rec.Code, rec.Body)
		}
	})
}
