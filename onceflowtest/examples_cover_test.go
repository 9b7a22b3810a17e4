package onceflowtest_test

import (
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv/doccheck"
)

// Every exported function and method of the kit has a runnable Example (go doc shows
// it), or is named here with the example that uses it.
func TestEveryEntryPointHasAnExample(t *testing.T) {
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
		"Call":                   "ExampleScriptedModel", "ScriptedModel.Complete": "ExampleScriptedModel",
		"ScriptedModel.Requests": "ExampleScriptedModel", "ScriptedModel.Stream": "the root package's agent tests (AgentConfig.Stream)",
		"Sink.SetAnswer": "internal/webhooksink's TestSinkReplaysItsFirstAnswerPerKey; docs/testing.md",
	}
	missing := doccheck.MissingExamples(t, ".", "github.com/onceflow/onceflow/onceflowtest", covered)
	if len(missing) > 0 {
		t.Errorf("exported functions and methods without an Example: %s", strings.Join(missing, ", "))
	}
}
