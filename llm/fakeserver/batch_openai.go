package fakeserver

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// OpenAI's Batch API: POST /v1/files (multipart, purpose=batch), GET /v1/files/{id}
// and /v1/files/{id}/content, POST /v1/batches, GET /v1/batches (newest first,
// limit and after), GET /v1/batches/{id}, POST /v1/batches/{id}/cancel. Errors are
// OpenAI's {"error": {"message", "type", "param", "code"}}.

// maxBatchCreateBytes bounds the body of POST /v1/batches.
const maxBatchCreateBytes = 1 << 20

// maxCustomIDLen bounds a custom_id of a batch input file.
const maxCustomIDLen = 512

// maxLineErrors bounds the errors a failed input file reports.
const maxLineErrors = 100

// oaBatchEndpoints are the endpoints a batch may name: those the fake answers.
var oaBatchEndpoints = []string{"/v1/chat/completions", "/v1/responses"}

// oaLineError is one error of an input file that failed validation, as a batch's
// errors.data holds it.
type oaLineError struct {
	Code    string  `json:"code"`
	Message string  `json:"message"`
	Param   *string `json:"param"`
	Line    *int    `json:"line"`
}

// parseBatchFile reads an OpenAI batch input file for endpoint: JSONL, one request
// {"custom_id", "method": "POST", "url": endpoint, "body": {...}} a line (a final
// newline and CRs before newlines are allowed, blank lines are not). It returns the
// requests, the model they all name, the custom_ids it could read (for the stats, in
// file order, duplicates included), and the errors that fail the file (at most
// maxLineErrors): an empty file, more than MaxBatchFileLines lines, a line that is
// not a JSON object, a custom_id missing, not a string, empty, longer than 512 bytes
// or repeated, a method other than POST, a url other than endpoint, a body that is
// not an object or has no model, or a model other than the first line's. What the
// body says beyond its model is the endpoint's to judge, request by request.
func parseBatchFile(data []byte, endpoint string) (items []batchItem, model string, customIDs []string, errs []oaLineError) {
	fail := func(line int, code, param, format string, args ...any) {
		if len(errs) >= maxLineErrors {
			return
		}
		e := oaLineError{Code: code, Message: fmt.Sprintf(format, args...)}
		if line > 0 {
			e.Line = &line
		}
		if param != "" {
			e.Param = &param
		}
		errs = append(errs, e)
	}
	data = bytes.TrimSuffix(data, []byte("\n"))
	if len(bytes.TrimSpace(data)) == 0 {
		fail(0, "empty_file", "", "The batch input file is empty.")
		return nil, "", nil, errs
	}
	if n := bytes.Count(data, []byte("\n")) + 1; n > MaxBatchFileLines {
		fail(0, "too_many_requests", "", "The batch input file has %d requests; a batch holds at most %d.", n, MaxBatchFileLines)
		return nil, "", nil, errs
	}
	seen := map[string]int{}
	for i, raw := range bytes.Split(data, []byte("\n")) {
		line := i + 1
		raw = bytes.TrimSuffix(raw, []byte("\r"))
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(raw, &fields); err != nil || fields == nil {
			fail(line, "invalid_json_line", "", "This line is not parseable as valid JSON: a line must be one JSON object.")
			continue
		}
		var customID string
		if err := json.Unmarshal(fields["custom_id"], &customID); err != nil || customID == "" {
			fail(line, "missing_required_parameter", "custom_id", "Missing required parameter: 'custom_id' (a non-empty string).")
			continue
		}
		customIDs = append(customIDs, customID)
		if len(customID) > maxCustomIDLen {
			fail(line, "invalid_custom_id", "custom_id", "The custom_id is %d bytes long; at most %d are allowed.", len(customID), maxCustomIDLen)
			continue
		}
		if first, ok := seen[customID]; ok {
			fail(line, "duplicate_custom_id", "custom_id", "The custom_id for this request is a duplicate of another request (line %d). The custom_id parameter must be unique for each request in a batch.", first)
			continue
		}
		seen[customID] = line
		var method, url string
		if json.Unmarshal(fields["method"], &method) != nil || method != http.MethodPost {
			fail(line, "invalid_method", "method", "The method of a batch request must be 'POST'.")
			continue
		}
		if json.Unmarshal(fields["url"], &url) != nil || url != endpoint {
			fail(line, "invalid_url", "url", "The url of this request does not match the batch's endpoint %s.", endpoint)
			continue
		}
		var body struct {
			Model json.RawMessage `json:"model"`
		}
		if b := bytes.TrimSpace(fields["body"]); len(b) == 0 || b[0] != '{' || json.Unmarshal(b, &body) != nil {
			fail(line, "invalid_request", "body", "The body of a batch request must be a JSON object.")
			continue
		}
		var m string
		if json.Unmarshal(body.Model, &m) != nil || m == "" {
			fail(line, "missing_required_parameter", "body.model", "Missing required parameter: 'body.model'.")
			continue
		}
		if model == "" {
			model = m
		} else if m != model {
			fail(line, "mismatched_model", "body.model", "The model %q of this request differs from the model %q of the batch's other requests: a batch uses one model.", truncateStr(m, 64), truncateStr(model, 64))
			continue
		}
		items = append(items, batchItem{customID: customID, body: bytes.Clone(fields["body"])})
	}
	if len(errs) > 0 {
		return nil, model, customIDs, errs
	}
	return items, model, customIDs, nil
}

