package fakeserver_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/shared"

	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// oaLine is a batch input line asking gpt-4.1-mini to summarise "note <id>".
func oaLine(id string) string {
	return fmt.Sprintf(`{"custom_id":%q,"method":"POST","url":"/v1/chat/completions","body":{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"note %s"}]}}`, id, id)
}

func oaFile(ids ...string) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(oaLine(id) + "\n")
	}
	return b.String()
}

// oaSubmit uploads jsonl and creates a batch of it through the SDK.
func oaSubmit(t *testing.T, c openai.Client, jsonl string) *openai.Batch {
	t.Helper()
	f, err := c.Files.New(t.Context(), openai.FileNewParams{File: openai.File(strings.NewReader(jsonl), "in.jsonl", "application/jsonl"), Purpose: openai.FilePurposeBatch})
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Batches.New(t.Context(), openai.BatchNewParams{InputFileID: f.ID, Endpoint: openai.BatchNewParamsEndpointV1ChatCompletions,
		CompletionWindow: openai.BatchNewParamsCompletionWindow24h, Metadata: shared.Metadata{"job": "42"}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type oaOutLine struct {
	ID       string `json:"id"`
	CustomID string `json:"custom_id"`
	Response *struct {
		StatusCode int             `json:"status_code"`
		RequestID  string          `json:"request_id"`
		Body       json.RawMessage `json:"body"`
	} `json:"response"`
	Error *struct{ Code, Message string } `json:"error"`
}

// oaContent reads a file's lines through the SDK ("" : none).
func oaContent(t *testing.T, c openai.Client, id string) []oaOutLine {
	t.Helper()
	if id == "" {
		return nil
	}
	resp, err := c.Files.Content(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []oaOutLine
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var l oaOutLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("line %s: %v", sc.Bytes(), err)
		}
		out = append(out, l)
	}
	return out
}

// Through the official SDK: upload, create (validating), in_progress, finalizing,
// completed with an output file of one line per request, unordered, each the Chat
// Completions answer to its body with usage.
func TestBatches_CreatePollOutputThroughTheSDK(t *testing.T) {
	t.Parallel()
	s, url, clock := startBatches(t, fakeserver.Config{})
	c := sdk(url)
	var ids []string
	for i := range 12 {
		ids = append(ids, fmt.Sprintf("req-%02d", i))
	}
	b := oaSubmit(t, c, oaFile(ids...))
	if !strings.HasPrefix(b.ID, "batch_") || b.Status != openai.BatchStatusValidating || b.Metadata["job"] != "42" || b.Endpoint != "/v1/chat/completions" ||
		b.CompletionWindow != "24h" || b.CreatedAt != clock.Now().Unix() || b.ExpiresAt != clock.Now().Add(24*time.Hour).Unix() || b.RequestCounts.Total != 12 {
		t.Fatalf("created: %s", b.RawJSON())
	}
	poll := func() *openai.Batch {
		t.Helper()
		b, err := c.Batches.Get(t.Context(), b.ID)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if b := poll(); b.Status != openai.BatchStatusInProgress || b.OutputFileID != "" || b.InProgressAt == 0 {
		t.Fatalf("at once: %s", b.RawJSON())
	}
	clock.Advance(8 * time.Second)
	if b := poll(); b.Status != openai.BatchStatusFinalizing {
		t.Fatalf("at 8s: %s", b.Status)
	}
	clock.Advance(2 * time.Second)
	b = poll()
	if b.Status != openai.BatchStatusCompleted || b.CompletedAt != clock.Now().Unix() || b.RequestCounts.Completed != 12 || b.RequestCounts.Failed != 0 ||
		b.OutputFileID == "" || b.ErrorFileID != "" || b.Usage.InputTokens == 0 || b.Usage.TotalTokens != b.Usage.InputTokens+b.Usage.OutputTokens || b.Model != "gpt-4.1-mini" {
		t.Fatalf("completed: %s", b.RawJSON())
	}
	lines := oaContent(t, c, b.OutputFileID)
	var got []string
	var usage int64
	for _, l := range lines {
		got = append(got, l.CustomID)
		var cc openai.ChatCompletion
		if l.Response == nil || l.Response.StatusCode != 200 || !strings.HasPrefix(l.ID, "batch_req_") || !strings.HasPrefix(l.Response.RequestID, "req_") || l.Error != nil {
			t.Fatalf("line %+v", l)
		}
		if err := json.Unmarshal(l.Response.Body, &cc); err != nil || cc.Choices[0].Message.Content != fake.Summary("note "+l.CustomID) || cc.Usage.TotalTokens == 0 {
			t.Errorf("%s: body %s", l.CustomID, l.Response.Body)
		}
		usage += cc.Usage.TotalTokens
	}
	if usage != b.Usage.TotalTokens {
		t.Errorf("usage: batch %d, lines %d", b.Usage.TotalTokens, usage)
	}
	if slices.Equal(got, ids) {
		t.Errorf("output in input order %v: it is unordered", got)
	}
	if slices.Sort(got); !slices.Equal(got, ids) {
		t.Errorf("output %v, want one line per request", got)
	}
	// The answer is the synchronous endpoint's.
	_, sync := post(t, url+"/v1/chat/completions", `{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"note req-04"}]}`)
	if cc := decode(t, sync); *cc.Choices[0].Message.Content != fake.Summary("note req-04") {
		t.Errorf("synchronous: %s", sync)
	}
	f, err := c.Files.Get(t.Context(), b.OutputFileID)
	if err != nil || f.Purpose != "batch_output" || f.Bytes == 0 {
		t.Errorf("output file: %v %v", f, err)
	}
	st := s.Stats()
	if st.BatchesCreated["openai"] != 1 || st.BatchByCustomID["req-03"] != 1 || st.BatchBilledByCustomID["req-03"] != 1 || st.BatchItems["succeeded"] != 12 {
		t.Errorf("stats: %+v", st)
	}
}

// Errored requests (BatchFailEvery, or a body the endpoint refuses) and expired
// ones (BatchExpireEvery) go to the error file: a 500 server_error, the endpoint's
// 400, or batch_expired.
func TestBatches_PartialFailureAndExpiryGoToTheErrorFile(t *testing.T) {
	t.Parallel()
	cfg := fakeserver.Config{BatchFailEvery: 3, BatchExpireEvery: 4}
	s, url, clock := startBatches(t, cfg)
	c := sdk(url)
	var ids []string
	for i := range 30 {
		ids = append(ids, fmt.Sprintf("item-%d", i))
	}
	jsonl := oaFile(ids...) + `{"custom_id":"bad","method":"POST","url":"/v1/chat/completions","body":{"model":"gpt-4.1-mini","messages":[]}}` + "\n"
	b := oaSubmit(t, c, jsonl)
	clock.Advance(10 * time.Second)
	b, err := c.Batches.Get(t.Context(), b.ID)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"bad": fakeserver.BatchErrored}
	for _, id := range ids {
		want[id] = cfg.BatchOutcome(id)
	}
	if o := cfg.BatchOutcome("bad"); o != fakeserver.BatchSucceeded {
		want["bad"] = o
	}
	got := map[string]string{}
	for _, l := range oaContent(t, c, b.OutputFileID) {
		got[l.CustomID] = fakeserver.BatchSucceeded
	}
	for _, l := range oaContent(t, c, b.ErrorFileID) {
		switch {
		case l.Error != nil && l.Error.Code == "batch_expired" && l.Response == nil:
			got[l.CustomID] = fakeserver.BatchExpired
		case l.Response != nil && l.Response.StatusCode == 500 && strings.Contains(string(l.Response.Body), `"type":"server_error"`):
			got[l.CustomID] = fakeserver.BatchErrored
		case l.Response != nil && l.Response.StatusCode == 400 && l.CustomID == "bad" && strings.Contains(string(l.Response.Body), `"param":"messages"`):
			got[l.CustomID] = fakeserver.BatchErrored
		default:
			t.Errorf("error line %+v %s", l, l.Response.Body)
		}
	}
	for id, w := range want {
		if got[id] != w {
			t.Errorf("%s: %q, want %q", id, got[id], w)
		}
	}
	st := s.Stats()
	if b.RequestCounts.Total != 31 || b.RequestCounts.Completed+b.RequestCounts.Failed != 31 || b.RequestCounts.Failed == 0 ||
		int64(len(st.BatchBilledByCustomID)) != b.RequestCounts.Completed {
		t.Errorf("counts %s, billed %d", b.RequestCounts.RawJSON(), len(st.BatchBilledByCustomID))
	}
}

// A batch whose window ends first expires: the lines done are in the output file,
// the others batch_expired in the error file.
func TestBatches_WindowShorterThanDelayExpiresTheBatch(t *testing.T) {
	t.Parallel()
	_, url, clock := startBatches(t, fakeserver.Config{BatchWindow: 4 * time.Second})
	c := sdk(url)
	b := oaSubmit(t, c, oaFile("r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9"))
	clock.Advance(4 * time.Second)
	b, _ = c.Batches.Get(t.Context(), b.ID)
	if b.Status != openai.BatchStatusExpired || b.ExpiredAt != clock.Now().Unix() || b.RequestCounts.Completed != 5 || b.RequestCounts.Failed != 5 {
		t.Fatalf("expired: %s", b.RawJSON())
	}
	for _, l := range oaContent(t, c, b.ErrorFileID) {
		if l.Error == nil || l.Error.Code != "batch_expired" || l.CustomID < "r5" {
			t.Errorf("error line %+v", l)
		}
	}
}

// A cancel makes the batch cancelling, then cancelled; requests not done are in
// neither file.
func TestBatches_CancelLeavesRequestsNotDoneOut(t *testing.T) {
	t.Parallel()
	s, url, clock := startBatches(t, fakeserver.Config{})
	c := sdk(url)
	b := oaSubmit(t, c, oaFile("r0", "r1", "r2", "r3"))
	clock.Advance(4 * time.Second) // r0 and r1 done
	b, err := c.Batches.Cancel(t.Context(), b.ID)
	if err != nil || b.Status != openai.BatchStatusCancelling || b.CancellingAt != clock.Now().Unix() {
		t.Fatalf("cancel: %v %s", err, b.RawJSON())
	}
	if _, err := c.Batches.Cancel(t.Context(), b.ID); err == nil {
		t.Error("second cancel: want an error")
	}
	clock.Advance(time.Second)
	b, _ = c.Batches.Get(t.Context(), b.ID)
	if b.Status != openai.BatchStatusCancelled || b.CancelledAt == 0 || b.RequestCounts.Completed != 2 || b.RequestCounts.Failed != 0 || b.ErrorFileID != "" {
		t.Fatalf("cancelled: %s", b.RawJSON())
	}
	var got []string
	for _, l := range oaContent(t, c, b.OutputFileID) {
		got = append(got, l.CustomID)
	}
	if slices.Sort(got); !slices.Equal(got, []string{"r0", "r1"}) {
		t.Errorf("output %v, want r0 r1", got)
	}
	if st := s.Stats(); st.BatchesCancelled != 1 || st.BatchItems["canceled"] != 2 {
		t.Errorf("stats: %+v", st)
	}
}

// GET /v1/batches pages newest first with limit and after, as the SDK's auto-pager
// reads it.
func TestBatches_ListPagesNewestFirst(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{})
	c := sdk(url)
	var ids []string
	for i := range 5 {
		ids = append([]string{oaSubmit(t, c, oaFile(fmt.Sprint("r", i))).ID}, ids...)
	}
	var got []string
	pager := c.Batches.ListAutoPaging(t.Context(), openai.BatchListParams{Limit: openai.Int(2)})
	for pager.Next() {
		got = append(got, pager.Current().ID)
	}
	if err := pager.Err(); err != nil || !slices.Equal(got, ids) {
		t.Fatalf("listed %v (%v), want %v", got, err, ids)
	}
	page, err := c.Batches.List(t.Context(), openai.BatchListParams{Limit: openai.Int(2), After: openai.String(ids[3])})
	if err != nil || len(page.Data) != 1 || page.Data[0].ID != ids[4] || page.HasMore || !strings.Contains(page.RawJSON(), `"object":"list"`) {
		t.Errorf("last page: %v %s", err, page.RawJSON())
	}
	// Another key sees none of them.
	other := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("sk-other"), option.WithMaxRetries(0))
	if page, err := other.Batches.List(t.Context(), openai.BatchListParams{}); err != nil || len(page.Data) != 0 {
		t.Errorf("another key: %v %s", err, page.RawJSON())
	}
}

