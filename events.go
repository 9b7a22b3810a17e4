package onceflow

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/llm"
)

// Defaults of EventsConfig.
const (
	DefaultEventsPoll        = 100 * time.Millisecond
	DefaultEventsMaxDuration = 5 * time.Minute
	DefaultEventsHeartbeat   = 15 * time.Second
)

// EventsConfig configures EventsHandler.
type EventsConfig struct {
	// Poll is how often the handler reads the job's progress. Default: DefaultEventsPoll.
	Poll time.Duration
	// MaxDuration bounds one connection; the client reconnects with Last-Event-ID and
	// loses nothing. Default: DefaultEventsMaxDuration.
	MaxDuration time.Duration
	// Heartbeat is how often an idle stream sends a comment, so proxies keep it open.
	// Default: DefaultEventsHeartbeat.
	Heartbeat time.Duration
}

// EventsHandler answers GET of a job's events (mount it as
// "GET /v1/jobs/{job_id}/events"; the path value job_id names the job) with
// Server-Sent Events, authenticated and tenant-scoped like StateHandler (another
// tenant's job or an unknown id: 404). It streams, each event with an id:
//
//   - "text": a model step's text as it is generated ({"step", "attempt", "text"}),
//     from the ledger's partial output of a streamed step (Job.Stream, a streamed
//     RunAgent turn) and the recorded answer of a unary one;
//   - "restart": a step's generation was abandoned (its worker died mid-stream) and a
//     new attempt begins ({"step", "attempt"}): discard that step's text so far;
//   - "tool": a tool call's recorded result ({"tool", "arguments", "result"});
//   - "wait": the job waits for a signal or a decision ({"name", "deadline"}, and
//     "tool" and "arguments" for an approval);
//   - "end": the job's final state (JobState as JSON): done, failed or in doubt.
//
// A client that reconnects with Last-Event-ID gets what follows that event and nothing
// twice, also when the worker that was generating was killed and another took over (a
// "restart" then says so). The stream ends after "end", or after MaxDuration.
func EventsHandler(c *Client, tenant func(*http.Request) (string, error), cfg EventsConfig) http.Handler {
	tenant = usableTenant(tenant)
	cfg.Poll = cmp.Or(cfg.Poll, DefaultEventsPoll)
	cfg.MaxDuration = cmp.Or(cfg.MaxDuration, DefaultEventsMaxDuration)
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, DefaultEventsHeartbeat)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t, ok := requestTenant(c, tenant, w, r)
		if !ok {
			return
		}
		id := r.PathValue("job_id")
		sctx, cancel := context.WithTimeout(r.Context(), DefaultStateTimeout)
		st, err := c.JobState(sctx, t, id)
		cancel()
		switch {
		case errors.Is(err, ErrJobNotFound):
			writeDetail(w, http.StatusNotFound, "no such job")
			return
		case err != nil:
			c.log.WarnContext(r.Context(), "onceflow: job state unavailable", "err", err)
			w.Header().Set("Retry-After", "1")
			writeDetail(w, http.StatusServiceUnavailable, "job state unavailable; retry later")
			return
		}
		if c.steps == nil {
			writeDetail(w, http.StatusNotImplemented, "job events need Config.DB")
			return
		}
		cur, err := parseEventID(r.Header.Get("Last-Event-ID"))
		if err != nil {
			writeDetail(w, http.StatusBadRequest, "Last-Event-ID: "+err.Error())
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Accel-Buffering", "no")
		w.WriteHeader(http.StatusOK)
		rc := http.NewResponseController(w)
		// A client that stops reading must not hold the handler past MaxDuration: writes
		// fail once it is over (where the server supports write deadlines).
		_ = rc.SetWriteDeadline(time.Now().Add(cfg.MaxDuration + eventsWriteGrace))
		es := &eventStream{c: c, tenant: t, id: id, cur: cur, w: w, flush: rc.Flush}
		es.run(r.Context(), st, cfg)
	})
}

// eventsWriteGrace is how long past MaxDuration a stream's last write may take.
const eventsWriteGrace = 5 * time.Second

// eventCursor is where a client is in a job's events: the item of its last event, and
// for a text item the attempt and how many bytes of its text it has.
type eventCursor struct {
	end     bool
	item    string // the item's id ("" before any)
	attempt int
	offset  int
}

