package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/llm/probe"
)

// openAIBaseURL is the OpenAI API's root, llm/openai's DefaultBaseURL: the default
// upstream of gateway and probe. The command does not import llm/openai for it, which
// would link the OpenAI SDK into every program built on package cli.
const openAIBaseURL = "https://api.openai.com/v1"

// errKeyIgnored is probe's error when the provider ignores Idempotency-Key: exit 3.
var errKeyIgnored = errors.New("the provider ignores Idempotency-Key")

// errInconclusive is probe's error when it could not decide: exit 1.
var errInconclusive = errors.New("probe inconclusive")

// envName is what --api-key-env accepts: an environment variable name.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// runProbe sends one Idempotency-Key twice with a non-deterministic prompt and prints
// honoured (exit 0), ignored (exit 3) or inconclusive (exit 1) with both response ids
// (docs/providers.md, "Verifying a provider").
func runProbe(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "probe", "--base-url URL --model M [--api-key-env VAR] [--json]", config.GroupModel)
	loader := config.Register(fs)
	baseURL := fs.String("base-url", "", "OpenAI-compatible API root, /v1 included (default: ONCEFLOW_LLM_BASE_URL, else "+openAIBaseURL+")")
	model := fs.String("model", "", "model to ask (default: ONCEFLOW_LLM_MODEL)")
	keyEnv := fs.String("api-key-env", "OPENAI_API_KEY", "environment variable holding the API key (sent as a bearer token; never printed)")
	timeout := fs.Duration("timeout", probe.DefaultTimeout, "limit of each of the two requests")
	asJSON := fs.Bool("json", false, "print one JSON object on stdout")
	cfg, _, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	if !envName.MatchString(*keyEnv) {
		return usageErrorf("--api-key-env %q: not an environment variable name", *keyEnv)
	}
	if *timeout <= 0 {
		return usageErrorf("--timeout %v: must be positive", *timeout)
	}
	pc := probe.Config{BaseURL: *baseURL, Model: *model, APIKey: e.getenv(*keyEnv), Timeout: *timeout}
	if pc.BaseURL == "" {
		pc.BaseURL = cfg.LLMBaseURL
	}
	if pc.BaseURL == "" {
		pc.BaseURL = openAIBaseURL
	}
	if pc.Model == "" {
		pc.Model = cfg.LLMModel
	}
	r, err := probe.Run(ctx, pc)
	if err != nil {
		return &config.Error{Name: "--base-url/--model", Value: config.RedactURL(pc.BaseURL), Err: err}
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			return err
		}
	} else {
		fmt.Fprint(e.stdout, r.String())
	}
	switch r.Verdict {
	case probe.Honoured:
		return nil
	case probe.Ignored:
		return &exitError{code: 3, err: fmt.Errorf("%w (ids %s and %s)", errKeyIgnored, r.First.ID, r.Second.ID)}
	}
	return &exitError{code: 1, err: fmt.Errorf("%w: %s", errInconclusive, r.Reason)}
}