// A file that breaks the format makes a batch that fails validation, its errors
// naming line and code.
func TestBatches_InvalidFileFailsValidation(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{})
	c := sdk(url)
	other := strings.Replace(oaLine("e"), "gpt-4.1-mini", "gpt-4.1", 1)
	jsonl := strings.Join([]string{
		oaLine("a"),
		`not json`,
		`{"method":"POST","url":"/v1/chat/completions","body":{"model":"gpt-4.1-mini"}}`,
		oaLine("a"),
		strings.Replace(oaLine("b"), `"POST"`, `"GET"`, 1),
		strings.Replace(oaLine("c"), "/v1/chat/completions", "/v1/embeddings", 1),
		`{"custom_id":"d","method":"POST","url":"/v1/chat/completions","body":{"messages":[]}}`,
		other,
	}, "\n")
	b := oaSubmit(t, c, jsonl)
	b, err := c.Batches.Get(t.Context(), b.ID)
	if err != nil {
		t.Fatal(err)
	}
	if b.Status != openai.BatchStatusFailed || b.FailedAt == 0 || b.OutputFileID != "" {
		t.Fatalf("batch: %s", b.RawJSON())
	}
	want := map[int64]string{2: "invalid_json_line", 3: "missing_required_parameter", 4: "duplicate_custom_id", 5: "invalid_method", 6: "invalid_url", 7: "missing_required_parameter", 8: "mismatched_model"}
	if len(b.Errors.Data) != len(want) {
		t.Fatalf("errors: %s", b.Errors.RawJSON())
	}
	for _, e := range b.Errors.Data {
		if want[e.Line] != e.Code || e.Message == "" {
			t.Errorf("line %d: %s %q, want %s", e.Line, e.Code, e.Message, want[e.Line])
		}
	}
	for name, jsonl := range map[string]string{"empty": "", "blank": "\n\n"} {
		b := oaSubmit(t, c, jsonl)
		b, _ = c.Batches.Get(t.Context(), b.ID)
		if b.Status != openai.BatchStatusFailed || len(b.Errors.Data) == 0 {
			t.Errorf("%s file: %s", name, b.RawJSON())
		}
	}
}

