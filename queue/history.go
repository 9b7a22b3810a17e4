package queue

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// A job's history is the list of what became of each of its deliveries, and of what an
// operator did to it, kept in its index (Keys.Job) under the field "history": one line
// per event, "<seq> <JSON>", the oldest first, seq counting from 1 in the field
// "history_n". The scripts that settle a delivery append its event in the same step
// (the dead letter, a retry or hand-back, a replay, a purge), and the acknowledgement
// writes the success in the same round trip as the XACK, into the queue's successes
// hash (Keys.Successes: one field a job, no read), from which the trim moves it into
// the index ("done", the latest success), so the history costs no round trip of its
// own. It is bounded (historyMax bytes: the oldest events are dropped first) and
// expires with the index.

// Outcomes of a delivery, and operators' actions, as a HistoryEvent records them.
const (
	// OutcomeSucceeded: the handler returned nil; the entry was acknowledged.
	OutcomeSucceeded = "succeeded"
	// OutcomeCompleted: the job's budget was spent, but its handler (a Completer) said
	// the work completed; acknowledged, not dead-lettered.
	OutcomeCompleted = "completed"
	// OutcomeRetry: the run failed; the job spent an attempt and runs again (Detail:
	// the error).
	OutcomeRetry = "retry"
	// OutcomeHandedBack: the run did not fail on the job (a shutdown, a snooze, a
	// dependency down, a completion unknown); it runs again without spending an
	// attempt (Detail: why).
	OutcomeHandedBack = "handed back"
	// OutcomeWaiting: a limiter had no capacity for the job's call; it waits in the
	// scheduled set without spending an attempt (Detail: the limiter's reason).
	OutcomeWaiting = "waiting"
	// OutcomeDeadLettered: the job went to the dead-letter stream (Detail: the reason;
	// DeadID: the dead letter).
	OutcomeDeadLettered = "dead-lettered"
	// OutcomeReplayed: an operator replayed the job's dead letter DeadID; Entry is the
	// new stream entry. Not a delivery.
	OutcomeReplayed = "replayed"
	// OutcomePurged: an operator purged the job's dead letter DeadID. Not a delivery.
	OutcomePurged = "purged"
)

// HistoryEvent is one event of a job's history: the end of one delivery (Delivery > 0)
// or an operator's action (Delivery 0).
type HistoryEvent struct {
	// Seq numbers the job's events from 1, in the order they happened.
	Seq int64
	// Entry is the stream entry delivered (for a replay: the entry it added).
	Entry string
	// Delivery is the entry's delivery count at this delivery (1 for its first); 0 for
	// an operator's action. A gap (2 after nothing, 4 after 2) is a delivery that never
	// reported: its worker died or lost its lease.
	Delivery int64
	// Consumer is the worker's consumer name ("" for an operator's action).
	Consumer string
	// Start is when the run began (zero for an operator's action), End when the event
	// was recorded.
	Start, End time.Time
	// Outcome is one of the Outcome constants.
	Outcome string
	// Detail is the error, reason or why, clipped to 200 bytes.
	Detail string
	// DeadID is the dead letter a dead-lettering, replay or purge concerns.
	DeadID string
	// Wait is how long after a retry, hand-back or wait the job was due again (0: at
	// once).
	Wait time.Duration
	// Enqueued is, for a replay, when the replayed job had been enqueued (its dead
	// letter's enqueued_at: a replay enqueues it anew).
	Enqueued time.Time
}

// historyWire is an event as its line stores it (times in Unix milliseconds). The
// scripts that record operators' actions write the same names with cjson.
type historyWire struct {
	Entry    string `json:"entry,omitempty"`
	Delivery int64  `json:"n,omitempty"`
	Consumer string `json:"consumer,omitempty"`
	Start    int64  `json:"start,omitempty"`
	End      int64  `json:"end,omitempty"`
	Outcome  string `json:"outcome"`
	Detail   string `json:"detail,omitempty"`
	DeadID   string `json:"dead,omitempty"`
	Wait     int64  `json:"wait,omitempty"`
	Enqueued int64  `json:"enqueued,omitempty"`
}

// historyMax bounds a job's history in bytes; past it the oldest events are dropped.
// About 30 events: enough for every attempt of the default budget and a few replays.
// lua/history.lua, which appends the events, has it as a literal.
const historyMax = 8 << 10

// historyDetailMax bounds an event's Detail in bytes.
const historyDetailMax = 200

