package main

import (
	"cmp"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"

	"github.com/onceflow/onceflow"
)

// maxApprovals bounds the list GET /v1/approvals answers.
const maxApprovals = 100

// operator serves the operators' routes (operatorRoutes).
type operator struct {
	c     *onceflow.Client
	admin func(*http.Request) (string, error) // the tenant an admin key decides for
	log   *slog.Logger
}

// operatorRoutes mounts the operators' routes, for admin keys only (admin returns the
// tenant of the request's admin key, or an error: 401):
//
//   - GET /v1/approvals: the tenant's tool calls waiting for a decision, oldest first
//     (Inspector.Approvals): {"approvals": [...]}, each with its job_id and key;
//   - POST /v1/jobs/{job_id}/approvals/{key}/approve and .../reject, with an optional
//     JSON body {"by", "note"} (by defaults to "operator"; a rejection's note is shown
//     to the model): the decision (Client.Approve, Client.Reject), which wakes the
//     job. 200 {"job_id", "key", "approved"}; 409 when no call of the job waits for a
//     decision under key (decided already, never asked, another tenant's); 400 for a
//     body that does not decode.
func operatorRoutes(c *onceflow.Client, admin func(*http.Request) (string, error), log *slog.Logger, mux *http.ServeMux) {
	op := &operator{c: c, admin: admin, log: cmp.Or(log, slog.Default())}
	mux.HandleFunc("GET /v1/approvals", op.list)
	mux.HandleFunc("POST /v1/jobs/{job_id}/approvals/{key}/approve", op.decide(true))
	mux.HandleFunc("POST /v1/jobs/{job_id}/approvals/{key}/reject", op.decide(false))
}

func (op *operator) list(w http.ResponseWriter, r *http.Request) {
	tenant, ok := op.authorize(w, r)
	if !ok {
		return
	}
	list, err := op.c.Inspector().Approvals(r.Context(), tenant, false, maxApprovals)
	if err != nil {
		op.log.ErrorContext(r.Context(), "list approvals", "err", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"detail": "internal error"})
		return
	}
	if list == nil {
		list = []onceflow.Approval{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"approvals": list})
}

func (op *operator) decide(approve bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := op.authorize(w, r)
		if !ok {
			return
		}
		var d struct {
			By   string `json:"by"`
			Note string `json:"note"`
		}
		if err := decodeOptional(http.MaxBytesReader(w, r.Body, 8<<10), &d); err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"detail": "body: " + err.Error()})
			return
		}
		id, key, by := r.PathValue("job_id"), r.PathValue("key"), cmp.Or(d.By, "operator")
		var err error
		if approve {
			err = op.c.Approve(r.Context(), tenant, id, key, by, d.Note)
		} else {
			err = op.c.Reject(r.Context(), tenant, id, key, by, d.Note)
		}
		switch {
		case errors.Is(err, onceflow.ErrNotWaiting):
			writeJSON(w, http.StatusConflict, map[string]string{"detail": "no call of this job waits for a decision under this key"})
		case err != nil:
			op.log.ErrorContext(r.Context(), "decide an approval", "err", err, "job_id", id, "key", key)
			writeJSON(w, http.StatusInternalServerError, map[string]string{"detail": "internal error"})
		default:
			op.log.InfoContext(r.Context(), "approval decided", "job_id", id, "key", key, "approved", approve, "by", by)
			writeJSON(w, http.StatusOK, map[string]any{"job_id": id, "key": key, "approved": approve})
		}
	}
}

// authorize answers 401 unless the request carries an admin key, and returns its
// tenant.
func (op *operator) authorize(w http.ResponseWriter, r *http.Request) (string, bool) {
	tenant, err := op.admin(r)
	if err != nil {
		w.Header().Set("WWW-Authenticate", "Bearer")
		writeJSON(w, http.StatusUnauthorized, map[string]string{"detail": "an admin key is required"})
		return "", false
	}
	return tenant, true
}

// decodeOptional decodes a JSON body into v strictly (one object, no unknown fields);
// an empty body leaves v as it is.
func decodeOptional(body io.Reader, v any) error {
	d := json.NewDecoder(body)
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	if d.More() {
		return errors.New("one JSON object expected")
	}
	return nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
