package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/queue"
)

// The refund limit: an eval gate (onceflow.Gate) on the triage step holds a ticket whose
// refund is over Options.HoldRefundsOverCents before its commit, so nothing is written
// or sent until an operator decides: released, the ticket goes on with the held answer
// (its refund and reply go out once); rejected, it is dead-lettered and nothing is sent.
// Operators list and decide held tickets over HTTP with an admin key (Options.Operator).

// maxHeldDecisionBytes bounds the body of a decision: {"key", "by", "note"}.
const maxHeldDecisionBytes = 16 << 10

// Gates are the workflow's eval gates, for Config.Gates (a Workflow carries none): with
// HoldRefundsOverCents, a triage answer that refunds more cents holds its ticket.
func (o Options) Gates() []onceflow.Gate {
	if o.HoldRefundsOverCents <= 0 {
		return nil
	}
	return []onceflow.Gate{{Step: triageStep, Kind: Ticket{}.Kind(), Name: "refund-limit", Check: o.checkRefund}}
}

// checkRefund fails an answer that refunds more than HoldRefundsOverCents. A call the
// worker refuses anyway (another tool, arguments that do not decode) passes the gate:
// its ticket is dead-lettered with nothing sent.
func (o Options) checkRefund(resp *llm.Response) error {
	for _, call := range resp.ToolCalls {
		var r Refund
		if call.Name != refundTool.Name || decodeStrict(call.Arguments, &r) != nil {
			continue
		}
		if r.AmountCents > o.HoldRefundsOverCents {
			return fmt.Errorf("refund of %d cents over the limit of %d, order %s", r.AmountCents, o.HoldRefundsOverCents, r.OrderID)
		}
	}
	return nil
}

// holdRoutes mounts the operators' routes of held tickets, for the tenant of the
// request's admin key: GET /v1/held lists them (each with the held answer's key and
// why it is held), POST /v1/tickets/{job_id}/release and /reject decide one.
func (o Options) holdRoutes(c *onceflow.Client, mux *http.ServeMux) {
	mux.Handle("GET /v1/held", o.listHeld(c))
	mux.Handle("POST /v1/tickets/{job_id}/release", o.decideHeld(c, true))
	mux.Handle("POST /v1/tickets/{job_id}/reject", o.decideHeld(c, false))
}

// listHeld answers GET /v1/held: {"held": [...]}, oldest first, at most
// onceflow.DefaultApprovalsLimit.
func (o Options) listHeld(c *onceflow.Client) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := authenticate(w, r, o.Operator)
		if !ok {
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), onceflow.DefaultStateTimeout)
		defer cancel()
		held, err := c.Inspector().Held(ctx, tenant, false, onceflow.DefaultApprovalsLimit)
		if err != nil {
			w.Header().Set("Retry-After", "1")
			writeDetail(w, http.StatusServiceUnavailable, "held tickets unavailable; retry later")
			return
		}
		if held == nil {
			held = []onceflow.Held{}
		}
		writeJSON(w, http.StatusOK, map[string][]onceflow.Held{"held": held})
	}
}

// heldDecision is the body of a decision on a held ticket.
type heldDecision struct {
	Key  string `json:"key"`  // the held answer's key (GET /v1/held); required
	By   string `json:"by"`   // who decided; optional
	Note string `json:"note"` // why; optional (a rejected ticket's dead-letter reason shows it)
}

