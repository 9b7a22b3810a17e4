package summaries_test

import (
	"testing"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/summaries"
)

// Options.Sender is the workflow's sender of its one topic; without it the workflow has
// none (its emails wait for a process that has one).
func TestWorkflowSendsItsTopicWithOptionsSender(t *testing.T) {
	t.Parallel()
	s := outbox.LogSender{}
	wf := summaries.Workflow(summaries.Options{Sender: s})
	if len(wf.Senders) != 1 || wf.Senders[summaries.TopicSummaryReady] != s {
		t.Fatalf("Senders %v, want only %s", wf.Senders, summaries.TopicSummaryReady)
	}
	if wf := summaries.Workflow(summaries.Options{}); len(wf.Senders) != 0 {
		t.Fatalf("Senders %v without Options.Sender, want none", wf.Senders)
	}
}