// parseEventID reads a Last-Event-ID: "end", or "<item>.<attempt>.<offset>".
func parseEventID(s string) (eventCursor, error) {
	if s == "" {
		return eventCursor{}, nil
	}
	if s == "end" {
		return eventCursor{end: true}, nil
	}
	parts := strings.Split(s, ".")
	if len(parts) != 3 || len(parts[0]) == 0 || len(parts[0]) > 40 {
		return eventCursor{}, errors.New("not an id this stream sent")
	}
	a, err1 := strconv.Atoi(parts[1])
	o, err2 := strconv.Atoi(parts[2])
	if err1 != nil || err2 != nil || a < 0 || o < 0 {
		return eventCursor{}, errors.New("not an id this stream sent")
	}
	return eventCursor{item: parts[0], attempt: a, offset: o}, nil
}

// eventItem is one row of the job's progress, in order: a model step's ledger row or a
// recorded step (tool call, wait).
type eventItem struct {
	id      string // a digest of the row's key
	at      time.Time
	kind    string // "text", "tool", "wait"
	step    string // text: the step's name
	attempt int    // text: the attempt whose text this is
	text    string // text: the attempt's text so far (all of it once final)
	final   bool   // text: the answer is recorded
	data    any    // tool, wait: the event's data
}

// eventStream is one connection's stream.
type eventStream struct {
	c      *Client
	tenant string
	id     string
	cur    eventCursor
	w      http.ResponseWriter
	flush  func() error
}

func (es *eventStream) run(ctx context.Context, st *JobState, cfg EventsConfig) {
	if es.cur.end {
		return // the client has the end
	}
	deadline := time.Now().Add(cfg.MaxDuration)
	lastWrite := time.Now()
	for {
		items, err := es.c.jobEventItems(ctx, es.tenant, es.id)
		if err != nil {
			if ctx.Err() == nil {
				es.c.log.WarnContext(ctx, "onceflow: job events: reading the job's progress failed; the client reconnects", "job_id", es.id, "err", err)
			}
			return
		}
		wrote, err := es.emit(items)
		if err != nil {
			return // the client went away
		}
		if wrote {
			lastWrite = time.Now()
		}
		if terminal(st.Status) && allFinal(items) {
			b, _ := json.Marshal(st)
			if es.write("end", "end", b) == nil {
				_ = es.flush()
			}
			return
		}
		if time.Now().After(deadline) {
			return
		}
		if time.Since(lastWrite) >= cfg.Heartbeat {
			if _, err := fmt.Fprint(es.w, ": heartbeat\n\n"); err != nil || es.flush() != nil {
				return
			}
			lastWrite = time.Now()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(cfg.Poll):
		}
		sctx, cancel := context.WithTimeout(ctx, DefaultStateTimeout)
		next, err := es.c.JobState(sctx, es.tenant, es.id)
		cancel()
		if err == nil {
			st = next
		}
	}
}

// terminal reports whether a job in status s is over.
func terminal(s Status) bool { return s == StatusDone || s == StatusFailed || s == StatusInDoubt }

// allFinal reports whether every model step's answer is recorded.
func allFinal(items []eventItem) bool {
	for _, it := range items {
		if it.kind == "text" && !it.final {
			return false
		}
	}
	return true
}

// emit writes what follows the cursor in items, and moves the cursor.
func (es *eventStream) emit(items []eventItem) (bool, error) {
	start := 0
	if es.cur.item != "" {
		i := slices.IndexFunc(items, func(it eventItem) bool { return it.id == es.cur.item })
		if i < 0 {
			return false, nil // its row is not visible yet (or was purged): wait
		}
		start = i
	}
	wrote := false
	for i := start; i < len(items); i++ {
		it := items[i]
		resumed := i == start && es.cur.item == it.id
		switch it.kind {
		case "text":
			from := 0
			if resumed {
				if es.cur.attempt == it.attempt {
					from = es.cur.offset
				} else if it.attempt > es.cur.attempt {
					b, _ := json.Marshal(map[string]any{"step": it.step, "attempt": it.attempt})
					if err := es.write("restart", es.eventID(it.id, it.attempt, 0), b); err != nil {
						return wrote, err
					}
					wrote = true
				} else {
					continue // an older attempt than the client's: nothing newer yet
				}
			}
			if len(it.text) > from {
				b, _ := json.Marshal(map[string]any{"step": it.step, "attempt": it.attempt, "text": it.text[from:]})
				if err := es.write("text", es.eventID(it.id, it.attempt, len(it.text)), b); err != nil {
					return wrote, err
				}
				wrote = true
			} else {
				es.cur = eventCursor{item: it.id, attempt: it.attempt, offset: from}
			}
			if !it.final {
				if wrote {
					return wrote, es.flush()
				}
				return false, nil // later items wait for this step's answer
			}
		default:
			if resumed {
				continue
			}
			b, _ := json.Marshal(it.data)
			if err := es.write(it.kind, es.eventID(it.id, 0, 0), b); err != nil {
				return wrote, err
			}
			wrote = true
		}
	}
	if wrote {
		return true, es.flush()
	}
	return false, nil
}