// oaInvalid writes OpenAI's 400 invalid_request_error naming param.
func oaInvalid(w http.ResponseWriter, param, format string, args ...any) {
	openaiDialect{}.writeError(w, apiError{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, message: fmt.Sprintf(format, args...)})
}

func oaNotFound(w http.ResponseWriter, what, id string) {
	openaiDialect{}.writeError(w, apiError{status: http.StatusNotFound, typ: "invalid_request_error",
		message: fmt.Sprintf("No %s found with id '%s'.", what, truncateStr(id, 64))})
}

// oaStoreFull writes OpenAI's 429 for a full store.
func oaStoreFull(w http.ResponseWriter, err error) {
	openaiDialect{}.writeError(w, apiError{status: http.StatusTooManyRequests, typ: "invalid_request_error", code: "batch_storage_full", message: err.Error()})
}

// oaFile is OpenAI's file object.
type oaFile struct {
	ID            string  `json:"id"`
	Object        string  `json:"object"`
	Bytes         int     `json:"bytes"`
	CreatedAt     int64   `json:"created_at"`
	ExpiresAt     *int64  `json:"expires_at"`
	Filename      string  `json:"filename"`
	Purpose       string  `json:"purpose"`
	Status        string  `json:"status"`
	StatusDetails *string `json:"status_details"`
}

func (f *batchFile) object() oaFile {
	return oaFile{ID: f.id, Object: "file", Bytes: len(f.data), CreatedAt: f.created.Unix(), Filename: f.filename, Purpose: f.purpose, Status: "processed"}
}