func TestBatches_RefusesInvalidRequests(t *testing.T) {
	t.Parallel()
	_, url, _ := startBatches(t, fakeserver.Config{BatchMaxBytes: 1024})
	c := sdk(url)
	var apiErr *openai.Error
	if _, err := c.Files.New(t.Context(), openai.FileNewParams{File: openai.File(strings.NewReader(strings.Repeat("x", 2000)), "big.jsonl", "application/jsonl"),
		Purpose: openai.FilePurposeBatch}); err == nil || !strings.Contains(err.Error(), "413") {
		t.Errorf("a file too large: %v, want 413", err)
	}
	if _, err := c.Files.New(t.Context(), openai.FileNewParams{File: openai.File(strings.NewReader("x"), "a.txt", "text/plain"),
		Purpose: openai.FilePurposeAssistants}); !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "purpose" {
		t.Errorf("purpose assistants: %v, want 400 naming purpose", err)
	}
	f, err := c.Files.New(t.Context(), openai.FileNewParams{File: openai.File(strings.NewReader(oaFile("a")), "in.jsonl", "application/jsonl"), Purpose: openai.FilePurposeBatch})
	if err != nil || f.Purpose != "batch" || f.Bytes != int64(len(oaFile("a"))) || f.Filename != "in.jsonl" {
		t.Fatalf("upload: %v %v", f, err)
	}
	for name, tc := range map[string]struct{ body, param string }{
		"no file":        {`{"endpoint":"/v1/chat/completions","completion_window":"24h"}`, "input_file_id"},
		"unknown file":   {`{"input_file_id":"file-nope","endpoint":"/v1/chat/completions","completion_window":"24h"}`, "input_file_id"},
		"endpoint":       {`{"input_file_id":"` + f.ID + `","endpoint":"/v1/embeddings","completion_window":"24h"}`, "endpoint"},
		"window":         {`{"input_file_id":"` + f.ID + `","endpoint":"/v1/chat/completions","completion_window":"1h"}`, "completion_window"},
		"metadata value": {`{"input_file_id":"` + f.ID + `","endpoint":"/v1/chat/completions","completion_window":"24h","metadata":{"k":"` + strings.Repeat("v", 513) + `"}}`, "metadata"},
		"unknown field":  {`{"input_file_id":"` + f.ID + `","endpoint":"/v1/chat/completions","completion_window":"24h","priority":1}`, ""},
	} {
		resp, body := post(t, url+"/v1/batches", tc.body, "Authorization", "Bearer sk-test")
		var e struct {
			Error struct {
				Message string  `json:"message"`
				Type    string  `json:"type"`
				Param   *string `json:"param"`
			} `json:"error"`
		}
		if err := json.Unmarshal(body, &e); err != nil || resp.StatusCode != 400 || e.Error.Type != "invalid_request_error" || (tc.param != "" && (e.Error.Param == nil || *e.Error.Param != tc.param)) {
			t.Errorf("%s: %d %s, want 400 naming %q", name, resp.StatusCode, body, tc.param)
		}
	}
	// Another credential cannot read the file or make a batch of it.
	if resp, _ := get(t, url+"/v1/files/"+f.ID+"/content", "Authorization", "Bearer sk-other"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("another key's content: %d, want 404", resp.StatusCode)
	}
	if resp, body := get(t, url+"/v1/files/"+f.ID+"/content", "Authorization", "Bearer sk-test"); resp.StatusCode != 200 || string(body) != oaFile("a") {
		t.Errorf("content: %d %q", resp.StatusCode, body)
	}
	if resp, _ := get(t, url+"/v1/batches?limit=101", "Authorization", "Bearer sk-test"); resp.StatusCode != 400 {
		t.Errorf("limit 101: %d, want 400", resp.StatusCode)
	}
}

