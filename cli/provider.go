package cli

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// Provider is a model provider that ONCEFLOW_LLM selects (App.Providers): how the
// commands that run jobs (work, run) build the model client from the settings. The
// onceflow binary's are in packages of their own, cli/openaiprovider and
// cli/anthropicprovider, so that a program links a provider's SDK only when it lists
// the provider; the fake (ONCEFLOW_LLM=fake, the default) is built in.
type Provider struct {
	// Name is the value of ONCEFLOW_LLM that selects it: openai, anthropic or fake (the
	// values the variable accepts). A Provider named fake replaces the built-in one.
	Name string
	// New returns the provider's client for cfg (ONCEFLOW_LLM_BASE_URL,
	// ONCEFLOW_LLM_MODEL, the provider's credentials). Return a *config.Error for a
	// setting it cannot use (exit 2).
	New func(cfg *config.Config) (llm.Client, error)
	// NewBatch, when set, returns the provider's batch API for cfg: the batch lane's
	// (ONCEFLOW_SUMMARIES_LANE=batch, onceflow.Config.Batch). Default: none; the lane
	// then refuses to start.
	NewBatch func(cfg *config.Config) (onceflow.BatchAPI, error)
}

// fakeProvider is the built-in provider: llm/fake, in-process and deterministic.
var fakeProvider = Provider{Name: "fake", New: func(*config.Config) (llm.Client, error) { return fake.New(), nil }}

// providerPackages names the package providing each provider the onceflow binary has,
// for the error of a program that does not list it.
var providerPackages = map[string]string{
	"openai":    "github.com/onceflow/onceflow/cli/openaiprovider",
	"anthropic": "github.com/onceflow/onceflow/cli/anthropicprovider",
}

// provider returns app's provider named name: one of App.Providers, else the built-in
// fake.
func (app App) provider(name string) (Provider, bool) {
	for _, p := range app.Providers {
		if p.Name == name {
			return p, true
		}
	}
	if name == fakeProvider.Name {
		return fakeProvider, true
	}
	return Provider{}, false
}

// providerNames lists the names of app's providers, sorted.
func (app App) providerNames() []string {
	names := []string{fakeProvider.Name}
	for _, p := range app.Providers {
		if !slices.Contains(names, p.Name) {
			names = append(names, p.Name)
		}
	}
	slices.Sort(names)
	return names
}

// checkProviders reports an App.Providers entry that cannot be used: no New, a name
// ONCEFLOW_LLM cannot take, or a name given twice.
func checkProviders(ps []Provider) error {
	seen := map[string]bool{}
	for i, p := range ps {
		switch {
		case p.New == nil:
			return usageErrorf("cli.App.Providers[%d] (%q): a provider needs a New", i, p.Name)
		case !slices.Contains(config.Providers(), p.Name):
			return usageErrorf("cli.App.Providers[%d]: ONCEFLOW_LLM cannot select %q (it takes %s)", i, p.Name,
				strings.Join(config.Providers(), ", "))
		case seen[p.Name]:
			return usageErrorf("cli.App.Providers[%d]: the provider %q is listed twice", i, p.Name)
		}
		seen[p.Name] = true
	}
	return nil
}

// checkProvider is every command's check of its settings (Env.check): ONCEFLOW_LLM
// names a provider app links; if not, a configuration error (exit 2) naming the
// package that provides it.
func (app App) checkProvider(cfg *config.Config) error {
	if _, ok := app.provider(cfg.LLM); ok {
		return nil
	}
	msg := fmt.Sprintf("this program does not link the %s provider (it has %s)", cfg.LLM, strings.Join(app.providerNames(), ", "))
	if pkg, ok := providerPackages[cfg.LLM]; ok {
		name := pkg[strings.LastIndex(pkg, "/")+1:]
		msg = fmt.Sprintf("%s: import %q and list %s.Provider() in cli.App.Providers", msg, pkg, name)
	}
	return &config.Error{Name: "ONCEFLOW_LLM", Value: cfg.LLM, Err: errors.New(msg)}
}

// newBatchAPI returns the batch API of the provider ONCEFLOW_LLM names.
func (app App) newBatchAPI(cfg *config.Config) (onceflow.BatchAPI, error) {
	p, ok := app.provider(cfg.LLM)
	if !ok {
		return nil, app.checkProvider(cfg)
	}
	if p.NewBatch == nil {
		return nil, &config.Error{Name: "ONCEFLOW_LLM", Value: cfg.LLM,
			Err: fmt.Errorf("the model provider %s has no batch API, which the batch lane needs (openai and anthropic have)", p.Name)}
	}
	b, err := p.NewBatch(cfg)
	if err != nil {
		return nil, fmt.Errorf("model provider %s: batch API: %w", p.Name, err)
	}
	return b, nil
}

// newLLMClient returns the model client of the provider ONCEFLOW_LLM selects.
func (app App) newLLMClient(cfg *config.Config) (llm.Client, error) {
	p, ok := app.provider(cfg.LLM)
	if !ok {
		return nil, app.checkProvider(cfg)
	}
	c, err := p.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("model provider %s: %w", p.Name, err)
	}
	return c, nil
}