// uploadFile serves POST /v1/files: a multipart form with fields purpose (batch, the
// only purpose the fake keeps) and file (at most Config.BatchMaxBytes; 413 beyond).
func (s *Server) uploadFile(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, s.cfg.BatchMaxBytes+64<<10)
	mr, err := r.MultipartReader()
	if err != nil {
		oaInvalid(w, "", "Expected a multipart/form-data body with the fields 'purpose' and 'file'.")
		return
	}
	var purpose, filename string
	var data []byte
	var hasPurpose, hasFile bool
	for {
		part, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			s.uploadError(w, err)
			return
		}
		switch part.FormName() {
		case "purpose":
			b, err := io.ReadAll(io.LimitReader(part, 256))
			if err != nil {
				s.uploadError(w, err)
				return
			}
			purpose, hasPurpose = string(b), true
		case "file":
			data, err = io.ReadAll(io.LimitReader(part, s.cfg.BatchMaxBytes+1))
			if err != nil {
				s.uploadError(w, err)
				return
			}
			if int64(len(data)) > s.cfg.BatchMaxBytes {
				s.uploadError(w, &http.MaxBytesError{Limit: s.cfg.BatchMaxBytes})
				return
			}
			filename, hasFile = part.FileName(), true
		default: // expires_after[...] and the like: accepted, ignored
			if _, err := io.Copy(io.Discard, part); err != nil {
				s.uploadError(w, err)
				return
			}
		}
	}
	switch {
	case !hasFile:
		oaInvalid(w, "file", "Missing required parameter: 'file'.")
		return
	case !hasPurpose:
		oaInvalid(w, "purpose", "Missing required parameter: 'purpose'.")
		return
	case purpose != "batch":
		oaInvalid(w, "purpose", "fake-llm keeps files of purpose 'batch' only, not '%s'.", truncateStr(purpose, 40))
		return
	}
	if filename == "" {
		filename = "upload.jsonl"
	}
	now := s.cfg.Clock()
	f := &batchFile{id: s.newID("file-", 22), owner: owner(r), filename: filename, purpose: purpose, created: now, data: data}
	st := &s.batchStore
	st.mu.Lock()
	if err := s.admit(now, int64(len(data))); err != nil {
		st.mu.Unlock()
		oaStoreFull(w, err)
		return
	}
	st.files[f.id] = f
	st.stored += int64(len(data))
	st.mu.Unlock()
	s.mu.Lock()
	s.stats.FilesUploaded++
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, f.object())
}

// uploadError answers an upload that could not be read: 413 beyond the limit, else
// 400.
func (s *Server) uploadError(w http.ResponseWriter, err error) {
	var mb *http.MaxBytesError
	if errors.As(err, &mb) {
		openaiDialect{}.writeError(w, apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error",
			message: fmt.Sprintf("The file exceeds fake-llm's limit of %d bytes (--batch-max-bytes).", s.cfg.BatchMaxBytes)})
		return
	}
	oaInvalid(w, "", "The multipart body could not be read: %s", cleanErr(err))
}

// file returns the file of r's {id} visible to r's credential, or answers 404.
func (s *Server) file(w http.ResponseWriter, r *http.Request) *batchFile {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	f := st.files[r.PathValue("id")]
	if f == nil || f.owner != owner(r) {
		oaNotFound(w, "file", r.PathValue("id"))
		return nil
	}
	return f
}

// getFile serves GET /v1/files/{id}.
func (s *Server) getFile(w http.ResponseWriter, r *http.Request) {
	if f := s.file(w, r); f != nil {
		writeJSON(w, http.StatusOK, f.object())
	}
}

// deleteFile serves DELETE /v1/files/{id}: the file is gone (a batch created from it
// keeps its requests).
func (s *Server) deleteFile(w http.ResponseWriter, r *http.Request) {
	f := s.file(w, r)
	if f == nil {
		return
	}
	st := &s.batchStore
	st.mu.Lock()
	if st.files[f.id] == f {
		delete(st.files, f.id)
		st.stored -= int64(len(f.data))
	}
	st.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"id": f.id, "object": "file", "deleted": true})
}

