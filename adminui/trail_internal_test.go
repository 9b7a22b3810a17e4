package adminui

import (
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/queue"
)

// A finished job whose stream entry was trimmed still has "enqueued" in its trail: the
// time of the oldest entry its index and history name (a retry's entry is newer than the
// first delivery's). Without this the trail lost it whenever the trim came before the
// page (TestBrowserOutboxRetryCallsAndJobPage failed so once in CI).
func TestTrailEnqueuedFromATrimmedEntry(t *testing.T) {
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
