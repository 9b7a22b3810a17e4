package adminui

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
)

// Bounds of the approvals page.
const (
	// approvalsPageSize is how many pending calls the page lists, oldest first.
	approvalsPageSize = 100
	// maxShownArgs and maxShownMessage bound what the page shows of a call's arguments
	// and of each message of its conversation, in characters.
	maxShownArgs    = 8000
	maxShownMessage = 4000
	// actionTimeout bounds a decision or a resolution, which a browser that goes away
	// must not cut in half (recorded, and its job not woken).
	actionTimeout = 10 * time.Second
)

// approvalsData is the approvals page's.
type approvalsData struct {
	Tenant  string // the filter; "" for every tenant
	Rows    []approvalRow
	Held    []heldRow // jobs an eval gate holds (Inspector.Held)
	More    bool      // more calls wait than the page lists
	Done    string
	NoDB    bool
	MaxNote int
}

// approvalRow is one call waiting for a decision, as the page shows it.
type approvalRow struct {
	onceflow.Approval
	Args     string // the arguments, indented when they are JSON, clipped
	JobPath  string // the job's page
	Waited   time.Duration
	Left     time.Duration
	Messages []messageView
}

// heldRow is one job an eval gate holds, as the page shows it.
type heldRow struct {
	onceflow.Held
	JobPath string
	Waited  time.Duration
	Left    time.Duration
}

// messageView is one message of a conversation, clipped.
type messageView struct {
	Role    string
	Content string
	Clipped int // characters left out of Content
	Calls   []callView
	CallID  string // the call a tool message answers
}

// callView is a tool call an assistant message made.
type callView struct {
	Name, Args string
}

