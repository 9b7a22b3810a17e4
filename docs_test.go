package onceflow_test

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// docs/first-workflow.md shows the code of example_firstworkflow_test.go verbatim: each
// block between a "// doc: NAME" and a "// doc: end" marker of the example file is a
// ```go block of the page (firstWorkflowMain shown as main), so the page's code is code
// that compiles and whose run Example_firstWorkflow checks.
func TestFirstWorkflowDocMirrorsTheExample(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("example_firstworkflow_test.go")
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile("docs/first-workflow.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := map[string]bool{}
	for _, m := range regexp.MustCompile("(?s)```go\n(.*?)\n```").FindAllSubmatch(page, -1) {
		blocks[string(m[1])] = true
	}
	marked := regexp.MustCompile(`(?s)// doc: ([a-z.]+)\n\n(.*?)\n+// doc: end`).FindAllSubmatch(src, -1)
	if len(marked) != 2 {
		t.Fatalf("found %d marked blocks in the example, want 2 (replies.go, main.go)", len(marked))
	}
	for _, m := range marked {
		code := strings.Replace(string(m[2]), "func firstWorkflowMain()", "func main()", 1)
		if !blocks[code] {
			t.Errorf("docs/first-workflow.md does not show the example's %s block verbatim:\n%s", m[1], code)
		}
	}
}

// The docs describe the attempt budget as docs/queue.md "Attempts and retries" does: a
// count of failed attempts with a full-jitter backoff (RetryBase, RetryMax), not a
// delivery budget bounded by ClaimIdle; and Job.Delivery (job.go) is the attempt number
// across entries (1 + the attempts spent; a retry is a new entry, a snooze keeps the
// number), not a count of one stream entry's deliveries.
func TestDocsDescribeTheAttemptBudget(t *testing.T) {
	t.Parallel()
	for file, stale := range map[string]string{
		"docs/coming-from-river-asynq.md": "`MaxDeliveries` and `ClaimIdle` bound how often and how soon a job runs again",
		"job.go":                          "Delivery counts the deliveries of this job's stream entry",
	} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.Join(strings.Fields(strings.ReplaceAll(string(b), "//", "")), " "), stale) {
			t.Errorf("%s still says %q", file, stale)
		}
	}
}
