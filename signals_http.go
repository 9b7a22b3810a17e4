package onceflow

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/strictjson"
	"github.com/onceflow/onceflow/queue"
)

// Bounds of SignalHandler and ApprovalsHandler, which the operator UI and `onceflow
// approvals` apply to a decision too.
const (
	// MaxSignalBytes bounds the body of SignalHandler's POST, the signal's payload;
	// a larger one gets 413.
	MaxSignalBytes = 64 << 10
	// MaxDecisionBy bounds who decided (Decision.By), in bytes.
	MaxDecisionBy = 200
	// MaxDecisionNote bounds a decision's note (Decision.Note, which a rejected call's
	// model reads), in characters.
	MaxDecisionNote = 2000
	// DefaultApprovalsLimit and MaxApprovalsLimit are the default and the largest
	// ?limit= of ApprovalsHandler's GET.
	DefaultApprovalsLimit = 100
	MaxApprovalsLimit     = 1000
)

// maxDecisionBytes bounds the body of a decision: {"by", "note"} at their bounds, in
// escaped JSON.
const maxDecisionBytes = 16 << 10

// SignalHandler returns an http.Handler for POST .../{job_id}/signals/{name}: it sends
// the signal r.PathValue("name") to the job r.PathValue("job_id") of the tenant tenant
// returns (Client.Signal), with the request's body as its payload: one JSON value of any
// type (Content-Type application/json, at most MaxSignalBytes, read within
// DefaultBodyReadTimeout, strictly: valid UTF-8, no member name twice, nothing after the
// value). A job waiting for the signal (WaitSignal) runs at once. It answers
//
//   - 202 {"job_id", "signal", "status": "signalled"}: the signal is recorded;
//   - 202 with Idempotent-Replayed: true for the same signal with the same payload again
//     (a retried request; the job is woken again, nothing is recorded twice); 409 for
//     one with another payload: the first signal of a name stands
//     (ErrAlreadySignalled);
//   - 404 {"detail": "no such job"} for an unknown id or another tenant's job;
//   - 400 for a signal name that is not 1 to MaxStepNameLen printable ASCII characters
//     or begins with one of onceflow's prefixes, or a body that is not JSON; 415 for
//     another Content-Type; 413 for a larger body; 408 for a body that did not arrive
//     in time;
//   - 401 when tenant returns an error matching idempotency.ErrUnauthenticated (500,
//     or 503 for one matching ErrUnavailable, when it fails otherwise);
//   - 503 with Retry-After when a store does not answer within DefaultRouteTimeout, a
//     bound the client's disconnecting does not shorten (a signal is recorded and the
//     job woken, or not recorded); 501 for a client without Config.DB.
//
// The tenant comes from the request's authentication (tenant), never from a header the
// client chooses. Mount it with {job_id} and {name} wildcards:
// mux.Handle("POST /v1/jobs/{job_id}/signals/{name}", onceflow.SignalHandler(c, tenant)).
// It is safe for concurrent use.
func SignalHandler(c *Client, tenant func(*http.Request) (string, error)) http.Handler {
	tenant = usableTenant(tenant)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			writeDetail(w, http.StatusMethodNotAllowed, "method not allowed")
			return
		}
		t, ok := requestTenant(c, tenant, w, r)
		if !ok {
			return
		}
		if c.steps == nil {
			writeDetail(w, http.StatusNotImplemented, "signals need Config.DB")
			return
		}
		id, name := r.PathValue("job_id"), r.PathValue("name")
		if !queue.ValidJobID(id) {
			writeDetail(w, http.StatusNotFound, "no such job")
			return
		}
		if checkStepName(name) != nil {
			writeDetail(w, http.StatusBadRequest, fmt.Sprintf("name: a signal's name is 1 to %d printable ASCII characters and does not begin with tool:, wait:, signal: or approval:", MaxStepNameLen))
			return
		}
		if !isJSON(r) {
			writeDetail(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
			return
		}
		body, ok := readRequestBody(w, r, MaxSignalBytes)
		if !ok {
			return
		}
		if err := strictjson.Check(body); err != nil {
			writeDetail(w, http.StatusBadRequest, valueError(err).Error())
			return
		}
		payload, _ := json.Marshal(json.RawMessage(body)) // compact, as Signal records it
		// A signal is recorded and its job woken, or not recorded, whether or not the
		// client stays to read the answer.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), DefaultRouteTimeout)
		defer cancel()
		// The same signal again (a retry of a request whose answer was lost, or of one
		// whose wake failed) is answered as the first was; another is a conflict.
		replayed, err := c.signal(ctx, t, id, name, json.RawMessage(payload))
		switch {
		case errors.Is(err, ErrAlreadySignalled):
			writeDetail(w, http.StatusConflict, fmt.Sprintf("the job already has the signal %q, with another payload: the first one stands", name))
		case errors.Is(err, ErrJobNotFound):
			writeDetail(w, http.StatusNotFound, "no such job")
		case err != nil:
			c.log.WarnContext(r.Context(), "onceflow: signal failed", "err", err, "job_id", id)
			w.Header().Set("Retry-After", "1")
			writeDetail(w, http.StatusServiceUnavailable, "signals unavailable; retry later (the same signal again is safe)")
		default:
			if replayed {
				w.Header().Set(idempotency.HeaderReplayed, "true")
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusAccepted)
			_ = json.NewEncoder(w).Encode(map[string]string{"job_id": id, "signal": name, "status": "signalled"})
		}
	})
}

