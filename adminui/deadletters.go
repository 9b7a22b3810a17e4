package adminui

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow/queue"
)

// Dead-letter page sizes.
const (
	deadPageSize = 50
	// deadScanLimit bounds the entries a filtered listing reads.
	deadScanLimit = 20000
	// maxBulk bounds the dead letters one bulk action names.
	maxBulk = 1000
)

// deadRow is one dead letter on the page.
type deadRow struct {
	queue.DeadLetter
	Age time.Duration
}

// deadData is the dead-letters page's.
type deadData struct {
	Queues  []string
	Queue   string
	Filter  string
	Rows    []deadRow
	Total   int64
	Next    string // the start of the next page, "" for none
	Scanned int    // entries read for a filter
	Capped  bool   // the filter stopped at deadScanLimit entries
	Done    string // what the last action did, in words
}

// queueParam returns the queue (or partition: queueNames) a request names, the
// client's first by default, and its keys; ok is false for a queue the client does not
// have.
func (u *UI) queueParam(r *http.Request) (string, queue.Keys, bool) {
	parts := u.partitions(r.Context())
	q := r.FormValue("queue")
	if q == "" && len(parts) > 0 {
		return parts[0].Name(), parts[0], true
	}
	for _, k := range parts {
		if k.Name() == q {
			return q, k, true
		}
	}
	return q, queue.Keys{}, false
}