// fileContent serves GET /v1/files/{id}/content: the bytes of an uploaded file or of
// a batch's output or error file.
func (s *Server) fileContent(w http.ResponseWriter, r *http.Request) {
	f := s.file(w, r)
	if f == nil {
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	writeBytes(w, f.data)
}

// createBatch serves POST /v1/batches {"input_file_id", "endpoint",
// "completion_window": "24h", "metadata"}: the batch, status validating. A file that
// fails validation makes a batch that has failed when next read, its errors in
// errors.data.
func (s *Server) createBatch(w http.ResponseWriter, r *http.Request) {
	var in struct {
		InputFileID        string            `json:"input_file_id"`
		Endpoint           string            `json:"endpoint"`
		CompletionWindow   string            `json:"completion_window"`
		Metadata           map[string]string `json:"metadata"`
		OutputExpiresAfter json.RawMessage   `json:"output_expires_after"`
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBatchCreateBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		oaInvalid(w, "", "We could not parse the JSON body of your request. (%s)", cleanErr(err))
		return
	}
	switch {
	case in.InputFileID == "":
		oaInvalid(w, "input_file_id", "Missing required parameter: 'input_file_id'.")
		return
	case in.Endpoint == "":
		oaInvalid(w, "endpoint", "Missing required parameter: 'endpoint'.")
		return
	case !slices.Contains(oaBatchEndpoints, in.Endpoint):
		oaInvalid(w, "endpoint", "Invalid value for 'endpoint': fake-llm batches %s, not '%s'.", strings.Join(oaBatchEndpoints, " and "), truncateStr(in.Endpoint, 64))
		return
	case in.CompletionWindow != "24h":
		oaInvalid(w, "completion_window", "Invalid value for 'completion_window': supported values are '24h'.")
		return
	case len(in.Metadata) > 16:
		oaInvalid(w, "metadata", "Invalid 'metadata': too many properties. Expected an object with at most 16 properties, but got %d.", len(in.Metadata))
		return
	}
	for k, v := range in.Metadata {
		if len(k) > 64 || len(v) > 512 {
			oaInvalid(w, "metadata", "Invalid 'metadata': keys hold at most 64 characters and values at most 512.")
			return
		}
	}
	who := owner(r)
	now := s.cfg.Clock()
	st := &s.batchStore
	st.mu.Lock()
	f := st.files[in.InputFileID]
	if f == nil || f.owner != who || f.purpose != "batch" {
		st.mu.Unlock()
		oaInvalid(w, "input_file_id", "Invalid 'input_file_id': no file of purpose 'batch' found with id '%s'.", truncateStr(in.InputFileID, 64))
		return
	}
	data := f.data
	st.mu.Unlock()

	items, model, customIDs, errs := parseBatchFile(data, in.Endpoint)
	b := &batchRecord{id: s.newID("batch_", 24), provider: providerOpenAI, owner: who, created: now, delay: s.cfg.BatchDelay,
		window: s.cfg.BatchWindow, items: items, endpoint: in.Endpoint, inputFile: in.InputFileID, model: model, metadata: in.Metadata, invalid: errs}
	st.mu.Lock()
	if err := s.admit(now, 0); err != nil {
		st.mu.Unlock()
		oaStoreFull(w, err)
		return
	}
	s.addBatch(b, customIDs)
	out := s.oaBatch(b, now, true)
	st.mu.Unlock()
	s.log.DebugContext(r.Context(), "fake-llm batch created", "provider", providerOpenAI, "batch", b.id, "requests", len(items), "invalid", len(errs))
	writeJSON(w, http.StatusOK, out)
}

// oaBatchObject is OpenAI's batch object.
type oaBatchObject struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"`
	Endpoint         string            `json:"endpoint"`
	Model            *string           `json:"model"`
	Errors           *oaBatchErrors    `json:"errors"`
	InputFileID      string            `json:"input_file_id"`
	CompletionWindow string            `json:"completion_window"`
	Status           string            `json:"status"`
	OutputFileID     *string           `json:"output_file_id"`
	ErrorFileID      *string           `json:"error_file_id"`
	CreatedAt        int64             `json:"created_at"`
	InProgressAt     *int64            `json:"in_progress_at"`
	ExpiresAt        *int64            `json:"expires_at"`
	FinalizingAt     *int64            `json:"finalizing_at"`
	CompletedAt      *int64            `json:"completed_at"`
	FailedAt         *int64            `json:"failed_at"`
	ExpiredAt        *int64            `json:"expired_at"`
	CancellingAt     *int64            `json:"cancelling_at"`
	CancelledAt      *int64            `json:"cancelled_at"`
	RequestCounts    oaRequestCounts   `json:"request_counts"`
	Usage            oaBatchUsage      `json:"usage"`
	Metadata         map[string]string `json:"metadata"`
}

type oaBatchErrors struct {
	Object string        `json:"object"`
	Data   []oaLineError `json:"data"`
}

type oaRequestCounts struct {
	Total     int64 `json:"total"`
	Completed int64 `json:"completed"`
	Failed    int64 `json:"failed"`
}

