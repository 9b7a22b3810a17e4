package cli

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/config"
)

// A role warns at its start of the trial defaults it would act on: the fake model for
// the roles that call the model (work, run), the log sender for those that deliver
// effects (relay, run); a real provider and sender, or a role that uses neither, warn
// of nothing.
func TestRolesWarnOfTheFakeModelAndTheLogSender(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		llm, sender   string
		model, send   bool
		want, wantNot []string
	}{
		{"defaults under run", "fake", "log", true, true, []string{"ONCEFLOW_LLM is fake", "ONCEFLOW_SENDER is log"}, nil},
		{"defaults under work", "fake", "log", true, false, []string{"ONCEFLOW_LLM is fake"}, []string{"ONCEFLOW_SENDER"}},
		{"defaults under relay", "fake", "log", false, true, []string{"ONCEFLOW_SENDER is log"}, []string{"ONCEFLOW_LLM"}},
		{"a real provider and sender", "openai", "webhook", true, true, nil, []string{"ONCEFLOW_LLM", "ONCEFLOW_SENDER"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.Defaults()
			if cfg.LLM != "fake" || cfg.Sender != "log" {
				t.Fatalf("the defaults are ONCEFLOW_LLM=%s ONCEFLOW_SENDER=%s; this test expects fake and log", cfg.LLM, cfg.Sender)
			}
			cfg.LLM, cfg.Sender = tc.llm, tc.sender
			var buf bytes.Buffer
			warnTrialSettings(context.Background(), slog.New(slog.NewTextHandler(&buf, nil)), cfg, tc.model, tc.send)
			for _, w := range tc.want {
				if !strings.Contains(buf.String(), "level=WARN msg=\""+w) {
					t.Errorf("no warning %q in %q", w, buf.String())
				}
			}
			for _, w := range tc.wantNot {
				if strings.Contains(buf.String(), w) {
					t.Errorf("warned of %q: %q", w, buf.String())
				}
			}
		})
	}
}
