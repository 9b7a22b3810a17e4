package adminui

import (
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/queue"
)

// The trail shows each delivery and its outcome in order, and a delivery that never
// reported (a gap in one entry's delivery numbers, or before the one running now) as
// its own event.
func TestHistoryEventsShowDeliveriesThatNeverReported(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	d := &jobData{
		Index: &queue.JobIndex{Entry: "3-0"},
		History: []queue.HistoryEvent{
			{Seq: 1, Entry: "1-0", Delivery: 1, Consumer: "a", Start: t0, End: t0.Add(time.Second), Outcome: queue.OutcomeRetry, Detail: "timeout", Wait: 2 * time.Second},
			// Deliveries 1 and 2 of 2-0 never reported.
			{Seq: 2, Entry: "2-0", Delivery: 3, Consumer: "b", Start: t0.Add(time.Minute), End: t0.Add(61 * time.Second), Outcome: queue.OutcomeHandedBack, Detail: "shutdown"},
		},
		// Running now: the second delivery of 3-0, the first never reported.
		Delivery: &queue.PendingEntry{Deliveries: 2, Consumer: "c", Idle: time.Second},
	}
	var got []string
	for _, e := range historyEvents(d, "/ui/dead-letters") {
		got = append(got, e.What)
	}
	want := []string{
		"delivery 1 failed; an attempt spent",
		"delivery 1 never reported", "delivery 2 never reported",
		"delivery 3 handed back without spending an attempt",
		"delivery 1 never reported",
	}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("events\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	ev := historyEvents(d, "")
	if !strings.Contains(ev[0].Detail, "timeout") || !strings.Contains(ev[0].Detail, "due again in 2s") || !ev[0].Bad {
		t.Errorf("retry event %+v", ev[0])
	}
	if !ev[1].At.Before(ev[3].At) || !strings.Contains(ev[1].Detail, "entry 2-0") {
		t.Errorf("gap event %+v, handed-back %+v", ev[1], ev[3])
	}
}

// A finished job whose stream entry was trimmed still has "enqueued" in its trail: the
// time of the oldest entry its index and history name (a retry's entry is newer than the
// first delivery's). Without this the trail lost it whenever the trim came before the
// page (TestBrowserOutboxRetryCallsAndJobPage failed so once in CI).
func TestTrailEnqueuedFromATrimmedEntry(t *testing.T) {
	t.Parallel()
	d := &jobData{
		Index: &queue.JobIndex{State: queue.StateQueued, Entry: "1796225360637-0"},
		History: []queue.HistoryEvent{
			{Outcome: queue.OutcomeRetry, Entry: "1796225360422-0"},
			{Outcome: queue.OutcomeReplayed, Entry: "1796225360001-0"}, // an entry a replay added: not the first
		},
	}
	var got *event
	for _, e := range trail(d, "/ui/") {
		if e.What == "enqueued" {
			got = &e
		}
	}
	if got == nil {
		t.Fatalf("no enqueued event in %+v", trail(d, "/ui/"))
	}
	if want := time.UnixMilli(1796225360422).UTC(); !got.At.Equal(want) || !strings.Contains(got.Detail, "1796225360422-0") {
		t.Fatalf("enqueued %v %q, want %v from entry 1796225360422-0", got.At, got.Detail, want)
	}
	d.Message = &queue.Message{EnqueuedAt: time.UnixMilli(1796225360000).UTC()}
	n := 0
	for _, e := range trail(d, "/ui/") {
		if strings.HasPrefix(e.What, "enqueued") {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("with its entry at hand: %d enqueued events, want 1 (from the message)", n)
	}
}
