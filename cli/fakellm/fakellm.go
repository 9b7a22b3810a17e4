// Package fakellm is the `fake-llm` command of the onceflow binary: llm/fakeserver, an
// OpenAI-compatible (and Anthropic Messages) model server with injectable faults and
// both providers' batch APIs, for demos and tests (docs/retries.md, "onceflow fake-llm"). A program of one's own built
// on package cli has it only when it lists Command in cli.App.Commands, so that its
// production binary does not carry a fake model server.
package fakellm

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/internal/listen"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// Command returns the `fake-llm` command, for cli.App.Commands.
func Command() cli.Command {
	return cli.Command{
		Name:    "fake-llm",
		Summary: "serve a fake OpenAI-compatible model with injectable faults (demos and tests)",
		Run:     run,
	}
}

// run serves llm/fakeserver on --addr until SIGINT/SIGTERM, then releases hung and
// dripping requests and shuts down.
func run(ctx context.Context, e cli.Env, args []string) error {
	fs := e.Flags("fake-llm", "--addr ADDR [--script FILE] [fault flags]\n\n"+
		"At run time, POST /_fault with {\"fault\": KIND} answers every model request with fault KIND\n"+
		"(an outage of the provider) until {\"fault\": \"\"}; GET /_fault reports it. KIND: "+forcibleFaults()+".",
		config.GroupHTTP, config.GroupShutdown, config.GroupLogs)
	addr := fs.String("addr", "127.0.0.1:9090", "listen address (port 0 picks a free port)")
	latency := fs.Duration("latency", 0, "time to produce each answer")
	fail429 := fs.Float64("fail-429", 0, "probability (0 to 1) of a 429 rate_limit_exceeded with Retry-After")
	retryAfter := fs.Int("retry-after", 1, "Retry-After of a 429, in seconds")
	fail503 := fs.Float64("fail-503", 0, "probability of a 503 server_error (529 overloaded_error on /v1/messages)")
	failQuota := fs.Float64("fail-quota", 0, "probability of a 429 insufficient_quota (not retryable)")
	hang := fs.Float64("hang", 0, "probability that a request is never answered (until the client goes away)")
	drip := fs.Float64("drip", 0, "probability that an answer is sent one byte every --drip-interval")
	dripInterval := fs.Duration("drip-interval", fakeserver.DefaultDripInterval, "pause between two bytes of a dripped answer")
	drop := fs.Float64("drop-stream", 0, "probability that the connection closes halfway through an answer")
	maxInput := fs.Int("max-input-chars", 0, "longer prompts get 400 context_length_exceeded (0: no limit)")
	honour := fs.Bool("honour-idempotency", false, "replay the first answer to a repeated Idempotency-Key")
	force := fs.String("fault", "", "answer every request with this fault from the start, until POST /_fault ends it (KIND as for /_fault)")
	seed := fs.Uint64("seed", 0, "seed of faults, ids and samples (0: random)")
	toolIDs := fs.String("tool-call-ids", fakeserver.ToolCallIDsRandom, "tool-call ids for a repeated request: stable or random")
	tool := fs.String("tool", "", "when a request declares tool NAME, answer with a call to it (default: the first tool)")
	toolArgs := fs.String("tool-args", "", "the arguments of the --tool call, a JSON object (default: derived from the tool's schema)")
	noTools := fs.Bool("no-tool-calls", false, "answer requests that declare tools in text, as when the model needs none")
	scriptFile := fs.String("script", "", "answer every request from the turns in `FILE`, a JSON list of {\"tool_calls\": [{\"name\": ..., \"arguments\": {...}}]} or {\"text\": ...}:\n"+
		"turn N answers a conversation holding N tool results, the last turn once they run out (excludes --tool, --tool-args, --no-tool-calls)")
	rpm := fs.Int("rpm", 0, "requests per minute per model, enforced like OpenAI: 429 with Retry-After and x-ratelimit-* headers (0: no limit)")
	tpm := fs.Int("tpm", 0, "tokens per minute per model: the prompt's estimate plus max_tokens on arrival, corrected by the usage (0: no limit)")
	batchDelay := fs.Duration("batch-delay", fakeserver.DefaultBatchDelay, "time from a batch's creation to its end (OpenAI Batch API, Anthropic Message Batches)")
	batchWindow := fs.Duration("batch-window", fakeserver.DefaultBatchWindow, "a batch's completion window (expires_at): one not ended by then expires (shorter than --batch-delay to test expiry)")
	batchFail := fs.Int("batch-fail-every", 0, "about one batch request in N errors with a 500, picked by a hash of its custom_id (0: none)")
	batchExpire := fs.Int("batch-expire-every", 0, "about one batch request in N expires, picked by a hash of its custom_id (0: none)")
	batchRetention := fs.Duration("batch-retention", fakeserver.DefaultBatchRetention, "how long ended batches, their results and their files are kept")
	batchMaxBytes := fs.Int64("batch-max-bytes", fakeserver.DefaultBatchMaxBytes, "largest batch input file or message batch body, in bytes (413 beyond)")
	cfg, log, err := e.Load(fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	chooser, err := toolChooser(*tool, *toolArgs, *noTools)
	if err != nil {
		return err
	}
	script, err := readScript(*scriptFile, *tool != "" || *toolArgs != "" || *noTools)
	if err != nil {
		return err
	}
	if *retryAfter < 0 {
		return cli.UsageErrorf("--retry-after %d: must not be negative", *retryAfter)
	}
	if *dripInterval <= 0 {
		return cli.UsageErrorf("--drip-interval %v: must be positive", *dripInterval)
	}
	if *rpm < 0 {
		return cli.UsageErrorf("--rpm %d: must not be negative", *rpm)
	}
	if *tpm < 0 {
		return cli.UsageErrorf("--tpm %d: must not be negative", *tpm)
	}
	for name, d := range map[string]time.Duration{"batch-delay": *batchDelay, "batch-window": *batchWindow, "batch-retention": *batchRetention} {
		if d <= 0 {
			return cli.UsageErrorf("--%s %v: must be positive", name, d)
		}
	}
	if *batchFail < 0 || *batchExpire < 0 {
		return cli.UsageErrorf("--batch-fail-every and --batch-expire-every must not be negative")
	}
	if *batchMaxBytes <= 0 {
		return cli.UsageErrorf("--batch-max-bytes %d: must be positive", *batchMaxBytes)
	}
	ra := time.Duration(*retryAfter) * time.Second
	if ra == 0 {
		ra = time.Nanosecond // Config's zero means its 1s default; the flag's 0 means "Retry-After: 0"
	}
	srv, err := fakeserver.New(fakeserver.Config{
		Latency: *latency, Fail429: *fail429, Fail503: *fail503, FailQuota: *failQuota, Hang: *hang, Drip: *drip, DropStream: *drop,
		DripInterval: *dripInterval, RetryAfter: ra, MaxInputChars: *maxInput, HonourIdempotency: *honour, ToolCallIDs: *toolIDs, ToolChoice: chooser, Script: script, Seed: *seed, Logger: log,
		Fault: fakeserver.FaultKind(*force), RPM: *rpm, TPM: *tpm,
		BatchDelay: *batchDelay, BatchWindow: *batchWindow, BatchFailEvery: *batchFail, BatchExpireEvery: *batchExpire,
		BatchRetention: *batchRetention, BatchMaxBytes: *batchMaxBytes,
	})
	if err != nil {
		return cli.UsageErrorf("fake-llm: %v", err)
	}
	go func() {
		<-ctx.Done()
		srv.Close() // release hung and dripping requests so shutdown does not wait for them
	}()
	ready := func(a net.Addr) {
		log.InfoContext(ctx, "fake-llm listening", "addr", a.String(), "base_url", fmt.Sprintf("http://%s/v1", a),
			"fail_429", *fail429, "retry_after_s", *retryAfter, "fail_503", *fail503, "fail_quota", *failQuota, "hang", *hang,
			"drip", *drip, "drip_interval", dripInterval.String(), "drop_stream", *drop, "max_input_chars", *maxInput, "honour_idempotency", *honour, "tool_call_ids", *toolIDs,
			"tool", *tool, "no_tool_calls", *noTools, "script", *scriptFile, "script_turns", len(script), "fault", *force, "rpm", *rpm, "tpm", *tpm,
			"batch_delay", batchDelay.String(), "batch_window", batchWindow.String(), "batch_fail_every", *batchFail, "batch_expire_every", *batchExpire)
	}
	if err := httpapi.Serve(ctx, *addr, srv, listen.ServeConfig(cfg, log, ready)); err != nil {
		return fmt.Errorf("fake-llm: %w", err)
	}
	log.InfoContext(ctx, "fake-llm stopped")
	return nil
}

// forcibleFaults lists the kinds --fault and POST /_fault accept.
func forcibleFaults() string {
	kinds := make([]string, len(fakeserver.ForcibleFaults))
	for i, k := range fakeserver.ForcibleFaults {
		kinds[i] = string(k)
	}
	return strings.Join(kinds, ", ")
}

// toolChooser is the fakeserver.ToolChooser of the --tool, --tool-args and
// --no-tool-calls flags: nil (the first tool) when none is given.
func toolChooser(tool, args string, none bool) (fakeserver.ToolChooser, error) {
	switch {
	case none && (tool != "" || args != ""):
		return nil, cli.UsageErrorf("--no-tool-calls excludes --tool and --tool-args")
	case none:
		return fakeserver.NoToolCalls, nil
	case args != "" && tool == "":
		return nil, cli.UsageErrorf("--tool-args needs --tool")
	case tool == "":
		return nil, nil
	}
	var raw json.RawMessage
	if args != "" {
		var obj map[string]json.RawMessage
		if err := json.Unmarshal([]byte(args), &obj); err != nil || obj == nil {
			return nil, cli.UsageErrorf("--tool-args %q: not a JSON object", args)
		}
		raw = json.RawMessage(args)
	}
	return fakeserver.CallTool(tool, raw), nil
}

// readScript reads the --script file: nil without one. A file that cannot be read or
// parsed, or --script beside a tool flag (the script decides every answer, so the flag
// would do nothing), is a usage error naming the file, the turn and the field.
func readScript(name string, toolFlags bool) ([]fakeserver.ScriptTurn, error) {
	switch {
	case name == "":
		return nil, nil
	case toolFlags:
		return nil, cli.UsageErrorf("--script excludes --tool, --tool-args and --no-tool-calls: the script decides every answer")
	}
	data, err := os.ReadFile(name) // #nosec G304 -- the file the operator names with --script
	if err != nil {
		return nil, cli.UsageErrorf("--script: %v", err)
	}
	script, err := fakeserver.ParseScript(data)
	if err != nil {
		return nil, cli.UsageErrorf("--script %s: %v", name, err)
	}
	return script, nil
}