// approvals serves GET /ui/approvals: the tool calls waiting for an operator's decision,
// of every tenant (or of ?tenant=), oldest first, each with its job, its arguments and
// the conversation so far, and forms to approve or reject it.
func (u *UI) approvals(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	d := approvalsData{Tenant: strings.TrimSpace(r.FormValue("tenant")), Done: approvalDoneText(r), MaxNote: onceflow.MaxDecisionNote}
	if d.Tenant != "" && !queue.ValidTenant(d.Tenant) {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad tenant", CSRF: s.csrf, Error: "A tenant is up to 64 characters of A-Z a-z 0-9 . _ -."})
		return
	}
	if u.db == nil {
		d.NoDB = true
		u.render(w, r, http.StatusOK, "approvals", page{Title: "Approvals", Nav: "approvals", CSRF: s.csrf, Data: d})
		return
	}
	list, err := u.client.Inspector().Approvals(r.Context(), d.Tenant, d.Tenant == "", approvalsPageSize+1)
	if err != nil {
		u.unavailable(w, r, err)
		return
	}
	if len(list) > approvalsPageSize {
		list, d.More = list[:approvalsPageSize], true
	}
	now := u.now()
	for _, a := range list {
		row := approvalRow{Approval: a, Args: showJSON(a.Arguments, maxShownArgs), JobPath: u.base + "jobs/" + url.PathEscape(a.JobID),
			Waited: now.Sub(a.AskedAt), Left: a.Deadline.Sub(now)}
		for _, m := range a.Messages {
			mv := messageView{Role: string(m.Role), CallID: m.ToolCallID}
			mv.Content, mv.Clipped = clipRunes(m.Content, maxShownMessage)
			for _, c := range m.ToolCalls {
				mv.Calls = append(mv.Calls, callView{Name: c.Name, Args: showJSON(c.Arguments, maxShownArgs)})
			}
			row.Messages = append(row.Messages, mv)
		}
		d.Rows = append(d.Rows, row)
	}
	held, err := u.client.Inspector().Held(r.Context(), d.Tenant, d.Tenant == "", approvalsPageSize)
	if err != nil {
		u.unavailable(w, r, err)
		return
	}
	for _, h := range held {
		d.Held = append(d.Held, heldRow{Held: h, JobPath: u.base + "jobs/" + url.PathEscape(h.JobID), Waited: now.Sub(h.HeldAt), Left: h.Deadline.Sub(now)})
	}
	u.render(w, r, http.StatusOK, "approvals", page{Title: "Approvals", Nav: "approvals", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}

// approvalAction serves POST /ui/approvals: decision approve or reject, with an
// optional note, on the call key of tenant's job; who decided is the session's admin
// key (its fingerprint). A call nobody waits on any more is reported, not an error.
func (u *UI) approvalAction(w http.ResponseWriter, r *http.Request, s *session) {
	decision := r.PostFormValue("decision")
	if decision != "approve" && decision != "reject" {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Unknown decision", CSRF: s.csrf, Error: "The decision must be approve or reject."})
		return
	}
	job, key, tenant := r.PostFormValue("job"), r.PostFormValue("key"), r.PostFormValue("tenant")
	gate := r.PostFormValue("kind") == "gate" // a held answer, not a tool call
	validKey := validCallKey(key)
	if gate {
		validKey = validAnswerKey(key)
	}
	if !queue.ValidJobID(job) || !validKey || (tenant != "" && !queue.ValidTenant(tenant)) {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad form", CSRF: s.csrf, Error: "The job, the call's key or the tenant is malformed."})
		return
	}
	by, note := "admin key "+s.key, strings.TrimSpace(r.PostFormValue("note"))
	if err := onceflow.CheckDecision(by, note); err != nil {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad note", CSRF: s.csrf, Error: "Nothing was done: " + err.Error() + "."})
		return
	}
	if u.db == nil {
		u.render(w, r, http.StatusNotFound, "message", page{Title: "No approvals", CSRF: s.csrf, Error: "This client has no PostgreSQL, so no approvals."})
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	decide := u.client.Reject
	switch {
	case gate && decision == "approve":
		decide = u.client.Release
	case gate:
		decide = u.client.RejectHeld
	case decision == "approve":
		decide = u.client.Approve
	}
	done := decision
	switch err := decide(ctx, tenant, job, key, by, note); {
	case errors.Is(err, onceflow.ErrNotWaiting):
		done = "gone" // another operator, the timeout or the job got there first
	case err != nil:
		u.unavailable(w, r, err)
		return
	}
	if gate && done != "gone" {
		done = map[string]string{"approve": "release", "reject": "reject-held"}[decision]
	}
	u.log.InfoContext(ctx, "adminui: approval decided", "decision", decision, "gate", gate, "outcome", done, "job_id", job, "tenant", tenant, "key", key, "admin_key", s.key)
	// #nosec G710 -- the target is the UI's own page: its base and one of the fixed words approve, reject, release, reject-held or gone
	http.Redirect(w, r, u.base+"approvals?done="+done, http.StatusSeeOther)
}

// approvalDoneText renders the outcome of a decision, from fixed words only.
func approvalDoneText(r *http.Request) string {
	return map[string]string{
		"approve":     "Approved: the job runs the call now.",
		"reject":      "Rejected: the job goes on without the call, and the model is told (with your note).",
		"gone":        "Nothing was done: no job waits for that decision any more (another operator decided it, its time ran out, or its job is gone).",
		"release":     "Released: the job goes on with the held answer, and its effects happen once.",
		"reject-held": "Rejected: the job fails with the gate's reason (and your note); nothing of it is sent.",
	}[r.FormValue("done")]
}

// validAnswerKey reports whether key can be a held answer's key (a ledger key: "llm-"
// and 64 hex digits).
func validAnswerKey(key string) bool {
	return strings.HasPrefix(key, "llm-") && len(key) <= 128 && !strings.ContainsFunc(key, func(r rune) bool { return r <= ' ' || r > '~' })
}

// validCallKey reports whether key can be a tool call's key ("tool-" and 64 hex digits).
func validCallKey(key string) bool {
	return strings.HasPrefix(key, "tool-") && len(key) <= 128 && !strings.ContainsFunc(key, func(r rune) bool { return r <= ' ' || r > '~' })
}

// showJSON returns s indented when it is a JSON document, else as it is; clipped to
// max characters either way.
func showJSON(s string, max int) string {
	var buf bytes.Buffer
	if json.Valid([]byte(s)) && json.Indent(&buf, []byte(s), "", "  ") == nil {
		s = buf.String()
	}
	out, cut := clipRunes(s, max)
	if cut > 0 {
		out += "…"
	}
	return out
}

// clipRunes cuts s to at most n characters and says how many it left out.
func clipRunes(s string, n int) (string, int) {
	if len(s) <= n { // fewer bytes than n: fewer characters too
		return s, 0
	}
	total := utf8.RuneCountInString(s)
	if total <= n {
		return s, 0
	}
	i := 0
	for k := range s {
		if i == n {
			return s[:k], total - n
		}
		i++
	}
	return s, 0
}
