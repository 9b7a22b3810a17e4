package redisstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"net/mail"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/queue"
)

// acceptRoute is what the summaries route does on the single-round-trip path, as the
// tests and the benchmark need it: authenticate, parse the key, check the content type,
// read and strictly validate the body, re-encode it as the canonical form, derive the
// job id from the scope (UUIDv5), and call AcceptStep with the queue's enqueue.
type acceptRoute struct {
	mw      *idempotency.Middleware
	store   *Store
	stream  string
	prefix  string
	ns      uuid.UUID
	timeout time.Duration
}

type summaryRequest struct {
	Text   string `json:"text"`
	Notify string `json:"notify"`
}

func (a *acceptRoute) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key, err := idempotency.KeyFromRequest(r.Header)
	if err != nil {
		a.mw.Respond(w, r, nil, false, err)
		return
	}
	scope, err := a.mw.Scope(r, key)
	if err != nil {
		a.mw.Respond(w, r, nil, false, err)
		return
	}
	if mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); mt != "application/json" {
		http.Error(w, `{"detail":"Content-Type must be application/json"}`, http.StatusUnsupportedMediaType)
		return
	}
	body, err := idempotency.ReadBody(r, 1<<20)
	if err != nil {
		a.mw.Respond(w, r, nil, false, err)
		return
	}
	var req summaryRequest
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		a.mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: fmt.Errorf("invalid body: %w", err)})
		return
	}
	if n := utf8.RuneCountInString(req.Text); n < 1 || n > 100_000 {
		a.mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: errors.New("text must be 1 to 100000 characters")})
		return
	}
	if _, err := mail.ParseAddress(req.Notify); err != nil {
		a.mw.Respond(w, r, nil, false, &idempotency.RequestError{Err: errors.New("notify must be an email address")})
		return
	}
	canonical, _ := json.Marshal(req) // the validated, re-encoded body
	fp := idempotency.Fingerprint(canonical)
	jobID := uuid.NewSHA1(a.ns, scope.Encode()).String()
	resp := &idempotency.Response{
		Status: http.StatusAccepted,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/summaries/" + jobID}},
		Body:   []byte(`{"job_id":"` + jobID + `","status":"queued"}`),
	}
	ctx, cancel := context.WithTimeout(r.Context(), a.timeout)
	defer cancel()
	// The queue's own enqueue (its entry format, its job index), composed into the accept.
	step, err := queue.EnqueueStep(queue.Keys{Prefix: a.prefix, Queue: "summaries"},
		queue.Message{JobID: jobID, Tenant: scope.Tenant, Payload: canonical})
	if err != nil {
		http.Error(w, `{"detail":"internal error"}`, http.StatusInternalServerError)
		return
	}
	stored, replayed, err := a.store.AcceptStep(ctx, scope, fp, resp, step)
	a.mw.Respond(w, r, stored, replayed, err)
}