// upload posts data as a batch file to s and returns its id.
func upload(t testing.TB, s http.Handler, data []byte) string {
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	_ = mw.WriteField("purpose", "batch")
	fw, _ := mw.CreateFormFile("file", "in.jsonl")
	_, _ = fw.Write(data)
	_ = mw.Close()
	req := httptest.NewRequest(http.MethodPost, "/v1/files", &body)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	var f struct{ ID string }
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &f) != nil {
		t.Fatalf("upload: %d %s", rec.Code, rec.Body)
	}
	return f.ID
}

// Whatever the input file holds, its batch either fails validation with errors or
// runs every line, and its files hold one line per request.
func FuzzBatchInputFile(f *testing.F) {
	f.Add([]byte(oaFile("a", "b")))
	f.Add([]byte(oaLine("a") + "\r\n" + oaLine("b")))
	f.Add([]byte(oaLine("a") + "\n\n" + oaLine("b")))
	f.Add([]byte(`{"custom_id":"x","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"tool","content":[{"type":"text","text":"y"}]}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required"}}`))
	f.Add([]byte(`{"custom_id":7}` + "\n" + `[]`))
	f.Add([]byte{})
	clock := newTestClock()
	s, err := fakeserver.New(fakeserver.Config{Clock: clock.Now, BatchMaxBytes: 1 << 16, BatchMaxStoredBytes: 1 << 40, BatchRetention: time.Nanosecond})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1<<16 {
			return
		}
		id := upload(t, s, data)
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/batches", strings.NewReader(`{"input_file_id":"`+id+`","endpoint":"/v1/chat/completions","completion_window":"24h"}`)))
		var b struct {
			ID, Status string
			Errors     *struct {
				Data []struct{ Code, Message string }
			}
			RequestCounts struct{ Total, Completed, Failed int } `json:"request_counts"`
		}
		if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &b) != nil || b.Status != "validating" {
			t.Fatalf("create: %d %s", rec.Code, rec.Body)
		}
		clock.Advance(time.Hour)
		rec = httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/batches/"+b.ID, nil))
		raw := rec.Body.Bytes()
		if err := json.Unmarshal(raw, &b); err != nil {
			t.Fatal(err)
		}
		var files struct {
			Output *string `json:"output_file_id"`
			Error  *string `json:"error_file_id"`
		}
		_ = json.Unmarshal(raw, &files)
		switch b.Status {
		case "failed":
			if b.Errors == nil || len(b.Errors.Data) == 0 || b.Errors.Data[0].Code == "" {
				t.Fatalf("failed without errors: %s", raw)
			}
		case "completed":
			lines := 0
			for _, id := range []*string{files.Output, files.Error} {
				if id != nil {
					rec := httptest.NewRecorder()
					s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/files/"+*id+"/content", nil))
					n, _ := io.Copy(io.Discard, bytes.NewReader(rec.Body.Bytes()))
					if n == 0 {
						t.Fatalf("empty file %s", *id)
					}
					lines += bytes.Count(rec.Body.Bytes(), []byte("\n"))
				}
			}
			if b.RequestCounts.Total < 1 || lines != b.RequestCounts.Total || b.RequestCounts.Completed+b.RequestCounts.Failed != lines {
				t.Fatalf("completed: %d lines for %s", lines, raw)
			}
		default:
			t.Fatalf("status %s", raw)
		}
	})
}