// deadLetters serves GET /ui/dead-letters: a queue's dead letters, oldest first, a page
// at a time, or those whose job id, tenant, kind or reason contains the filter.
func (u *UI) deadLetters(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	ctx := r.Context()
	name, keys, ok := u.queueParam(r)
	if !ok {
		u.render(w, r, http.StatusNotFound, "message", page{Title: "No such queue", CSRF: s.csrf, Error: "This client has no queue of that name."})
		return
	}
	d := deadData{Queues: u.queueNames(ctx), Queue: name, Filter: strings.TrimSpace(r.FormValue("q")), Done: doneText(r)}
	if len(d.Filter) > 200 {
		d.Filter = clip(d.Filter, 200)
	}
	var err error
	if d.Total, err = u.rdb.XLen(ctx, keys.Dead()).Result(); err != nil {
		u.unavailable(w, r, err)
		return
	}
	now := u.now()
	add := func(dl queue.DeadLetter) { d.Rows = append(d.Rows, deadRow{DeadLetter: dl, Age: now.Sub(dl.FailedAt)}) }
	if d.Filter == "" {
		start := r.FormValue("after")
		if start != "" && !queue.ValidEntryID(strings.TrimPrefix(start, "(")) {
			start = ""
		}
		page, next, err := queue.ListDead(ctx, u.rdb, keys, start, deadPageSize)
		if err != nil {
			u.unavailable(w, r, err)
			return
		}
		for _, dl := range page {
			add(dl)
		}
		d.Next = next
	} else {
		f := strings.ToLower(d.Filter)
		for start := "-"; start != "" && len(d.Rows) < deadPageSize*4; {
			page, next, err := queue.ListDead(ctx, u.rdb, keys, start, 500)
			if err != nil {
				u.unavailable(w, r, err)
				return
			}
			for _, dl := range page {
				d.Scanned++
				if matches(dl, f) {
					add(dl)
				}
			}
			start = next
			if d.Scanned >= deadScanLimit {
				d.Capped = start != ""
				break
			}
		}
	}
	u.render(w, r, http.StatusOK, "dead-letters", page{Title: "Dead letters", Nav: "dead-letters", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}

func matches(dl queue.DeadLetter, f string) bool {
	for _, v := range []string{dl.JobID, dl.Tenant, dl.Kind, dl.Reason, dl.ID} {
		if strings.Contains(strings.ToLower(v), f) {
			return true
		}
	}
	return false
}

// confirmData is the confirmation page's: the form to send again with confirm=yes.
type confirmData struct {
	Question string
	Action   string // the form's action URL
	Fields   [][2]string
	Button   string
	Back     string
}

// deadLetterAction serves POST /ui/dead-letters: action replay or purge, of the
// dead letters named by id (one or more) or of all of the queue's (all=1). Purges and
// bulk actions need confirm=yes: without it the page asks.
func (u *UI) deadLetterAction(w http.ResponseWriter, r *http.Request, s *session) {
	ctx := r.Context()
	name, keys, ok := u.queueParam(r)
	if !ok {
		u.render(w, r, http.StatusNotFound, "message", page{Title: "No such queue", CSRF: s.csrf, Error: "This client has no queue of that name."})
		return
	}
	action := r.PostFormValue("action")
	if action != "replay" && action != "purge" {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Unknown action", CSRF: s.csrf, Error: "The action must be replay or purge."})
		return
	}
	all := r.PostFormValue("all") == "1"
	ids := r.PostForm["id"]
	if len(ids) > maxBulk {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Too many", CSRF: s.csrf, Error: fmt.Sprintf("A bulk action names at most %d dead letters; use all, or the CLI.", maxBulk)})
		return
	}
	for _, id := range ids {
		if !queue.ValidEntryID(id) {
			u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad id", CSRF: s.csrf, Error: "A dead-letter id is malformed."})
			return
		}
	}
	if !all && len(ids) == 0 {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Nothing selected", CSRF: s.csrf, Error: "Select at least one dead letter."})
		return
	}
	back := u.base + "dead-letters?queue=" + url.QueryEscape(name)
	if r.PostFormValue("confirm") != "yes" && (action == "purge" || all || len(ids) > 1) {
		what := fmt.Sprintf("%d dead letter", len(ids))
		if len(ids) != 1 {
			what += "s"
		}
		var upto string
		if all {
			// "All" is all the operator is asked about: the dead letters up to the
			// newest one now, not those that arrive while the question is read.
			pipe := u.rdb.Pipeline()
			n := pipe.XLen(ctx, keys.Dead())
			last := pipe.XRevRangeN(ctx, keys.Dead(), "+", "-", 1)
			if _, err := pipe.Exec(ctx); err != nil {
				u.unavailable(w, r, err)
				return
			}
			what, upto = fmt.Sprintf("all %d dead letters", n.Val()), "0-0"
			if l := last.Val(); len(l) == 1 {
				upto = l[0].ID
			}
		}
		q := fmt.Sprintf("Replay %s of queue %s? Each goes back on the queue with its job id and runs again.", what, name)
		if action == "purge" {
			q = fmt.Sprintf("Purge %s of queue %s for good? Their jobs will read as failed for a while, then be forgotten.", what, name)
		}
		fields := [][2]string{{"queue", name}, {"action", action}, {"confirm", "yes"}}
		if all {
			fields = append(fields, [2]string{"all", "1"}, [2]string{"upto", upto})
		}
		for _, id := range ids {
			fields = append(fields, [2]string{"id", id})
		}
		u.render(w, r, http.StatusOK, "confirm", page{Title: "Confirm", Nav: "dead-letters", CSRF: s.csrf,
			Data: confirmData{Question: q, Action: u.base + "dead-letters", Fields: fields, Button: strings.ToUpper(action[:1]) + action[1:], Back: back}})
		return
	}
	if all {
		upto := r.PostFormValue("upto")
		if !queue.ValidEntryID(upto) {
			u.render(w, r, http.StatusBadRequest, "message", page{Title: "Confirm again", CSRF: s.csrf, Error: "An action on all dead letters needs its confirmation page: go back and confirm again."})
			return
		}
		ids = ids[:0]
		for start := "-"; start != ""; {
			page, next, err := queue.ListDead(ctx, u.rdb, keys, start, 500)
			if err != nil {
				u.unavailable(w, r, err)
				return
			}
			for _, dl := range page {
				if queue.CompareEntryIDs(dl.ID, upto) > 0 {
					next = ""
					break
				}
				ids = append(ids, dl.ID)
			}
			start = next
		}
	}
	var done, gone, failed int
	for _, id := range ids {
		var err error
		if action == "replay" {
			_, err = queue.Replay(ctx, u.rdb, keys, id)
		} else {
			err = queue.Purge(ctx, u.rdb, keys, id, u.cfg.JobTTL)
		}
		switch {
		case err == nil:
			done++
		case errors.Is(err, queue.ErrDeadLetterNotFound):
			gone++ // replayed or purged meanwhile (another operator, the CLI)
		case errors.Is(err, queue.ErrMalformed):
			failed++ // cannot be replayed: purge it
			u.log.WarnContext(ctx, "adminui: a malformed dead letter cannot be replayed", "queue", name, "dead_id", id)
		default:
			// Redis failed: stop here. Each dead letter is either acted on or still
			// there (every action is one atomic script); the operator tries again.
			u.log.ErrorContext(ctx, "adminui: dead-letter action stopped by a store failure", "action", action, "queue", name,
				"done", done, "left", len(ids)-done-gone-failed, "err", err)
			u.unavailable(w, r, err)
			return
		}
	}
	u.log.InfoContext(ctx, "adminui: dead-letter action done", "action", action, "queue", name, "done", done, "gone", gone, "failed", failed, "admin_key", s.key)
	// #nosec G710 -- the target is the UI's own page: its base, a configured queue's name (escaped) and fixed words and numbers
	http.Redirect(w, r, fmt.Sprintf("%s&done=%s&n=%d&gone=%d&failed=%d", back, action, done, gone, failed), http.StatusSeeOther)
}

// doneText renders the outcome a redirect after an action carries (done, n, gone,
// failed), from fixed words only.
func doneText(r *http.Request) string {
	verb := map[string]string{"replay": "Replayed", "purge": "Purged"}[r.FormValue("done")]
	if verb == "" {
		return ""
	}
	num := func(k string) int {
		n, _ := strconv.Atoi(r.FormValue(k))
		return max(n, 0)
	}
	out := fmt.Sprintf("%s %d.", verb, num("n"))
	if g := num("gone"); g > 0 {
		out += fmt.Sprintf(" %d were no longer there (replayed or purged meanwhile).", g)
	}
	if f := num("failed"); f > 0 {
		out += fmt.Sprintf(" %d could not be replayed: malformed messages, which only a purge removes.", f)
	}
	return out
}

// clip cuts s to at most n bytes on a rune boundary.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
