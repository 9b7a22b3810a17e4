package onceflow_test

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// Every exported function and method of the root package has a runnable Example (go doc
// shows it), as a library user expects: the API is documented by code that runs.
func TestEveryEntryPointHasAnExample(t *testing.T) {
	fset := token.NewFileSet()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, name := range names {
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	p, err := doc.NewFromFiles(fset, files, "github.com/onceflow/onceflow")
	if err != nil {
		t.Fatal(err)
	}
	// Methods whose example is their type's or another method's.
	covered := map[string]string{
		"WorkFunc.Work":   "ExampleAddWorker (a WorkFunc is called through it)",
		"StepStream.All":  "ExampleJob_Stream",
		"StepStream.Step": "ExampleJob_Stream",
		"StepStream.Key":  "ExampleJob_Stream",
		"Commit.Exec":     "ExampleJob_Commit",
		"Commit.Emit":     "ExampleJob_Commit",
		"Commit.Result":   "ExampleJob_Commit",
		// Accessors shown in the examples of their neighbours.
		"Client.DB":       "ExampleClient_QueueKeys",
		"Client.Redis":    "ExampleClient_QueueKeys",
		"Client.RunRelay": "ExampleClient_RunWorkers",
		"Job.Client":      "ExampleJob_Committed",
	}
	var missing []string
	check := func(name string, examples []*doc.Example) {
		if len(examples) == 0 && covered[name] == "" {
			missing = append(missing, name)
		}
	}
	for _, f := range p.Funcs {
		check(f.Name, f.Examples)
	}
	for _, ty := range p.Types {
		for _, f := range ty.Funcs {
			check(f.Name, f.Examples)
		}
		for _, m := range ty.Methods {
			check(ty.Name+"."+m.Name, m.Examples)
		}
	}
	if len(missing) > 0 {
		t.Errorf("exported functions and methods without an Example: %s", strings.Join(missing, ", "))
	}
}
