package adminui

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

// outboxPageSize is the rows an outbox page lists.
const outboxPageSize = 50

// outboxData is the outbox page's.
type outboxData struct {
	States []string
	State  string
	Topic  string
	Stats  pgoutbox.Stats
	Rows   []pgoutbox.Row
	Next   int64 // the Before of the next page, 0 for none
	Done   string
	NoDB   bool
}

// outboxPage serves GET /ui/outbox: the effects waiting in the outbox (unsent, failing,
// exhausted), newest first, with each row's attempts and last error.
func (u *UI) outboxPage(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	ctx := r.Context()
	d := outboxData{States: []string{pgoutbox.StateFailing, pgoutbox.StateExhausted, pgoutbox.StateUnsent, pgoutbox.StateSent, "all"},
		State: r.FormValue("state"), Topic: strings.TrimSpace(r.FormValue("topic")), Done: outboxDoneText(r)}
	if d.State == "" {
		d.State = pgoutbox.StateFailing
	}
	if !slices.Contains(d.States, d.State) {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Unknown state", CSRF: s.csrf, Error: "The state must be failing, exhausted, unsent, sent or all."})
		return
	}
	if len(d.Topic) > 200 {
		d.Topic = clip(d.Topic, 200)
	}
	st := u.outbox
	if st == nil {
		d.NoDB = true
		u.render(w, r, http.StatusOK, "outbox", page{Title: "Outbox", Nav: "outbox", CSRF: s.csrf, Data: d})
		return
	}
	var err error
	if d.Stats, err = st.Stats(ctx); err != nil {
		u.unavailable(w, r, err)
		return
	}
	state := d.State
	if state == "all" {
		state = ""
	}
	before, _ := strconv.ParseInt(r.FormValue("before"), 10, 64)
	if d.Rows, err = st.List(ctx, pgoutbox.ListOptions{State: state, Topic: d.Topic, Limit: outboxPageSize, Before: max(before, 0)}); err != nil {
		u.unavailable(w, r, err)
		return
	}
	if len(d.Rows) == outboxPageSize {
		d.Next = d.Rows[len(d.Rows)-1].ID
	}
	u.render(w, r, http.StatusOK, "outbox", page{Title: "Outbox", Nav: "outbox", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}

// outboxAction serves POST /ui/outbox: retry the exhausted rows named by id (one or
// more; more than one asks first), or every exhausted row (all=1, asks first), as
// `onceflow outbox retry` does: each is due again with a fresh count of attempts.
func (u *UI) outboxAction(w http.ResponseWriter, r *http.Request, s *session) {
	ctx := r.Context()
	st := u.outbox
	if st == nil {
		u.render(w, r, http.StatusNotFound, "message", page{Title: "No outbox", CSRF: s.csrf, Error: "This client has no PostgreSQL, so no outbox."})
		return
	}
	if r.PostFormValue("action") != "retry" {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Unknown action", CSRF: s.csrf, Error: "The action must be retry."})
		return
	}
	all := r.PostFormValue("all") == "1"
	raw := r.PostForm["id"]
	if len(raw) > maxBulk {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Too many", CSRF: s.csrf, Error: fmt.Sprintf("A bulk action names at most %d rows; use all.", maxBulk)})
		return
	}
	ids := make([]int64, 0, len(raw))
	for _, v := range raw {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil || id <= 0 {
			u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad id", CSRF: s.csrf, Error: "An outbox row id is malformed."})
			return
		}
		ids = append(ids, id)
	}
	if !all && len(ids) == 0 {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Nothing selected", CSRF: s.csrf, Error: "Select at least one row."})
		return
	}
	back := u.base + "outbox?state=" + url.QueryEscape(pgoutbox.StateExhausted)
	if r.PostFormValue("confirm") != "yes" && (all || len(ids) > 1) {
		what := fmt.Sprintf("%d exhausted rows", len(ids))
		if all {
			stats, err := st.Stats(ctx)
			if err != nil {
				u.unavailable(w, r, err)
				return
			}
			what = fmt.Sprintf("all %d exhausted rows", stats.Exhausted)
		}
		fields := [][2]string{{"action", "retry"}, {"confirm", "yes"}}
		if all {
			fields = append(fields, [2]string{"all", "1"})
		}
		for _, id := range raw {
			fields = append(fields, [2]string{"id", id})
		}
		u.render(w, r, http.StatusOK, "confirm", page{Title: "Confirm", Nav: "outbox", CSRF: s.csrf, Data: confirmData{
			Question: fmt.Sprintf("Retry %s? Each is sent again with its dedupe key, so a receiver that saw it already can tell.", what),
			Action:   u.base + "outbox", Fields: fields, Button: "Retry", Back: back}})
		return
	}
	var n int64
	var err error
	switch {
	case all:
		n, err = st.RetryAll(ctx)
	case len(ids) == 1:
		err = st.Retry(ctx, ids[0])
		if err == nil {
			n = 1
		} else if errors.Is(err, pgoutbox.ErrNotExhausted) || errors.Is(err, pgoutbox.ErrNotFound) {
			err = nil // sent, retried or gone meanwhile: nothing to do
		}
	default:
		n, err = st.RetryIDs(ctx, ids)
	}
	if err != nil {
		u.unavailable(w, r, err)
		return
	}
	u.log.InfoContext(ctx, "adminui: outbox rows retried", "rows", n, "admin_key", s.key)
	http.Redirect(w, r, fmt.Sprintf("%s&done=retry&n=%d", back, n), http.StatusSeeOther)
}

// outboxDoneText renders the outcome of a retry from fixed words only.
func outboxDoneText(r *http.Request) string {
	if r.FormValue("done") != "retry" {
		return ""
	}
	n, _ := strconv.Atoi(r.FormValue("n"))
	return fmt.Sprintf("%d rows are due again; the relay sends them within its poll interval.", max(n, 0))
}
