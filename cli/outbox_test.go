package cli_test

import (
	"strings"
	"testing"
)

// outbox list -h shows --failed as the boolean it is: no value name after it (the flag
// package takes a back-quoted word of a usage string for one).
func TestOutboxListHelpShowsFailedAsABoolean(t *testing.T) {
	t.Parallel()
	usage := help(t, "outbox", "list")
	for line := range strings.SplitSeq(usage, "\n") {
		if strings.HasPrefix(line, "  -failed") {
			if line != "  -failed" {
				t.Fatalf("-failed is shown with a value: %q\n%s", line, usage)
			}
			return
		}
	}
	t.Fatalf("outbox list -h does not list -failed:\n%s", usage)
}