// eventID returns the id of an event, and moves the cursor to it.
func (es *eventStream) eventID(item string, attempt, offset int) string {
	es.cur = eventCursor{item: item, attempt: attempt, offset: offset}
	return item + "." + strconv.Itoa(attempt) + "." + strconv.Itoa(offset)
}

// write writes one event.
func (es *eventStream) write(event, id string, data []byte) error {
	_, err := fmt.Fprintf(es.w, "id: %s\nevent: %s\ndata: %s\n\n", id, event, data)
	return err
}

// jobEventItems reads the job's progress, in order: its model steps' ledger rows and
// its recorded tool calls and waits (two PostgreSQL reads).
func (c *Client) jobEventItems(ctx context.Context, tenant, id string) ([]eventItem, error) {
	db := c.steps.db
	var items []eventItem
	rows, err := db.Query(ctx, `SELECT idem_key, work, state, attempt, coalesce(partial, ''), coalesce(partial_attempt, 0), response, created_at
FROM llm_calls WHERE split_part(work, '/', 2) = $1 AND tenant = $2`, id, tenant)
	if err != nil {
		return nil, fmt.Errorf("onceflow: read job %s's model steps: %w", id, err)
	}
	for rows.Next() {
		var key, work, state, partial string
		var attempt, partialAttempt int
		var resp []byte
		var at time.Time
		if err := rows.Scan(&key, &work, &state, &attempt, &partial, &partialAttempt, &resp, &at); err != nil {
			rows.Close()
			return nil, fmt.Errorf("onceflow: read job %s's model steps: %w", id, err)
		}
		step, _ := url.PathUnescape(strings.SplitN(work, "/", 2)[0])
		it := eventItem{id: itemID("m", key), at: at, kind: "text", step: step, attempt: max(attempt, 1)}
		switch {
		case state == "succeeded":
			var r llm.Response
			if json.Unmarshal(resp, &r) == nil {
				it.text = r.Content
			}
			it.final = true
		case state == "in_flight" && partialAttempt == attempt && attempt > 0:
			it.text = partial
		case state != "in_flight": // failed for good: no text will come
			it.final = true
		}
		items = append(items, it)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflow: read job %s's model steps: %w", id, err)
	}
	rows, err = db.Query(ctx, `SELECT name, state, coalesce(result, ''), tool, arguments, created_at FROM job_steps
WHERE tenant = $1 AND job_id = $2 AND (name LIKE 'tool:%' AND state = 'done' OR name LIKE 'wait:%')`, tenant, id)
	if err != nil {
		return nil, fmt.Errorf("onceflow: read job %s's steps: %w", id, err)
	}
	for rows.Next() {
		var name, state, tool, args string
		var result []byte
		var at time.Time
		if err := rows.Scan(&name, &state, &result, &tool, &args, &at); err != nil {
			rows.Close()
			return nil, fmt.Errorf("onceflow: read job %s's steps: %w", id, err)
		}
		if strings.HasPrefix(name, toolStepPrefix) {
			items = append(items, eventItem{id: itemID("k", name), at: at, kind: "tool",
				data: map[string]string{"tool": tool, "arguments": args, "result": string(result)}})
			continue
		}
		var w waitRecord
		_ = json.Unmarshal(result, &w)
		data := map[string]any{"name": strings.TrimPrefix(name, waitPrefix), "deadline": w.Deadline}
		if tool != "" {
			data["tool"], data["arguments"] = tool, args
		}
		items = append(items, eventItem{id: itemID("w", name), at: at, kind: "wait", data: data})
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflow: read job %s's steps: %w", id, err)
	}
	slices.SortStableFunc(items, func(a, b eventItem) int {
		return cmp.Or(a.at.Compare(b.at), strings.Compare(a.id, b.id))
	})
	return items, nil
}

// itemID is a short, stable id of a row: a kind letter and a digest of its key.
func itemID(kind, key string) string {
	h := sha256.Sum256([]byte(key))
	return kind + hex.EncodeToString(h[:8])
}
