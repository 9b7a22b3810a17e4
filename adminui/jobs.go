package adminui

import (
	"cmp"
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// event is one step of a job's trail.
type event struct {
	At     time.Time
	What   string
	Detail string
	Link   string
	Bad    bool
}

// jobData is the job page's.
type jobData struct {
	ID                  string
	Found               bool
	Queue, Tenant, Kind string
	Status              string
	Index               *queue.JobIndex
	Message             *queue.Message
	Delivery            *queue.PendingEntry
	Dead                []queue.DeadLetter
	History             []queue.HistoryEvent // each delivery's outcome and operators' actions
	HistoryDropped      int64                // older events the bounded history let go
	Completion          *onceflow.JobState
	Calls               []ledger.Summary
	Tools               []ledger.RecordedToolCall
	Effects             []pgoutbox.Row
	Events              []event
	Partial             []string // stores that did not answer
	Acked               bool     // the latest entry was acknowledged (its run ended without a dead letter)
	// InDoubt are the tool calls of a job in doubt, each resolved with the page's forms
	// (POST Path); WaitingApproval says the job waits for a decision on a call.
	InDoubt         []inDoubtRow
	WaitingApproval bool
	Path            string // the job page's path, which its forms post to
	Done            string // what the last resolution did, in words
}

// inDoubtRow is a tool call in doubt, as the job page shows it.
type inDoubtRow struct {
	onceflow.InDoubtCall
	Args string // the arguments, indented when they are JSON, clipped
}

// jobSearch serves GET /ui/jobs: a job by its id, by the dedupe key of one of its
// effects, or by the idempotency key it was created with (with its tenant and the
// route's path, or the kind for Client.Enqueue: the job id is derived from them).
func (u *UI) jobSearch(w http.ResponseWriter, r *http.Request, s *session) {
	q := strings.TrimSpace(r.FormValue("q"))
	tenant, path, key := strings.TrimSpace(r.FormValue("tenant")), strings.TrimSpace(r.FormValue("path")), strings.TrimSpace(r.FormValue("key"))
	switch {
	case key != "":
		if path == "" {
			u.render(w, r, http.StatusBadRequest, "message", page{Title: "Search", CSRF: s.csrf, Error: "An idempotency key needs the route's path (/v1/...) or the job's kind."})
			return
		}
		// A route's POST, or Client.Enqueue's scope: the kind, and "@queue" off the
		// default queue (onceflow.EnqueueScopeOn).
		scope := idempotency.Scope{Tenant: tenant, Method: http.MethodPost, Path: path, Key: key}
		if !strings.HasPrefix(path, "/") {
			kind, q, _ := strings.Cut(path, "@")
			scope = onceflow.EnqueueScopeOn(cmp.Or(q, onceflow.DefaultQueue), tenant, kind, key)
		}
		id := onceflow.JobID(scope)
		http.Redirect(w, r, u.base+"jobs/"+url.PathEscape(id), http.StatusSeeOther)
		return
	case q == "":
		u.render(w, r, http.StatusOK, "search", page{Title: "Find a job", Nav: "jobs", CSRF: s.csrf})
		return
	case !queue.ValidJobID(q):
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Search", CSRF: s.csrf, Error: "That is not a job id or a dedupe key."})
		return
	}
	// A dedupe key names its effect's row, whose key contains the job id: find a job
	// id in it (the completion records know every committed job).
	if st := u.outbox; st != nil {
		rows, err := st.List(r.Context(), pgoutbox.ListOptions{DedupeKeyContains: q, Limit: 2})
		if err == nil {
			for _, row := range rows {
				if row.DedupeKey == q {
					if id := u.jobOfEffect(r, q); id != "" {
						http.Redirect(w, r, u.base+"jobs/"+url.PathEscape(id), http.StatusSeeOther)
						return
					}
				}
			}
		}
	}
	http.Redirect(w, r, u.base+"jobs/"+url.PathEscape(q), http.StatusSeeOther)
}

// jobOfEffect finds the job whose id the dedupe key contains: a UUID-shaped part of it
// that has a completion record.
func (u *UI) jobOfEffect(r *http.Request, dedupeKey string) string {
	for i := 0; i+36 <= len(dedupeKey); i++ {
		cand := dedupeKey[i : i+36]
		if !queue.IsUUID(cand) {
			continue
		}
		if _, err := u.client.Inspector().Completion(r.Context(), cand); err == nil {
			return cand
		}
	}
	return ""
}

// job serves GET /ui/jobs/{id}: the job's whole trail, from the stores that hold it:
// its index and stream entry (queued, the current delivery: consumer, attempts), its
// dead letters, its model calls and their tool-call keys, its completion record and its
// effects (outbox rows whose dedupe key contains the job id) with their sends.
func (u *UI) job(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	ctx := r.Context()
	d := jobData{ID: r.PathValue("id")}
	if !queue.ValidJobID(d.ID) {
		u.render(w, r, http.StatusNotFound, "job", page{Title: "Job", Nav: "jobs", CSRF: s.csrf, Data: d})
		return
	}
	store := func(name string, err error) {
		u.log.WarnContext(ctx, "adminui: job trail: a store did not answer", "store", name, "err", err)
		d.Partial = append(d.Partial, name)
	}
	for _, keys := range u.partitions(ctx) {
		name := keys.Name()
		idx, err := queue.ReadJobIndex(ctx, u.rdb, keys, d.ID)
		if errors.Is(err, queue.ErrUnknownJob) {
			continue
		}
		if err != nil {
			store("Redis", err)
			break
		}
		d.Found, d.Queue, d.Tenant, d.Index, d.Status = true, name, idx.Tenant, &idx, idx.State
		if d.History, d.HistoryDropped, err = queue.ReadHistory(ctx, u.rdb, keys, d.ID); err != nil {
			store("Redis", err)
		}
		if idx.Entry != "" {
			if m, ok, err := queue.ReadEntry(ctx, u.rdb, keys, idx.Entry); err == nil && ok {
				d.Message = &m
			}
			if p, ok, err := queue.Pending(ctx, u.rdb, keys, queue.DefaultGroup, idx.Entry); err == nil && ok {
				d.Delivery = &p
				d.Status = "running"
			} else if st, err := queue.EntryState(ctx, u.rdb, keys, queue.DefaultGroup, idx.Entry); err == nil && st == queue.EntryAcknowledged && idx.State == queue.StateQueued {
				// Its run ended without a dead letter (with or without a Commit), unless
				// the delivery was settled as waiting or failed after the index was read:
				// the script that did so changed the index in the same step.
				switch again, err := queue.ReadJobIndex(ctx, u.rdb, keys, d.ID); {
				case err == nil && again.State == idx.State && again.Entry == idx.Entry:
					d.Status, d.Acked = "done", true
				case err == nil:
					d.Index, d.Status = &again, again.State
				}
			}
		}
		if dead, err := queue.FindDead(ctx, u.rdb, keys, d.ID); err == nil {
			d.Dead = dead
		} else {
			store("Redis", err)
		}
		break
	}
	if c, err := u.client.Inspector().Completion(ctx, d.ID); err == nil {
		d.Found, d.Completion, d.Status = true, c, "done"
		d.Queue, d.Tenant, d.Kind = cmp.Or(d.Queue, c.Queue), cmp.Or(d.Tenant, c.Tenant), c.Kind
	} else if !errors.Is(err, onceflow.ErrJobNotFound) {
		store("PostgreSQL", err)
	}
	if l := u.ledger; l != nil {
		calls, err := l.List(ctx, ledger.ListOptions{Job: d.ID, Limit: 200})
		if err != nil {
			store("PostgreSQL", err)
		}
		d.Calls = calls
		var keys []string
		for _, c := range calls {
			keys = append(keys, c.Key)
		}
		if d.Tools, err = l.ToolCallsOf(ctx, keys); err != nil {
			store("PostgreSQL", err)
		}
		d.Found = d.Found || len(calls) > 0
	}
	if st := u.outbox; st != nil && len(d.ID) >= 8 {
		rows, err := st.List(ctx, pgoutbox.ListOptions{DedupeKeyContains: d.ID, Limit: 200})
		if err != nil {
			store("PostgreSQL", err)
		}
		d.Effects = rows
	}
	if d.Message != nil {
		d.Kind = cmp.Or(d.Kind, d.Message.Kind)
	}
	for _, dl := range d.Dead {
		if dl.Message != nil {
			d.Kind = cmp.Or(d.Kind, dl.Message.Kind)
		}
	}
	if d.Index != nil && d.Index.State == queue.StateFailed && d.Completion == nil && u.db != nil {
		// A dead-lettered job may be in doubt: tool calls it ran at most once whose
		// outcome nobody recorded.
		switch st, err := u.client.JobState(ctx, d.Tenant, d.ID); {
		case err == nil && st.Status == onceflow.StatusInDoubt:
			d.Status = string(onceflow.StatusInDoubt)
			for _, c := range st.InDoubt {
				d.InDoubt = append(d.InDoubt, inDoubtRow{InDoubtCall: c, Args: showJSON(c.Arguments, maxShownArgs)})
			}
		case err != nil && !errors.Is(err, onceflow.ErrJobNotFound):
			store("PostgreSQL", err)
		}
	}
	d.WaitingApproval = d.Index != nil && d.Index.State == queue.StateScheduled && strings.HasPrefix(d.Index.Waiting, "signal approval:")
	d.Path, d.Done = u.base+"jobs/"+url.PathEscape(d.ID), resolveDoneText(r)
	d.Events = trail(&d, u.base)
	status := http.StatusOK
	if !d.Found && len(d.Partial) == 0 {
		status = http.StatusNotFound
	}
	u.render(w, r, status, "job", page{Title: "Job " + d.ID, Nav: "jobs", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}

// trail orders what the stores know of a job in time.
func trail(d *jobData, base string) []event {
	var ev []event
	enq := func(m *queue.Message, what string) {
		if m != nil && !m.EnqueuedAt.IsZero() {
			ev = append(ev, event{At: m.EnqueuedAt, What: what, Detail: "tenant " + cmp.Or(m.Tenant, "(none)") + ", kind " + cmp.Or(m.Kind, "(default)") + attempts(m.Attempts)})
		}
	}
	deadLink := base + "dead-letters?queue=" + url.QueryEscape(d.Queue) + "&q=" + url.QueryEscape(d.ID)
	// The dead letters the history records, and the entries operators' replays added.
	inHistory, replayedAs := map[string]bool{}, map[string]bool{}
	for _, h := range d.History {
		switch h.Outcome {
		case queue.OutcomeDeadLettered:
			inHistory[h.DeadID] = true
		case queue.OutcomeReplayed:
			replayedAs[h.Entry] = true
		}
	}
	for _, dl := range d.Dead {
		enq(dl.Message, "enqueued")
		if !inHistory[dl.ID] { // dead-lettered before histories were kept
			ev = append(ev, event{At: dl.FailedAt, What: "dead-lettered", Bad: true,
				Detail: dl.Reason + " (after " + itoa(dl.Deliveries) + " deliveries)", Link: deadLink})
		}
	}
	ev = append(ev, historyEvents(d, deadLink)...)
	if d.Message != nil {
		what := "enqueued"
		if len(d.Dead) > 0 || (d.Index != nil && replayedAs[d.Index.Entry]) {
			what = "enqueued again (replayed)"
		}
		enq(d.Message, what)
	} else if at, entry := firstEntry(d); len(d.Dead) == 0 && !at.IsZero() {
		// Its entry was trimmed once done: the stream entry id it had (or its first
		// delivery's) is when it was added.
		ev = append(ev, event{At: at, What: "enqueued", Detail: "as stream entry " + entry + " (trimmed since it finished)"})
	}
	if d.Index != nil && d.Index.State == queue.StateScheduled && !d.Index.RunAt.IsZero() {
		ev = append(ev, event{At: d.Index.RunAt, What: "scheduled to run", Detail: d.Index.Waiting})
	}
	if p := d.Delivery; p != nil {
		ev = append(ev, event{At: time.Now().Add(-p.Idle), What: "delivered (running)", Detail: "consumer " + p.Consumer + ", delivery " + itoa(p.Deliveries)})
	}
	for _, c := range d.Calls {
		detail := c.Model + ", attempt " + itoa(int64(c.Attempt))
		if c.Ambiguous > 0 {
			detail += ", " + itoa(int64(c.Ambiguous)) + " ambiguous"
		}
		if c.InputTokens+c.OutputTokens > 0 {
			detail += ", " + itoa(c.InputTokens) + " + " + itoa(c.OutputTokens) + " tokens"
		}
		ev = append(ev, event{At: c.CreatedAt, What: "model call " + stepOf(c.Work) + " began", Detail: "key " + c.Key})
		ev = append(ev, event{At: c.UpdatedAt, What: "model call " + stepOf(c.Work) + ": " + c.State, Detail: detail + errSuffix(c.Error), Bad: c.State == ledger.StateFailed})
	}
	for _, t := range d.Tools {
		ev = append(ev, event{At: t.CreatedAt, What: "tool call " + t.Tool, Detail: "downstream key " + t.Key})
	}
	if c := d.Completion; c != nil {
		ev = append(ev, event{At: c.CompletedAt, What: "committed", Detail: "result and effects in one transaction"})
	}
	for _, e := range d.Effects {
		ev = append(ev, event{At: e.CreatedAt, What: "effect " + e.Topic + " written", Detail: "dedupe key " + e.DedupeKey})
		switch {
		case e.SentAt != nil:
			ev = append(ev, event{At: *e.SentAt, What: "effect " + e.Topic + " sent", Detail: "after " + itoa(int64(e.Attempts)) + " failed attempts"})
		case e.ExhaustedAt != nil:
			ev = append(ev, event{At: *e.ExhaustedAt, What: "effect " + e.Topic + " exhausted", Detail: e.LastError, Bad: true, Link: base + "outbox?state=exhausted"})
		case e.LastError != "":
			ev = append(ev, event{At: e.NextAttemptAt, What: "effect " + e.Topic + " to be tried again", Detail: e.LastError, Bad: true})
		}
	}
	slices.SortStableFunc(ev, func(a, b event) int { return a.At.Compare(b.At) })
	if d.Acked && d.Index != nil && !slices.ContainsFunc(d.History, func(h queue.HistoryEvent) bool {
		return h.Entry == d.Index.Entry && (h.Outcome == queue.OutcomeSucceeded || h.Outcome == queue.OutcomeCompleted)
	}) {
		// Its success was not recorded (RecordSuccesses off): the acknowledgement says it.
		var at time.Time
		if len(ev) > 0 {
			at = ev[len(ev)-1].At
		}
		ev = append(ev, event{At: at, What: "run succeeded (acknowledged)",
			Detail: "entry " + d.Index.Entry + "; its consumer and times are recorded with ONCEFLOW_RECORD_SUCCESSES=true"})
	}
	return ev
}

// historyEvents turns the job's history into trail events: one per delivery, with the
// deliveries that never reported (a gap in an entry's delivery numbers: their worker
// died or lost its lease) shown where the next one of the same entry began.
// firstEntry returns the oldest stream entry the job's index and history name, and when
// it was added (its id's milliseconds); zero when they name none.
func firstEntry(d *jobData) (time.Time, string) {
	var ids []string
	if d.Index != nil && d.Index.Entry != "" {
		ids = append(ids, d.Index.Entry)
	}
	for _, h := range d.History {
		if h.Outcome != queue.OutcomeReplayed && h.Entry != "" {
			ids = append(ids, h.Entry)
		}
	}
	var first time.Time
	var entry string
	for _, id := range ids {
		ms, _, ok := strings.Cut(id, "-")
		n, err := strconv.ParseInt(ms, 10, 64)
		if !ok || err != nil {
			continue
		}
		if at := time.UnixMilli(n).UTC(); first.IsZero() || at.Before(first) {
			first, entry = at, id
		}
	}
	return first, entry
}

func historyEvents(d *jobData, deadLink string) []event {
	var ev []event
	last := map[string]int64{} // entry -> the last delivery number seen
	firstEnqueue := false      // the enqueue before the first replay is shown
	gaps := func(entry string, n int64, at time.Time) {
		for k := last[entry] + 1; k < n; k++ {
			ev = append(ev, event{At: at, What: "delivery " + itoa(k) + " never reported", Bad: true,
				Detail: "entry " + entry + ": its worker died or lost its lease before settling it; the entry was delivered again"})
		}
		last[entry] = max(last[entry], n)
	}
	for _, h := range d.History {
		at := h.End
		if h.Delivery > 0 {
			gaps(h.Entry, h.Delivery, cmp.Or(h.Start, h.End).Add(-time.Millisecond))
		}
		e := event{At: at}
		ran := ""
		if !h.Start.IsZero() && !h.End.IsZero() {
			ran = ", ran " + dur(h.End.Sub(h.Start))
		}
		where := "on " + cmp.Or(h.Consumer, "(unknown consumer)") + ", entry " + h.Entry + ran
		next := ""
		if h.Wait > 0 {
			next = "; due again in " + dur(h.Wait)
		}
		delivery, why := "delivery "+itoa(h.Delivery), h.Detail+" ("+where+")"
		switch h.Outcome {
		case queue.OutcomeSucceeded:
			e.What, e.Detail = delivery+" succeeded", where
		case queue.OutcomeCompleted:
			e.What, e.Detail = delivery+": budget spent, but the work had completed", where+"; acknowledged, not dead-lettered"
		case queue.OutcomeRetry:
			e.What, e.Detail, e.Bad = delivery+" failed; an attempt spent", why+next, true
		case queue.OutcomeHandedBack:
			e.What, e.Detail = delivery+" handed back without spending an attempt", why+next
		case queue.OutcomeWaiting:
			e.What, e.Detail = delivery+" put off by a limiter", why+next
		case queue.OutcomeDeadLettered:
			e.What, e.Detail, e.Bad = delivery+": dead-lettered", why, true
			if slices.ContainsFunc(d.Dead, func(dl queue.DeadLetter) bool { return dl.ID == h.DeadID }) {
				e.Link = deadLink
			}
		case queue.OutcomeReplayed:
			e.What, e.Detail = "replayed by an operator", "dead letter "+h.DeadID+" back on the queue as entry "+h.Entry
			if !h.Enqueued.IsZero() && !firstEnqueue && !slices.ContainsFunc(d.Dead, func(dl queue.DeadLetter) bool { return dl.Message != nil }) {
				// The dead letter, and the enqueue it recorded, are gone with the replay.
				firstEnqueue = true
				ev = append(ev, event{At: h.Enqueued, What: "enqueued", Detail: "first enqueued; its dead letter " + h.DeadID + " recorded this"})
			}
		case queue.OutcomePurged:
			e.What, e.Detail = "dead letter purged by an operator", "dead letter "+h.DeadID
		default:
			e.What, e.Detail = h.Outcome, h.Detail
		}
		ev = append(ev, e)
	}
	if p := d.Delivery; p != nil && d.Index != nil {
		gaps(d.Index.Entry, p.Deliveries, time.Now().Add(-p.Idle).Add(-time.Millisecond))
	}
	return ev
}

func stepOf(work string) string {
	step, _, _ := strings.Cut(work, "/")
	if s, err := url.PathUnescape(step); err == nil {
		return s
	}
	return step
}

func attempts(n int) string {
	if n == 0 {
		return ""
	}
	return ", " + itoa(int64(n)) + " attempts spent before"
}

func errSuffix(e string) string {
	if e == "" {
		return ""
	}
	return ": " + e
}
