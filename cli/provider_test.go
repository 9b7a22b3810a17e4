package cli_test

import (
	"bytes"
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// runWith runs one command of app with env to its end: its stderr and exit status.
func runWith(app cli.App, env map[string]string, args ...string) (string, int) {
	var errs bytes.Buffer
	err := cli.Run(context.Background(), app, args, &bytes.Buffer{}, &errs, func(k string) string { return env[k] })
	return errs.String(), cli.ExitCode(err)
}

// A program that does not list a provider cannot select it: ONCEFLOW_LLM naming it
// stops every command that reads settings, before it connects to anything, with one
// line naming the package to import (exit 2).
func TestProviderNotLinkedIsAConfigurationError(t *testing.T) {
	t.Parallel()
	app := cli.App{Name: "notesd", Workflows: func(h cli.Host) ([]onceflow.Workflow, error) {
		return []onceflow.Workflow{notesWorkflow(h)}, nil
	}}
	for _, tc := range []struct{ llm, pkg string }{
		{"openai", `import "github.com/onceflow/onceflow/cli/openaiprovider" and list openaiprovider.Provider() in cli.App.Providers`},
		{"anthropic", `import "github.com/onceflow/onceflow/cli/anthropicprovider" and list anthropicprovider.Provider() in cli.App.Providers`},
	} {
		for _, cmd := range []string{"work", "run", "migrate", "serve", "gateway"} {
			errs, code := runWith(app, map[string]string{"ONCEFLOW_LLM": tc.llm}, cmd)
			want := `notesd: invalid ONCEFLOW_LLM="` + tc.llm + `": this program does not link the ` + tc.llm + ` provider (it has fake): ` + tc.pkg
			if code != 2 || strings.TrimSpace(errs) != want {
				t.Errorf("%s with ONCEFLOW_LLM=%s: exit %d, want 2 with the one line\n%s\ngot:\n%s", cmd, tc.llm, code, want, errs)
			}
		}
	}
	if errs, code := runWith(app, map[string]string{"ONCEFLOW_LLM": "gemini"}, "work"); code != 2 ||
		!strings.Contains(errs, `invalid ONCEFLOW_LLM="gemini": want one of openai, anthropic, fake`) {
		t.Errorf("ONCEFLOW_LLM=gemini: exit %d, stderr %q", code, errs)
	}
}

// The commands that run jobs build the model client with the provider ONCEFLOW_LLM
// selects among App.Providers, from the settings; a provider named fake replaces the
// built-in one.
func TestAppProvidersBuildTheModel(t *testing.T) {
	t.Parallel()
	var built []string
	provider := func(name string) cli.Provider {
		return cli.Provider{Name: name, New: func(cfg *config.Config) (llm.Client, error) {
			built = append(built, name+" "+cfg.LLMModel)
			return fake.New(), nil
		}}
	}
	app := cli.App{Name: "notesd", Providers: []cli.Provider{provider("openai"), provider("fake")},
		Workflows: func(h cli.Host) ([]onceflow.Workflow, error) { return []onceflow.Workflow{notesWorkflow(h)}, nil }}
	env := map[string]string{"ONCEFLOW_LLM": "openai", "ONCEFLOW_LLM_MODEL": "gpt-test"}
	// --queue names no queue of the program: work stops (exit 2) after building its
	// Client, model included, and before it works anything.
	if errs, code := runWith(app, env, "work", "--queue", "mail"); code != 2 || !strings.Contains(errs, `--queue "mail": no such queue`) {
		t.Fatalf("work --queue mail: exit %d, stderr %q", code, errs)
	}
	env["ONCEFLOW_LLM"] = "fake"
	runWith(app, env, "work", "--queue", "mail")
	if strings.Join(built, ", ") != "openai gpt-test, fake gpt-test" {
		t.Fatalf("providers built %q, want the openai provider, then the program's fake, each with the model", built)
	}

	failing := cli.App{Name: "notesd", Providers: []cli.Provider{{Name: "openai", New: func(*config.Config) (llm.Client, error) {
		return nil, &config.Error{Name: "OPENAI_API_KEY", Err: errors.New("required")}
	}}}, Workflows: app.Workflows}
	if errs, code := runWith(failing, map[string]string{"ONCEFLOW_LLM": "openai"}, "work"); code != 2 ||
		!strings.Contains(errs, "model provider openai: invalid OPENAI_API_KEY") {
		t.Errorf("a provider's configuration error: exit %d, want 2; stderr %q", code, errs)
	}
}

// An App.Providers entry ONCEFLOW_LLM could never select, or without New, or listed
// twice, is a usage error of the program (exit 2), whatever the command.
func TestAppProvidersMustBeUsable(t *testing.T) {
	t.Parallel()
	newFake := func(*config.Config) (llm.Client, error) { return fake.New(), nil }
	for _, ps := range [][]cli.Provider{
		{{Name: "gemini", New: newFake}},
		{{Name: "openai"}},
		{{Name: "openai", New: newFake}, {Name: "openai", New: newFake}},
	} {
		if errs, code := runWith(cli.App{Providers: ps}, nil, "version"); code != 2 || !strings.Contains(errs, "cli.App.Providers[") {
			t.Errorf("App.Providers %+v: exit %d, want 2; stderr %q", ps, code, errs)
		}
	}
}

// A program on package cli links only the providers and commands it lists: the smallest
// one (examples/embed: cli.Main with one workflow) has neither model SDK nor their
// adapters, neither the fake model server nor the webhook sink, all of which the
// onceflow binary (cmd/onceflow, which lists them) has.
func TestEmbeddingProgramLinksOnlyWhatItLists(t *testing.T) {
	t.Parallel()
	deps := func(pkg string) map[string]bool {
		t.Helper()
		cmd := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", pkg)
		cmd.Dir = ".."
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		set := map[string]bool{}
		for _, p := range strings.Fields(string(out)) {
			set[p] = true
		}
		return set
	}
	reference, embed := deps("./cmd/onceflow"), deps("./examples/embed")
	if !embed["github.com/onceflow/onceflow/cli"] {
		t.Fatal("examples/embed does not embed package cli")
	}
	for _, p := range []string{
		"github.com/openai/openai-go/v3", "github.com/anthropics/anthropic-sdk-go/v2",
		"github.com/onceflow/onceflow/llm/openai", "github.com/onceflow/onceflow/llm/anthropic",
		"github.com/onceflow/onceflow/llm/fakeserver", "github.com/onceflow/onceflow/internal/webhooksink",
	} {
		if !reference[p] {
			t.Errorf("the onceflow binary does not link %s", p)
		}
		if embed[p] {
			t.Errorf("examples/embed links %s, which it does not list", p)
		}
	}
}
