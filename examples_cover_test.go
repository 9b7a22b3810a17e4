package onceflow_test

import (
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv/doccheck"
)

// Every exported function and method of the root package has a runnable Example (go doc
// shows it), as a library user expects: the API is documented by code that runs.
func TestEveryEntryPointHasAnExample(t *testing.T) {
	covered := map[string]string{
		"WorkFunc.Work":   "ExampleAddWorker (a WorkFunc is called through it)",
		"StepStream.All":  "ExampleJob_Stream",
		"StepStream.Step": "ExampleJob_Stream",
		"StepStream.Key":  "ExampleJob_Stream",
		"Commit.Exec":     "ExampleJob_Commit",
		"Commit.Emit":     "ExampleJob_Commit",
		"Commit.Result":   "ExampleJob_Commit",
		// Accessors shown in the examples of their neighbours.
		"Inspector.DB":     "ExampleInspector_QueueKeys",
		"Inspector.Redis":  "ExampleInspector_QueueKeys",
		"Client.Inspector": "ExampleInspector_QueueKeys (every Inspector example starts with it)",
		"Client.RunRelay":  "ExampleClient_RunWorkers",
		"Job.Client":       "ExampleJob_Committed",
	}
	missing := doccheck.MissingExamples(t, ".", "github.com/onceflow/onceflow", covered)
	if len(missing) > 0 {
		t.Errorf("exported functions and methods without an Example: %s", strings.Join(missing, ", "))
	}
}
