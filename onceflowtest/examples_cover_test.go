package onceflowtest_test

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// Every exported function and method of the kit has a runnable Example (go doc shows
// it), or is named here with the example that uses it.
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
	p, err := doc.NewFromFiles(fset, files, "github.com/onceflow/onceflow/onceflowtest")
	if err != nil {
		t.Fatal(err)
	}
	covered := map[string]string{
		"RedisURL": "ExampleRedis", "Logger": "ExampleNew (New's default logger)", "WaitFor": "ExampleNew",
		"Completions": "ExampleNew", "OutboxRows": "ExamplePostgres", "Count": "ExamplePostgres",
		"SentOutboxRows": "the examples/minimal test", "Env.OutboxRows": "ExampleNew", "Env.Start": "ExampleNew",
		"Env.Count":      "ExampleNew (Env.OutboxRows)",
		"FakeLLM.Client": "ExampleNewFakeLLM", "FakeLLM.Requests": "ExampleNewFakeLLM",
		"FakeLLM.Release": "ExampleFakeLLM_Hold", "FakeLLM.WaitRequests": "ExampleFakeLLM_Hold",
		"Start": "ExampleBuild", "Process.Kill": "ExampleBuild", "Process.Stdout": "ExampleBuild",
		"Process.Signal": "examples/minimal's test", "Process.Wait": "examples/minimal's test",
		"Process.WaitLog": "examples/triage's tests", "Process.Stderr": "ExampleBuild (logged when a test fails)",
		"PrivateRedis": "ExampleRedisServer_PauseWrites",
		"Sink.Sender":  "ExampleNewSink", "Sink.Count": "ExampleNewSink", "Sink.Total": "ExampleNewSink",
		"Sink.Keys": "ExampleNewSink", "Sink.Deliveries": "ExampleNewSink",
		"Sink.SetLatency": "examples/triage's TestRelayKilledBetweenSendAndMark", "Sink.FailNext": "docs/testing.md",
		"Sink.RequireOncePerKey": "examples/triage's tests",
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