// DELETE /v1/files/{id} deletes an uploaded file for its owner only: it is gone (404)
// and no longer counted in files_held; another credential's delete is a 404.
func TestDeletedFileIsGoneAndNoLongerHeld(t *testing.T) {
	t.Parallel()
	s, err := fakeserver.New(fakeserver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	id := upload(t, s, []byte(oaFile("a")))
	del := func(key string) int {
		req := httptest.NewRequest(http.MethodDelete, "/v1/files/"+id, nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		return rec.Code
	}
	if st := s.Stats(); st.FilesUploaded != 1 || st.FilesHeld != 1 {
		t.Fatalf("after an upload: %d uploaded, %d held", st.FilesUploaded, st.FilesHeld)
	}
	if code := del("sk-other"); code != http.StatusNotFound {
		t.Fatalf("another key's delete: %d, want 404", code)
	}
	if code := del(""); code != http.StatusOK { // upload's credential: none
		t.Fatalf("delete: %d", code)
	}
	if code := del(""); code != http.StatusNotFound {
		t.Fatalf("a second delete: %d, want 404", code)
	}
	if st := s.Stats(); st.FilesUploaded != 1 || st.FilesHeld != 0 {
		t.Fatalf("after the delete: %d uploaded, %d held, want 1 and 0", st.FilesUploaded, st.FilesHeld)
	}
}