// historyRecord encodes the event of delivery d that ended at end on consumer, as
// historyWire's JSON (on one line: encoding/json escapes newlines). Strings are made
// valid UTF-8 and the consumer and detail clipped to historyDetailMax bytes.
func historyRecord(d delivery, consumer, outcome, detail string, end time.Time) string {
	valid := func(s string) string { return strings.ToValidUTF8(s, "\ufffd") }
	w := historyWire{Outcome: outcome, Entry: valid(d.id), Delivery: d.deliveries,
		Consumer: valid(clipTo(consumer, historyDetailMax)), Detail: valid(clipTo(detail, historyDetailMax)), End: end.UnixMilli()}
	if !d.started.IsZero() {
		w.Start = d.started.UnixMilli()
	}
	b, err := json.Marshal(w)
	if err != nil { // strings and integers only: does not happen
		return ""
	}
	return string(b)
}

// clipTo cuts s to at most n bytes of valid UTF-8, marking the cut with "...".
func clipTo(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "") + "..."
}

// ReadHistory returns the history of jobID, oldest first, and how many older events
// were dropped to keep it bounded. A job without an index, or whose index has no
// history (written before histories were kept), has none. One round trip. A line it
// cannot read is skipped: the history is for reading, never a reason to fail.
func ReadHistory(ctx context.Context, rdb redis.Cmdable, keys Keys, jobID string) (events []HistoryEvent, dropped int64, err error) {
	if err := keys.Validate(); err != nil {
		return nil, 0, err
	}
	if !ValidJobID(jobID) {
		return nil, 0, nil
	}
	vals, err := readHistoryScript.Run(ctx, rdb, []string{keys.Job(jobID), keys.Successes()}).Slice()
	if err != nil {
		return nil, 0, fmt.Errorf("read the history of job %s: %w", jobID, err)
	}
	str := func(i int) string {
		if i < len(vals) {
			s, _ := vals[i].(string)
			return s
		}
		return ""
	}
	events = ParseHistory(str(0))
	if len(events) > 0 {
		dropped = events[0].Seq - 1
	}
	var entries []string
	for _, done := range []string{str(1), str(2)} {
		ok := parseDone(done)
		if ok == nil || slices.Contains(entries, ok.Entry) {
			continue
		}
		entries = append(entries, ok.Entry)
		// A success, kept apart from the appended events (the acknowledgement writes it
		// without reading them): it goes where its time puts it, numbered after what it
		// follows.
		i := len(events)
		for i > 0 && events[i-1].End.After(ok.End) {
			i--
		}
		ok.Seq = dropped + int64(i) + 1
		events = slices.Insert(events, i, *ok)
		for j := i + 1; j < len(events); j++ {
			events[j].Seq++
		}
	}
	return events, dropped, nil
}

// readHistoryScript reads a job's history, its moved success and its latest entry's
// success in one step (lua/read_history.lua).
var readHistoryScript = scripts.MustScript("lua/read_history.lua")

// parseDone decodes the "done" field of a job index, nil when absent or unreadable.
func parseDone(done string) *HistoryEvent {
	if done == "" {
		return nil
	}
	ev := ParseHistory("1 " + done)
	if len(ev) != 1 {
		return nil
	}
	return &ev[0]
}

// ParseHistory decodes the "history" field of a job index; lines it cannot read are
// skipped.
func ParseHistory(h string) []HistoryEvent {
	var out []HistoryEvent
	for line := range strings.SplitSeq(h, "\n") {
		seqText, rec, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		seq, err := strconv.ParseInt(seqText, 10, 64)
		if err != nil || seq <= 0 {
			continue
		}
		var w historyWire
		if err := json.Unmarshal([]byte(rec), &w); err != nil || w.Outcome == "" {
			continue
		}
		e := HistoryEvent{Seq: seq, Entry: w.Entry, Delivery: w.Delivery, Consumer: w.Consumer,
			Outcome: w.Outcome, Detail: w.Detail, DeadID: w.DeadID, Wait: time.Duration(max(w.Wait, 0)) * time.Millisecond}
		if w.Start > 0 {
			e.Start = time.UnixMilli(w.Start).UTC()
		}
		if w.End > 0 {
			e.End = time.UnixMilli(w.End).UTC()
		}
		if w.Enqueued > 0 {
			e.Enqueued = time.UnixMilli(w.Enqueued).UTC()
		}
		out = append(out, e)
	}
	return out
}