type oaBatchUsage struct {
	InputTokens        int64 `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int64 `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int64 `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int64 `json:"total_tokens"`
}

// oaBatch renders b as it stands at now (creating: as POST /v1/batches answers,
// status validating); st.mu must be held and b settled.
func (s *Server) oaBatch(b *batchRecord, now time.Time, creating bool) oaBatchObject {
	unix := func(t time.Time) *int64 { u := t.Unix(); return &u }
	o := oaBatchObject{ID: b.id, Object: "batch", Endpoint: b.endpoint, InputFileID: b.inputFile, CompletionWindow: "24h",
		CreatedAt: b.created.Unix(), ExpiresAt: unix(b.created.Add(b.window)), Metadata: b.metadata}
	if b.model != "" {
		o.Model = &b.model
	}
	end := b.endAt()
	switch {
	case creating:
		o.Status = "validating"
		if len(b.invalid) == 0 {
			o.RequestCounts.Total = int64(len(b.items))
		}
		return o
	case len(b.invalid) > 0:
		o.Status, o.FailedAt = "failed", unix(end)
		o.Errors = &oaBatchErrors{Object: "list", Data: b.invalid}
		return o
	}
	o.InProgressAt = unix(b.created)
	o.RequestCounts.Total = int64(len(b.items))
	if !b.cancelAt.IsZero() {
		o.CancellingAt = unix(b.cancelAt)
	}
	switch {
	case !b.ended && !b.cancelAt.IsZero():
		o.Status = "cancelling"
	case !b.ended && !now.Before(b.finalizingAt()) && !b.expired():
		o.Status, o.FinalizingAt = "finalizing", unix(b.finalizingAt())
	case !b.ended:
		o.Status = "in_progress"
	case !b.cancelAt.IsZero():
		o.Status, o.CancelledAt = "cancelled", unix(end)
	case b.expired():
		o.Status, o.ExpiredAt = "expired", unix(end)
	default:
		o.Status, o.FinalizingAt, o.CompletedAt = "completed", unix(b.finalizingAt()), unix(end)
	}
	if b.ended {
		o.RequestCounts.Completed = b.counts[BatchSucceeded]
		o.RequestCounts.Failed = b.counts[BatchErrored] + b.counts[BatchExpired]
		o.Usage.InputTokens, o.Usage.OutputTokens, o.Usage.TotalTokens = b.usage[0], b.usage[1], b.usage[0]+b.usage[1]
		if b.outputFile != "" {
			o.OutputFileID = &b.outputFile
		}
		if b.errorFile != "" {
			o.ErrorFileID = &b.errorFile
		}
	}
	return o
}

// oaOutputLine is one line of a batch's output or error file.
type oaOutputLine struct {
	ID       string          `json:"id"`
	CustomID string          `json:"custom_id"`
	Response *oaLineResponse `json:"response"`
	Error    *oaLineFailure  `json:"error"`
}

type oaLineResponse struct {
	StatusCode int    `json:"status_code"`
	RequestID  string `json:"request_id"`
	Body       any    `json:"body"`
}

type oaLineFailure struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// writeOutputFiles writes b's output file (its succeeded requests) and error file
// (its errored requests, with the endpoint's error answer, and its expired ones,
// code batch_expired); a cancelled request is in neither. st.mu must be held.
func (s *Server) writeOutputFiles(b *batchRecord) {
	var out, errf bytes.Buffer
	for _, r := range b.results {
		line := oaOutputLine{ID: s.newID("batch_req_", 24), CustomID: r.customID}
		buf := &out
		switch r.outcome {
		case BatchSucceeded:
			line.Response = &oaLineResponse{StatusCode: r.status, RequestID: r.requestID, Body: json.RawMessage(r.body)}
		case BatchErrored:
			line.Response = &oaLineResponse{StatusCode: r.status, RequestID: r.requestID, Body: oaErrorBody(*r.apiErr)}
			buf = &errf
		case BatchExpired:
			line.Error = &oaLineFailure{Code: "batch_expired", Message: "This request could not be executed before the completion window expired."}
			buf = &errf
		default:
			continue
		}
		j, _ := json.Marshal(line)
		buf.Write(j)
		buf.WriteByte('\n')
	}
	file := func(data []byte, kind string) string {
		if len(data) == 0 {
			return ""
		}
		f := &batchFile{id: s.newID("file-", 22), owner: b.owner, filename: b.id + "_" + kind + ".jsonl", purpose: "batch_output",
			created: b.endAt(), data: data, batch: b.id}
		s.batchStore.files[f.id] = f
		s.batchStore.stored += int64(len(data))
		return f.id
	}
	b.outputFile = file(out.Bytes(), "output")
	b.errorFile = file(errf.Bytes(), "error")
}

// oaBatchOf returns the batch of r's {id} visible to r's credential, settled, or
// answers 404; st.mu must be held.
func (s *Server) oaBatchOf(w http.ResponseWriter, r *http.Request, now time.Time) *batchRecord {
	b := s.lookup(r.PathValue("id"), providerOpenAI, owner(r), now)
	if b == nil {
		oaNotFound(w, "batch", r.PathValue("id"))
	}
	return b
}

// getBatch serves GET /v1/batches/{id}.
func (s *Server) getBatch(w http.ResponseWriter, r *http.Request) {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	now := s.cfg.Clock()
	if b := s.oaBatchOf(w, r, now); b != nil {
		writeJSON(w, http.StatusOK, s.oaBatch(b, now, false))
	}
}

// cancelOABatch serves POST /v1/batches/{id}/cancel: the batch, status cancelling;
// 409 when it has ended or is already cancelling.
func (s *Server) cancelOABatch(w http.ResponseWriter, r *http.Request) {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	now := s.cfg.Clock()
	b := s.oaBatchOf(w, r, now)
	if b == nil {
		return
	}
	if !s.cancelBatch(b, now) {
		openaiDialect{}.writeError(w, apiError{status: http.StatusConflict, typ: "invalid_request_error",
			message: fmt.Sprintf("Cannot cancel a batch with status '%s'.", s.oaBatch(b, now, false).Status)})
		return
	}
	writeJSON(w, http.StatusOK, s.oaBatch(b, now, false))
}

// listBatches serves GET /v1/batches?limit=N&after=ID: {"object": "list", "data",
// "first_id", "last_id", "has_more"}, newest first; limit 1 to 100, default 20;
// after names the last batch of the previous page.
func (s *Server) listBatches(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit, ok := listLimit(q.Get("limit"), 20, 100)
	if !ok {
		oaInvalid(w, "limit", "Invalid 'limit': expected an integer between 1 and 100.")
		return
	}
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	now := s.cfg.Clock()
	all := s.list(providerOpenAI, owner(r), now)
	page, more := pageAfter(all, q.Get("after"), limit)
	type list struct {
		Object  string          `json:"object"`
		Data    []oaBatchObject `json:"data"`
		FirstID *string         `json:"first_id"`
		LastID  *string         `json:"last_id"`
		HasMore bool            `json:"has_more"`
	}
	out := list{Object: "list", Data: []oaBatchObject{}, HasMore: more}
	for _, b := range page {
		out.Data = append(out.Data, s.oaBatch(b, now, false))
	}
	if len(page) > 0 {
		out.FirstID, out.LastID = &page[0].id, &page[len(page)-1].id
	}
	writeJSON(w, http.StatusOK, out)
}

// listLimit reads a list's limit: def when absent, ok false when not an integer in
// [1, most].
func listLimit(v string, def, most int) (int, bool) {
	if v == "" {
		return def, true
	}
	n, err := strconv.Atoi(v)
	return n, err == nil && n >= 1 && n <= most
}

// pageAfter returns up to limit batches of all (newest first) after the one whose id
// is after ("" : from the start; unknown: none), and whether more follow.
func pageAfter(all []*batchRecord, after string, limit int) ([]*batchRecord, bool) {
	if after != "" {
		i := indexOf(all, after)
		if i < 0 {
			return nil, false
		}
		all = all[i+1:]
	}
	if len(all) > limit {
		return all[:limit], true
	}
	return all, false
}

func indexOf(all []*batchRecord, id string) int {
	for i, b := range all {
		if b.id == id {
			return i
		}
	}
	return -1
}