// decideHeld answers POST /v1/tickets/{job_id}/release (release set) or /reject: 200
// {"job_id", "key", "decision"} when recorded, or when the same decision was recorded
// already (a retry: nothing happens twice); 404 for an unknown ticket or another
// tenant's; 409 for a ticket not held on that answer (decided the other way, gone on,
// never held); 400, 413 or 415 for a bad body; 503 when a store does not answer.
func (o Options) decideHeld(c *onceflow.Client, release bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := authenticate(w, r, o.Operator)
		if !ok {
			return
		}
		id := r.PathValue("job_id")
		if !queue.ValidJobID(id) {
			writeDetail(w, http.StatusNotFound, "no such ticket")
			return
		}
		if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
			writeDetail(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
			return
		}
		var in heldDecision
		if status, err := readDecision(w, r, &in); err != nil {
			writeDetail(w, status, err.Error())
			return
		}
		// A decision is recorded and the ticket woken, or not recorded, whether or not
		// the operator stays for the answer.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), onceflow.DefaultRouteTimeout)
		defer cancel()
		decide, word := c.RejectHeld, "rejected"
		if release {
			decide, word = c.Release, "released"
		}
		err := decide(ctx, tenant, id, in.Key, in.By, in.Note)
		switch {
		case errors.Is(err, onceflow.ErrJobNotFound):
			writeDetail(w, http.StatusNotFound, "no such ticket")
		case errors.Is(err, onceflow.ErrNotWaiting):
			notHeld(ctx, c, w, tenant, id)
		case err != nil:
			w.Header().Set("Retry-After", "1")
			writeDetail(w, http.StatusServiceUnavailable, "decisions unavailable; retry later (the same decision again is safe)")
		default:
			writeJSON(w, http.StatusOK, map[string]string{"job_id": id, "key": in.Key, "decision": word})
		}
	}
}

// readDecision reads and checks the body of a decision into in, or returns the status
// and the error to answer.
func readDecision(w http.ResponseWriter, r *http.Request, in *heldDecision) (int, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxHeldDecisionBytes))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return http.StatusRequestEntityTooLarge, fmt.Errorf("body: larger than %d bytes", maxHeldDecisionBytes)
	case err != nil:
		return http.StatusBadRequest, errors.New("body: could not be read")
	}
	d := json.NewDecoder(bytes.NewReader(body))
	d.DisallowUnknownFields()
	if err := d.Decode(in); err != nil {
		return http.StatusBadRequest, fmt.Errorf("body: want {\"key\", \"by\", \"note\"}: %w", err)
	}
	if _, err := d.Token(); err != io.EOF {
		return http.StatusBadRequest, errors.New("body: one JSON object, nothing after it")
	}
	switch {
	case in.Key == "":
		return http.StatusBadRequest, errors.New("key: required: the held answer's key, from GET /v1/held")
	case len(in.Key) > 200 || strings.ContainsFunc(in.Key, func(r rune) bool { return r <= ' ' || r > '~' }):
		return http.StatusBadRequest, errors.New("key: at most 200 printable ASCII characters")
	}
	if err := onceflow.CheckDecision(in.By, in.Note); err != nil {
		return http.StatusBadRequest, err
	}
	return 0, nil
}

// notHeld answers a decision on a ticket that is not held on the key given: 409 saying
// where the ticket is, or 404 when the tenant has no such ticket.
func notHeld(ctx context.Context, c *onceflow.Client, w http.ResponseWriter, tenant, id string) {
	st, err := c.JobState(ctx, tenant, id)
	switch {
	case errors.Is(err, onceflow.ErrJobNotFound):
		writeDetail(w, http.StatusNotFound, "no such ticket")
	case err != nil:
		writeDetail(w, http.StatusConflict, "the ticket is not held on this answer")
	case st.Status == onceflow.StatusHeld:
		writeDetail(w, http.StatusConflict, "the ticket is held on another answer: see GET /v1/held")
	default:
		writeDetail(w, http.StatusConflict, fmt.Sprintf("the ticket is not held on this answer: it is %s", st.Status))
	}
}

// authenticate returns the tenant of r's credentials (fn), or answers 401 (or the
// failure of fn) and returns false.
func authenticate(w http.ResponseWriter, r *http.Request, fn func(*http.Request) (string, error)) (string, bool) {
	tenant, err := fn(r)
	switch {
	case errors.Is(err, idempotency.ErrUnauthenticated):
		w.Header().Set("WWW-Authenticate", "Bearer")
		writeDetail(w, http.StatusUnauthorized, "authentication required")
		return "", false
	case err != nil:
		idempotency.WriteTenantLookupError(w, err, "1")
		return "", false
	}
	return tenant, true
}

func writeDetail(w http.ResponseWriter, status int, detail string) {
	writeJSON(w, status, map[string]string{"detail": detail})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
