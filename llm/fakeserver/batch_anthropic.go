package fakeserver

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"time"
)

// Anthropic's Message Batches: POST /v1/messages/batches, GET /v1/messages/batches
// (newest first; limit, after_id, before_id), GET and DELETE
// /v1/messages/batches/{id}, POST /v1/messages/batches/{id}/cancel, GET
// /v1/messages/batches/{id}/results (JSONL, unordered). Errors are Anthropic's
// {"type": "error", "error": {"type", "message"}}.

// anCustomID is the form of a custom_id of a message batch.
var anCustomID = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// anBatchRequest is one request of POST /v1/messages/batches.
type anBatchRequest struct {
	CustomID *string         `json:"custom_id"`
	Params   json.RawMessage `json:"params"`
}

// parseMessageBatch reads the body of POST /v1/messages/batches,
// {"requests": [{"custom_id", "params"}, ...]} with nothing else: its requests and
// their custom_ids, or the message of Anthropic's 400 invalid_request_error for a
// body that is not that JSON object, no requests or more than
// MaxMessageBatchRequests, a custom_id missing, not matching ^[a-zA-Z0-9_-]{1,64}$
// or repeated, or params that are not an object. The params are the Messages
// endpoint's to judge, request by request, when the batch runs (an invalid one is
// errored), as on Anthropic, where they are validated asynchronously.
func parseMessageBatch(body []byte) ([]batchItem, []string, string) {
	var in struct {
		Requests []anBatchRequest `json:"requests"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		return nil, nil, fmt.Sprintf("invalid JSON body: %s", cleanErr(err))
	}
	if dec.More() {
		return nil, nil, "invalid JSON body: one JSON object expected"
	}
	switch {
	case len(in.Requests) == 0:
		return nil, nil, "requests: List should have at least 1 item"
	case len(in.Requests) > MaxMessageBatchRequests:
		return nil, nil, fmt.Sprintf("requests: List should have at most %d items, not %d", MaxMessageBatchRequests, len(in.Requests))
	}
	seen := make(map[string]int, len(in.Requests))
	items := make([]batchItem, 0, len(in.Requests))
	ids := make([]string, 0, len(in.Requests))
	for i, r := range in.Requests {
		switch {
		case r.CustomID == nil:
			return nil, nil, fmt.Sprintf("requests.%d.custom_id: Field required", i)
		case !anCustomID.MatchString(*r.CustomID):
			return nil, nil, fmt.Sprintf("requests.%d.custom_id: String should match pattern '^[a-zA-Z0-9_-]{1,64}$'", i)
		}
		if j, dup := seen[*r.CustomID]; dup {
			return nil, nil, fmt.Sprintf("requests.%d.custom_id: Duplicate custom_id '%s' (also requests.%d.custom_id): custom_ids must be unique within a batch", i, *r.CustomID, j)
		}
		seen[*r.CustomID] = i
		if p := bytes.TrimSpace(r.Params); len(p) == 0 || p[0] != '{' {
			return nil, nil, fmt.Sprintf("requests.%d.params: Input should be a valid dictionary", i)
		}
		items = append(items, batchItem{customID: *r.CustomID, body: r.Params})
		ids = append(ids, *r.CustomID)
	}
	return items, ids, ""
}

func anError(w http.ResponseWriter, status int, typ, format string, args ...any) {
	anthropicDialect{}.writeError(w, apiError{status: status, typ: typ, message: fmt.Sprintf(format, args...)})
}

// createMessageBatch serves POST /v1/messages/batches: the message batch, in
// progress; a body beyond Config.BatchMaxBytes gets 413.
func (s *Server) createMessageBatch(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.BatchMaxBytes))
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			anError(w, http.StatusRequestEntityTooLarge, "request_too_large", "Request exceeds fake-llm's limit of %d bytes (--batch-max-bytes).", s.cfg.BatchMaxBytes)
			return
		}
		panic(http.ErrAbortHandler) // the client went away mid-body
	}
	items, ids, msg := parseMessageBatch(body)
	if msg != "" {
		anError(w, http.StatusBadRequest, "invalid_request_error", "%s", msg)
		return
	}
	now := s.cfg.Clock()
	b := &batchRecord{id: s.newID("msgbatch_", 24), provider: providerAnthropic, owner: owner(r), created: now, delay: s.cfg.BatchDelay,
		window: s.cfg.BatchWindow, items: items, size: int64(len(body))}
	st := &s.batchStore
	st.mu.Lock()
	if err := s.admit(now, b.size); err != nil {
		st.mu.Unlock()
		anError(w, http.StatusTooManyRequests, "rate_limit_error", "%s", err.Error())
		return
	}
	s.addBatch(b, ids)
	out := s.anBatch(b, r)
	st.mu.Unlock()
	s.log.DebugContext(r.Context(), "fake-llm batch created", "provider", providerAnthropic, "batch", b.id, "requests", len(items))
	writeJSON(w, http.StatusOK, out)
}

// anBatchObject is Anthropic's message_batch object.
type anBatchObject struct {
	ID                string          `json:"id"`
	Type              string          `json:"type"`
	ProcessingStatus  string          `json:"processing_status"`
	RequestCounts     anRequestCounts `json:"request_counts"`
	EndedAt           *string         `json:"ended_at"`
	CreatedAt         string          `json:"created_at"`
	ExpiresAt         string          `json:"expires_at"`
	ArchivedAt        *string         `json:"archived_at"`
	CancelInitiatedAt *string         `json:"cancel_initiated_at"`
	ResultsURL        *string         `json:"results_url"`
}

type anRequestCounts struct {
	Processing int64 `json:"processing"`
	Succeeded  int64 `json:"succeeded"`
	Errored    int64 `json:"errored"`
	Canceled   int64 `json:"canceled"`
	Expired    int64 `json:"expired"`
}

// anBatch renders b as it stands, its results_url on the host r was sent to; st.mu
// must be held and b settled.
func (s *Server) anBatch(b *batchRecord, r *http.Request) anBatchObject {
	rfc := func(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }
	o := anBatchObject{ID: b.id, Type: "message_batch", ProcessingStatus: "in_progress", CreatedAt: rfc(b.created), ExpiresAt: rfc(b.created.Add(b.window))}
	if !b.cancelAt.IsZero() {
		c := rfc(b.cancelAt)
		o.CancelInitiatedAt = &c
		o.ProcessingStatus = "canceling"
	}
	if !b.ended {
		o.RequestCounts.Processing = int64(len(b.items))
		return o
	}
	o.ProcessingStatus = "ended"
	end := rfc(b.endAt())
	o.EndedAt = &end
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	url := scheme + "://" + r.Host + "/v1/messages/batches/" + b.id + "/results"
	o.ResultsURL = &url
	o.RequestCounts = anRequestCounts{Succeeded: b.counts[BatchSucceeded], Errored: b.counts[BatchErrored], Canceled: b.counts[BatchCanceled], Expired: b.counts[BatchExpired]}
	return o
}

// anBatchOf returns the message batch of r's {id} visible to r's credential,
// settled, or answers 404; st.mu must be held.
func (s *Server) anBatchOf(w http.ResponseWriter, r *http.Request, now time.Time) *batchRecord {
	b := s.lookup(r.PathValue("id"), providerAnthropic, owner(r), now)
	if b == nil {
		anError(w, http.StatusNotFound, "not_found_error", "Message batch '%s' not found.", truncateStr(r.PathValue("id"), 64))
	}
	return b
}

// getMessageBatch serves GET /v1/messages/batches/{id}.
func (s *Server) getMessageBatch(w http.ResponseWriter, r *http.Request) {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	if b := s.anBatchOf(w, r, s.cfg.Clock()); b != nil {
		writeJSON(w, http.StatusOK, s.anBatch(b, r))
	}
}

// cancelMessageBatch serves POST /v1/messages/batches/{id}/cancel: the batch,
// canceling; 409 when it has ended or is already canceling.
func (s *Server) cancelMessageBatch(w http.ResponseWriter, r *http.Request) {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	now := s.cfg.Clock()
	b := s.anBatchOf(w, r, now)
	if b == nil {
		return
	}
	if !s.cancelBatch(b, now) {
		anError(w, http.StatusConflict, "invalid_request_error", "Message batch %s is %s and cannot be canceled.", b.id, s.anBatch(b, r).ProcessingStatus)
		return
	}
	writeJSON(w, http.StatusOK, s.anBatch(b, r))
}

// deleteMessageBatch serves DELETE /v1/messages/batches/{id}: a batch that has
// ended goes, with its results; 409 for one still processing.
func (s *Server) deleteMessageBatch(w http.ResponseWriter, r *http.Request) {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	b := s.anBatchOf(w, r, s.cfg.Clock())
	if b == nil {
		return
	}
	if !b.ended {
		anError(w, http.StatusConflict, "invalid_request_error", "Message batch %s is still processing: cancel it before deleting it.", b.id)
		return
	}
	delete(st.batches, b.id)
	st.stored -= b.size
	writeJSON(w, http.StatusOK, map[string]string{"id": b.id, "type": "message_batch_deleted"})
}

// anResultLine is one line of a message batch's results.
type anResultLine struct {
	CustomID string   `json:"custom_id"`
	Result   anResult `json:"result"`
}

type anResult struct {
	Type    string          `json:"type"`
	Message json.RawMessage `json:"message,omitempty"`
	Error   *anErrorResult  `json:"error,omitempty"`
}

// anErrorResult is the error of an errored result: Anthropic's error response.
type anErrorResult struct {
	Type      string         `json:"type"`
	Error     map[string]any `json:"error"`
	RequestID string         `json:"request_id"`
}

// messageBatchResults serves GET /v1/messages/batches/{id}/results: JSONL, one
// result a request, in an order of its own (the same on every read); 400 while the
// batch is processing.
func (s *Server) messageBatchResults(w http.ResponseWriter, r *http.Request) {
	st := &s.batchStore
	st.mu.Lock()
	b := s.anBatchOf(w, r, s.cfg.Clock())
	if b == nil {
		st.mu.Unlock()
		return
	}
	if !b.ended {
		st.mu.Unlock()
		anError(w, http.StatusBadRequest, "invalid_request_error", "Message batch %s has not yet ended processing: its results are not available.", b.id)
		return
	}
	results := b.results
	st.mu.Unlock()
	var buf bytes.Buffer
	for _, res := range results {
		line := anResultLine{CustomID: res.customID, Result: anResult{Type: res.outcome}}
		switch res.outcome {
		case BatchSucceeded:
			line.Result.Message = res.body
		case BatchErrored:
			line.Result.Error = &anErrorResult{Type: "error", Error: anErrorObject(*res.apiErr), RequestID: res.requestID}
		}
		j, _ := json.Marshal(line)
		buf.Write(j)
		buf.WriteByte('\n')
	}
	w.Header().Set("Content-Type", "application/x-jsonl")
	writeBytes(w, buf.Bytes())
}

// listMessageBatches serves GET /v1/messages/batches?limit=N&after_id=ID&before_id=ID:
// {"data", "has_more", "first_id", "last_id"}, newest first; limit 1 to 1000,
// default 20; after_id pages on past the last batch of the previous page, before_id
// back before the first.
func (s *Server) listMessageBatches(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit, ok := listLimit(q.Get("limit"), 20, 1000)
	if !ok {
		anError(w, http.StatusBadRequest, "invalid_request_error", "limit: Input should be an integer between 1 and 1000")
		return
	}
	if q.Get("after_id") != "" && q.Get("before_id") != "" {
		anError(w, http.StatusBadRequest, "invalid_request_error", "after_id and before_id cannot both be given")
		return
	}
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	all := s.list(providerAnthropic, owner(r), s.cfg.Clock())
	var page []*batchRecord
	var more bool
	if before := q.Get("before_id"); before != "" {
		if i := indexOf(all, before); i > 0 {
			page, more = all[max(0, i-limit):i], i > limit
		}
	} else {
		page, more = pageAfter(all, q.Get("after_id"), limit)
	}
	type list struct {
		Data    []anBatchObject `json:"data"`
		HasMore bool            `json:"has_more"`
		FirstID *string         `json:"first_id"`
		LastID  *string         `json:"last_id"`
	}
	out := list{Data: []anBatchObject{}, HasMore: more}
	for _, b := range page {
		out.Data = append(out.Data, s.anBatch(b, r))
	}
	if len(page) > 0 {
		out.FirstID, out.LastID = &page[0].id, &page[len(page)-1].id
	}
	writeJSON(w, http.StatusOK, out)
}
