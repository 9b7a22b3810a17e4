package cli

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/llm/probe"
)

// runProbeCmd runs `onceflow probe` against base and returns its exit code and the
// JSON result (nil without --json output).
func runProbeCmd(t *testing.T, env []string, args ...string) (int, *probe.Result, *testenv.Process) {
	t.Helper()
	p := testenv.Start(t, testenv.Binary(t), env, append([]string{"probe"}, args...)...)
	code := p.Wait(60 * time.Second)
	var r probe.Result
	if json.Unmarshal([]byte(p.Stdout()), &r) != nil {
		return code, nil, p
	}
	return code, &r, p
}

func TestProbeAgainstFakeLLM(t *testing.T) {
	t.Parallel()
	_, honouring := startFakeLLM(t, "--honour-idempotency")
	_, ignoring := startFakeLLM(t)
	_, failing := startFakeLLM(t, "--fail-503", "1")
	for _, tc := range []struct {
		name string
		base string
		code int
		want probe.Verdict
	}{
		{"honour-idempotency", honouring, 0, probe.Honoured},
		{"ignores keys", ignoring, 3, probe.Ignored},
		{"always 503", failing, 1, probe.Inconclusive},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, r, p := runProbeCmd(t, []string{"PROBE_KEY=sk-probe-secret-0000"}, "--base-url", tc.base, "--model", "gpt-4.1-mini", "--api-key-env", "PROBE_KEY", "--json")
			if code != tc.code || r == nil || r.Verdict != tc.want {
				t.Fatalf("exit %d, result %+v; want exit %d, %s\nstderr:\n%s", code, r, tc.code, tc.want, p.Stderr())
			}
			if tc.want != probe.Inconclusive && (r.First.ID == "" || r.Second.ID == "") {
				t.Fatalf("ids missing: %+v", r)
			}
			if strings.Contains(p.Stdout()+p.Stderr(), "sk-probe-secret-0000") {
				t.Fatal("the API key was printed")
			}
		})
	}
	// The text output names the verdict and both ids.
	code, _, p := runProbeCmd(t, nil, "--base-url", ignoring, "--model", "gpt-4.1-mini")
	out := p.Stdout()
	if code != 3 || !strings.HasPrefix(out, "ignored:") || strings.Count(out, "chatcmpl-") != 2 {
		t.Fatalf("exit %d, output:\n%s", code, out)
	}
	// Usage errors exit 2.
	for _, args := range [][]string{{"--base-url", "ftp://x", "--model", "m"}, {"--api-key-env", "NOT A VAR"}, {"--timeout", "-1s"}} {
		if code, _, p := runProbeCmd(t, nil, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2; stderr %s", args, code, p.Stderr())
		}
	}
}

// gateway's and probe's default upstream is llm/openai's, which package cli does not
// import.
func TestOpenAIBaseURLIsTheAdapters(t *testing.T) {
	if openAIBaseURL != openai.DefaultBaseURL {
		t.Fatalf("openAIBaseURL %q, llm/openai's DefaultBaseURL %q", openAIBaseURL, openai.DefaultBaseURL)
	}
}