// ApprovalsHandler returns an http.Handler for the approvals of the tenant tenant
// returns: the tool calls its jobs wait on for a decision (NeedsApproval, Job.Approval).
//
//   - GET: the tenant's pending approvals, oldest first (Inspector.Approvals), as
//     {"approvals": [...]}, each with its job_id, key, tool, arguments, messages (the
//     conversation so far), asked_at and deadline; ?limit=N (1 to MaxApprovalsLimit,
//     default DefaultApprovalsLimit). 503 with Retry-After when PostgreSQL does not
//     answer within DefaultStateTimeout.
//   - POST with the path values job_id, key (the call's Approval.Key) and decision
//     ("approve" or "reject"): decides (Client.Approve, Client.Reject), and the job runs
//     on at once. The body is empty or a JSON object {"by": "...", "note": "..."}, both
//     optional (Content-Type application/json; by at most MaxDecisionBy bytes without
//     control characters, note at most MaxDecisionNote characters; a rejected call's
//     model reads the note). It answers 200 with the recorded decision, {"job_id", "key",
//     "approved", "by", "note", "at"}; the same decision again (a retry) 200 with the
//     recorded one and Idempotent-Replayed: true; the other decision, or one after the
//     timeout decided, 409 saying what was decided; a call no job of the tenant waits
//     on (unknown, another tenant's) 404; a decision other than approve or reject 404;
//     a bad body 400, 413 or 415; 503 with Retry-After when a store does not answer
//     within DefaultRouteTimeout, which the client's disconnecting does not shorten.
//
// Both answer 401 as StateHandler does, and 501 for a client without Config.DB. The
// tenant comes from the request's authentication (tenant), never from a header. Mount
// it on both routes:
//
//	h := onceflow.ApprovalsHandler(c, tenant)
//	mux.Handle("GET /v1/approvals", h)
//	mux.Handle("POST /v1/jobs/{job_id}/approvals/{key}/{decision}", h)
//
// It is safe for concurrent use.
func ApprovalsHandler(c *Client, tenant func(*http.Request) (string, error)) http.Handler {
	tenant = usableTenant(tenant)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodPost {
			w.Header().Set("Allow", "GET, POST")
			writeDetail(w, http.StatusMethodNotAllowed, "method not allowed")
			return
		}
		t, ok := requestTenant(c, tenant, w, r)
		if !ok {
			return
		}
		if c.steps == nil {
			writeDetail(w, http.StatusNotImplemented, "approvals need Config.DB")
			return
		}
		if r.Method == http.MethodGet {
			listApprovals(c, t, w, r)
			return
		}
		decideApproval(c, t, w, r)
	})
}

