package cli

import (
	"bytes"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// The production binary, built like `make build` (no build tag), has no test aids:
// `work --test-handler` is an unknown flag (exit 2), `work -h` and `help` do not
// mention it, the test handler's code is not linked in, and `help` lists every command
// the binary has (none is hidden).
func TestProductionBuildHasNoTestAids(t *testing.T) {
	t.Parallel()
	bin := testenv.ProductionBinary(t)

	work := testenv.Start(t, bin, nil, "work", "--test-handler=noop")
	if code := work.Wait(10 * time.Second); code != 2 || !strings.Contains(work.Stderr(), "flag provided but not defined: -test-handler") {
		t.Errorf("work --test-handler=noop: exit %d, want 2 for an unknown flag; stderr:\n%s", code, work.Stderr())
	}
	workHelp := testenv.Start(t, bin, nil, "work", "-h")
	if code := workHelp.Wait(10 * time.Second); code != 0 || strings.Contains(workHelp.Stderr(), "test-handler") ||
		!strings.Contains(workHelp.Stderr(), "-worker-concurrency") {
		t.Errorf("work -h: exit %d; it must list the settings and not --test-handler:\n%s", code, workHelp.Stderr())
	}
	help := testenv.Start(t, bin, nil, "help")
	if code := help.Wait(10 * time.Second); code != 0 || strings.Contains(help.Stdout(), "test-handler") || strings.Contains(help.Stdout(), "TEST AID") {
		t.Errorf("help: exit %d; it must list no test aid:\n%s", code, help.Stdout())
	}
	for _, c := range commands() {
		if c.summary == "" || !strings.Contains(help.Stdout(), "\n  "+c.name+" ") {
			t.Errorf("help does not list %s:\n%s", c.name, help.Stdout())
		}
	}
	for _, name := range []string{"fake-llm", "webhook-sink"} { // App.Commands of cmd/onceflow, documented commands
		if !strings.Contains(help.Stdout(), "\n  "+name+" ") {
			t.Errorf("help does not list %s:\n%s", name, help.Stdout())
		}
	}
	code, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"TEST AID", "invalid --test-handler", "test handler: transient failure"} {
		if bytes.Contains(code, []byte(s)) {
			t.Errorf("the production binary contains %q: the test handler is linked in", s)
		}
	}
}
