package onceflow_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv/doccheck"
)

// The runnable examples are user code to copy: no file that declares an Example
// function imports a package a program outside this module cannot import
// (github.com/onceflow/onceflow/internal/...).
func TestExamplesImportNothingInternal(t *testing.T) {
	t.Parallel()
	const internal = "github.com/onceflow/onceflow/internal/"
	fset := token.NewFileSet()
	examples := 0
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != "." && (name == "testdata" || strings.HasPrefix(name, ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		hasExample := false
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil && strings.HasPrefix(fn.Name.Name, "Example") {
				hasExample = true
			}
		}
		if !hasExample {
			return nil
		}
		examples++
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); strings.HasPrefix(p, internal) {
				t.Errorf("%s: an example file imports %s, which users cannot import", path, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if examples < 5 {
		t.Fatalf("found %d example files; the walk is broken", examples)
	}
}

// Every exported function and method of the root package has a runnable Example (go doc
// shows it), as a library user expects: the API is documented by code that runs.
func TestEveryEntryPointHasAnExample(t *testing.T) {
	t.Parallel()
	covered := map[string]string{
		"WorkFunc.Work":   "ExampleAddWorker (a WorkFunc is called through it)",
		"StepStream.All":  "ExampleJob_Stream",
		"StepStream.Step": "ExampleJob_Stream",
		"StepStream.Key":  "ExampleJob_Stream",
		"Commit.Exec":     "ExampleJob_Commit",
		"Commit.Emit":     "ExampleJob_Commit",
		"Commit.Result":   "ExampleJob_Commit",
		// Accessors shown in the examples of their neighbours.
		"Inspector.DB":        "ExampleInspector_QueueKeys",
		"Inspector.Redis":     "ExampleInspector_QueueKeys",
		"Client.Inspector":    "ExampleInspector_QueueKeys (every Inspector example starts with it)",
		"Client.RunRelay":     "ExampleClient_RunWorkers",
		"Job.Client":          "ExampleJob_Committed",
		"Job.ToolCalls":       "ExampleJob_Tool",
		"Turn":                "ExampleRunAgent (RunAgent builds each turn's messages with it; docs/workflows-agents.md)",
		"MustTool":            "ExampleRunAgent",
		"NewTool":             "ExampleRunAgent (MustTool calls it)",
		"InDoubtError.Error":  "ExampleInspector_ResolveInDoubt (the job's dead-letter reason)",
		"InDoubtError.Is":     "ExampleInspector_ResolveInDoubt",
		"Inspector.InDoubt":   "ExampleInspector_ResolveInDoubt",
		"Job.ToolAtMostOnce":  "ExampleInspector_ResolveInDoubt",
		"Sleep":               "ExampleWaitSignal (the same wait, ended by its time; docs/workflows-agents.md)",
		"Client.Signal":       "ExampleWaitSignal",
		"Client.Reject":       "ExampleClient_Approve (the same decision, the other way)",
		"Job.Approval":        "ExampleClient_Approve (RunAgent asks through it)",
		"Inspector.Approvals": "ExampleClient_Approve",
		"NeedsApproval":       "ExampleClient_Approve",
		"Client.RejectHeld":   "ExampleClient_Release (the same decision, the other way)",
		"Inspector.Held":      "ExampleClient_Release",
	}
	missing := doccheck.MissingExamples(t, ".", "github.com/onceflow/onceflow", covered)
	if len(missing) > 0 {
		t.Errorf("exported functions and methods without an Example: %s", strings.Join(missing, ", "))
	}
}