// listApprovals answers ApprovalsHandler's GET.
func listApprovals(c *Client, tenant string, w http.ResponseWriter, r *http.Request) {
	limit := DefaultApprovalsLimit
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxApprovalsLimit {
			writeDetail(w, http.StatusBadRequest, fmt.Sprintf("limit: must be 1 to %d", MaxApprovalsLimit))
			return
		}
		limit = n
	}
	ctx, cancel := context.WithTimeout(r.Context(), DefaultStateTimeout)
	defer cancel()
	list, err := c.Inspector().Approvals(ctx, tenant, false, limit)
	if err != nil {
		c.log.WarnContext(r.Context(), "onceflow: approvals unavailable", "err", err)
		w.Header().Set("Retry-After", "1")
		writeDetail(w, http.StatusServiceUnavailable, "approvals unavailable; retry later")
		return
	}
	if list == nil {
		list = []Approval{}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string][]Approval{"approvals": list})
}

// decisionBody is the optional body of a decision.
type decisionBody struct {
	By   string `json:"by"`
	Note string `json:"note"`
}

// decisionAnswer is the answer to a decision: the call and what was recorded.
type decisionAnswer struct {
	JobID string `json:"job_id"`
	Key   string `json:"key"`
	Decision
}

// decideApproval answers ApprovalsHandler's POST.
func decideApproval(c *Client, tenant string, w http.ResponseWriter, r *http.Request) {
	id, key := r.PathValue("job_id"), r.PathValue("key")
	var approve bool
	switch r.PathValue("decision") {
	case "approve":
		approve = true
	case "reject":
	default:
		writeDetail(w, http.StatusNotFound, "no such decision: approve or reject")
		return
	}
	if !queue.ValidJobID(id) || !validCallKey(key) {
		writeDetail(w, http.StatusNotFound, "no approval is pending for this call")
		return
	}
	body, ok := readRequestBody(w, r, maxDecisionBytes)
	if !ok {
		return
	}
	var in decisionBody
	if len(bytes.TrimSpace(body)) > 0 {
		if !isJSON(r) {
			writeDetail(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
			return
		}
		if err := strictjson.Decode(body, &in); err != nil {
			writeDetail(w, http.StatusBadRequest, fieldError(err).Error())
			return
		}
		if err := CheckDecision(in.By, in.Note); err != nil {
			writeDetail(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), DefaultRouteTimeout)
	defer cancel()
	// The same decision again is a retry, answered as the first was (and the job woken
	// again, in case the first wake failed); the other one is a conflict.
	d, replayed, err := c.decide(ctx, tenant, id, key, Decision{Approved: approve, By: in.By, Note: in.Note})
	switch {
	case errors.Is(err, ErrNotWaiting) && d != nil:
		writeDetail(w, http.StatusConflict, "the call was decided already: "+decisionWords(d))
		return
	case errors.Is(err, ErrNotWaiting), errors.Is(err, ErrJobNotFound):
		writeDetail(w, http.StatusNotFound, "no approval is pending for this call")
		return
	case err != nil:
		c.log.WarnContext(r.Context(), "onceflow: decision failed", "err", err, "job_id", id)
		w.Header().Set("Retry-After", "1")
		writeDetail(w, http.StatusServiceUnavailable, "approvals unavailable; retry later (the same decision again is safe)")
		return
	}
	if replayed {
		w.Header().Set(idempotency.HeaderReplayed, "true")
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(decisionAnswer{JobID: id, Key: key, Decision: *d})
}

// CheckDecision returns an error saying what is wrong with who decided (by) and the note
// of a decision, past the bounds the HTTP routes, the operator UI and `onceflow
// approvals` apply: by at most MaxDecisionBy bytes of valid UTF-8 without control
// characters, note at most MaxDecisionNote characters of valid UTF-8. Its text starts
// with the field's name ("note: ...").
func CheckDecision(by, note string) error {
	switch {
	case len(by) > MaxDecisionBy:
		return fmt.Errorf("by: too long: %d bytes, at most %d", len(by), MaxDecisionBy)
	case !utf8.ValidString(by) || strings.ContainsFunc(by, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return errors.New("by: must be text without control characters")
	case !utf8.ValidString(note):
		return errors.New("note: must be valid UTF-8")
	}
	if n := utf8.RuneCountInString(note); n > MaxDecisionNote {
		return fmt.Errorf("note: too long: %d characters, at most %d", n, MaxDecisionNote)
	}
	return nil
}

// decisionWords says what d decided, for a 409.
func decisionWords(d *Decision) string {
	w := "rejected"
	if d.Approved {
		w = "approved"
	}
	if d.TimedOut {
		w += " (nobody decided in time)"
	}
	return w
}

// validCallKey reports whether key can be a tool call's key (ToolCall.Key: "tool-" and
// 64 hex digits), so that a request names no other record.
func validCallKey(key string) bool {
	return strings.HasPrefix(key, "tool-") && len(key) <= 128 && !strings.ContainsFunc(key, func(r rune) bool { return r <= ' ' || r > '~' })
}

// decisionOn reads the decision recorded on the wait name (approval:<key>,
// gate:<key>) of tenant's job id; ErrJobNotFound when there is none.
func (c *Client) decisionOn(ctx context.Context, tenant, id, name string) (*Decision, error) {
	rec, err := c.recorded(ctx, tenant, id, signalPrefix+name)
	if err != nil {
		return nil, err
	}
	var d Decision
	if err := json.Unmarshal(rec, &d); err != nil {
		return nil, fmt.Errorf("onceflow: the decision %s of job %s does not decode: %w", clipText(name), id, err)
	}
	return &d, nil
}

// recorded reads the result of tenant's job id's record name (a signal, a decision);
// ErrJobNotFound when there is none.
func (c *Client) recorded(ctx context.Context, tenant, id, name string) ([]byte, error) {
	var rec []byte
	err := c.steps.db.QueryRow(ctx, `SELECT result FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'done'`,
		tenant, id, name).Scan(&rec)
	switch {
	case isNoRows(err):
		return nil, ErrJobNotFound
	case err != nil:
		return nil, PostgresError(fmt.Errorf("onceflow: read job %s's record: %w", id, err))
	}
	return rec, nil
}

// requestTenant returns the tenant of r, or answers r (401, or the tenant function's
// failure) and returns false.
func requestTenant(c *Client, tenant func(*http.Request) (string, error), w http.ResponseWriter, r *http.Request) (string, bool) {
	t, err := tenant(r)
	switch {
	case errors.Is(err, idempotency.ErrUnauthenticated):
		w.Header().Set("WWW-Authenticate", "Bearer")
		writeDetail(w, http.StatusUnauthorized, "authentication required")
		return "", false
	case err != nil:
		c.log.ErrorContext(r.Context(), "onceflow: telling the request's tenant failed", "err", err, "path", r.URL.Path)
		idempotency.WriteTenantLookupError(w, err, "1")
		return "", false
	}
	return t, true
}

// isJSON reports whether r's Content-Type is application/json (parameters allowed).
func isJSON(r *http.Request) bool {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return err == nil && mt == "application/json"
}

// readRequestBody reads r's body, up to limit bytes, within DefaultBodyReadTimeout, or
// answers 413, 408 or 400 and returns false.
func readRequestBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, bool) {
	body, err := readBodyWithin(w, r, limit, DefaultBodyReadTimeout)
	switch {
	case err == nil:
		return body, true
	case errors.Is(err, idempotency.ErrBodyTooLarge):
		writeDetail(w, http.StatusRequestEntityTooLarge, err.Error())
	case errors.Is(err, idempotency.ErrBodyTimeout):
		writeDetail(w, http.StatusRequestTimeout, idempotency.ErrBodyTimeout.Error())
	default:
		writeDetail(w, http.StatusBadRequest, "body: could not be read")
	}
	return nil, false
}

// valueError turns strictjson.Check's error into the 400 detail of a body that must be
// one JSON value.
func valueError(err error) error {
	var se *strictjson.Error
	if errors.As(err, &se) && se.Kind == strictjson.KindEmpty {
		return errors.New("body: empty body; want a JSON value")
	}
	return fieldError(err)
}
