package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/jsonschema-go/jsonschema"

	"github.com/onceflow/onceflow/internal/strictjson"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// AgentTool is a tool an agent's model may call (AgentConfig.Tools); build one with
// NewTool.
type AgentTool struct {
	// Name and Description are the tool's, as the model sees them.
	Name, Description string
	// Parameters is the JSON Schema of the arguments (NewTool generates it from the
	// arguments' Go type).
	Parameters json.RawMessage
	// AtMostOnce runs the tool through Job.ToolAtMostOnce instead of Job.Tool: for a
	// downstream that honours no idempotency key.
	AtMostOnce bool
	// ApprovalTimeout is how long a call that needs approval (NeedsApproval) waits for
	// an operator's decision. Default: DefaultApprovalTimeout.
	ApprovalTimeout time.Duration
	// ApproveOnTimeout approves such a call when nobody decided in time. Default: false
	// (rejected, and the model is told).
	ApproveOnTimeout bool
	// run runs one call with its raw arguments; a *badArgs error goes back to the model.
	run func(ctx context.Context, key string, args json.RawMessage) (string, error)
	// needsApproval says whether a call with these arguments needs an operator's
	// approval before it runs (NeedsApproval); nil for none.
	needsApproval func(args json.RawMessage) (bool, error)
}

// NeedsApproval returns t requiring an operator's approval before a call runs whose
// arguments (decoded into A, the tool's arguments type) satisfy when: a refund above a
// threshold, an email to an outside address. The job waits for the decision holding no
// worker (Job.Approval); a rejected call is not run, and the model is told.
func NeedsApproval[A any](t AgentTool, when func(args A) bool) AgentTool {
	t.needsApproval = func(raw json.RawMessage) (bool, error) {
		var args A
		if len(raw) == 0 {
			raw = json.RawMessage("{}")
		}
		if err := strictjson.Decode(raw, &args); err != nil {
			return false, &badArgs{err}
		}
		return when(args), nil
	}
	return t
}

// badArgs is a call whose arguments do not decode: the model is told, as the tool's
// result, so that it can correct them.
type badArgs struct{ err error }

func (e *badArgs) Error() string { return e.err.Error() }

// NewTool returns the tool name whose arguments are the Go type A: its JSON Schema is
// generated from A (github.com/google/jsonschema-go: exported fields by their json
// names, `jsonschema:"..."` tags as descriptions), and the model's arguments are decoded
// into an A strictly (unknown or repeated fields refused) before run is called with the
// call's key (ToolCall.Key, the Idempotency-Key to send downstream). Arguments that do
// not decode are not run: the model gets the reason as the tool's result. It returns an
// error when A has no JSON Schema (a channel, a func).
func NewTool[A any](name, description string, run func(ctx context.Context, key string, args A) (string, error)) (AgentTool, error) {
	if name == "" {
		return AgentTool{}, errors.New("onceflow: NewTool: empty name")
	}
	schema, err := jsonschema.For[A](nil)
	if err != nil {
		return AgentTool{}, fmt.Errorf("onceflow: NewTool %s: %w", name, err)
	}
	params, err := json.Marshal(schema)
	if err != nil {
		return AgentTool{}, fmt.Errorf("onceflow: NewTool %s: %w", name, err)
	}
	return AgentTool{Name: name, Description: description, Parameters: params,
		run: func(ctx context.Context, key string, raw json.RawMessage) (string, error) {
			var args A
			if len(raw) == 0 {
				raw = json.RawMessage("{}")
			}
			if err := strictjson.Decode(raw, &args); err != nil {
				return "", &badArgs{err}
			}
			return run(ctx, key, args)
		}}, nil
}

// MustTool is NewTool that panics on an error, for tools declared at package level.
func MustTool[A any](name, description string, run func(ctx context.Context, key string, args A) (string, error)) AgentTool {
	t, err := NewTool(name, description, run)
	if err != nil {
		panic(err)
	}
	return t
}

// DefaultMaxTurns is AgentConfig.MaxTurns's default.
const DefaultMaxTurns = 10

// AgentConfig configures RunAgent.
type AgentConfig struct {
	// Name prefixes the agent's step names: each turn is the model step
	// "<Name>.turn-<n>". Give two agents of one job different names. Default: "agent".
	Name string
	// Request is the first turn's request: the model, the system and user messages,
	// sampling settings. RunAgent appends the tools and every turn's messages; Request
	// is not modified. Required (with at least one message).
	Request *llm.Request
	// Tools are the tools the model may call. A call of a tool not listed is answered,
	// as the tool's result, with an error the model can read.
	Tools []AgentTool
	// MaxTurns bounds the model turns: a model still calling tools at the last one fails
	// the job permanently (ErrAgentTurnLimit). Default: DefaultMaxTurns.
	MaxTurns int
	// Stream streams each turn (Job.Stream) and passes its chunks to OnChunk; otherwise
	// each turn is a Job.Complete.
	Stream bool
	// OnChunk, with Stream, receives every chunk of every turn as it arrives (also of a
	// turn the ledger replays, in one piece). Default: none.
	OnChunk func(turn int, ch llm.Chunk)
}

// AgentResult is what RunAgent returns.
type AgentResult struct {
	// Answer is the final turn's text.
	Answer string
	// Messages is the transcript: Request's messages, then every turn's canonical
	// messages (Turn), then the final answer.
	Messages []llm.Message
	// Steps are the model steps, one per turn.
	Steps []*Step
	// ToolCalls counts the tool calls run (recorded or replayed).
	ToolCalls int
}

// RunAgent runs an agent loop as part of job: a model turn, its tool calls (in
// parallel, each through Job.Tool or Job.ToolAtMostOnce, so each runs once and its
// result is recorded), the results fed back, the next turn, until the model answers
// without calling a tool. Every turn is a ledgered model step, and the conversation sent
// to each is canonical (stable tool-call ids, recorded results), so a redelivered job
// replays its recorded turns and tools in order and continues where the last delivery
// stopped, making no model call and running no tool a second time.
//
// A tool's failure fails the job (the Worker returns it: retried as any error, the
// tools that finished keep their records); arguments that do not decode, and an unknown
// tool, are answered to the model instead.
func RunAgent[T JobArgs](ctx context.Context, job *Job[T], cfg AgentConfig) (*AgentResult, error) {
	if cfg.Request == nil || len(cfg.Request.Messages) == 0 {
		return nil, retry.Permanent(errors.New("onceflow: RunAgent: AgentConfig.Request with at least one message is required"))
	}
	name := cmp.Or(cfg.Name, "agent")
	maxTurns := cmp.Or(cfg.MaxTurns, DefaultMaxTurns)
	tools := map[string]*AgentTool{}
	req := *cfg.Request
	req.Tools = slices.Clone(req.Tools)
	for i := range cfg.Tools {
		t := &cfg.Tools[i]
		if t.run == nil {
			return nil, retry.Permanent(fmt.Errorf("onceflow: RunAgent: tool %q was not made by NewTool", t.Name))
		}
		if _, dup := tools[t.Name]; dup {
			return nil, retry.Permanent(fmt.Errorf("onceflow: RunAgent: tool %q is listed twice", t.Name))
		}
		tools[t.Name] = t
		req.Tools = append(req.Tools, llm.Tool{Name: t.Name, Description: t.Description, Parameters: t.Parameters})
	}
	out := &AgentResult{Messages: slices.Clone(req.Messages)}
	for turn := 1; turn <= maxTurns; turn++ {
		req.Messages = out.Messages
		step, err := agentTurn(ctx, job, fmt.Sprintf("%s.turn-%d", name, turn), &req, turn, cfg)
		if err != nil {
			return nil, err
		}
		out.Steps = append(out.Steps, step)
		calls := job.ToolCalls(step)
		if len(calls) == 0 {
			out.Answer = step.Response.Content
			out.Messages = append(slices.Clone(out.Messages), llm.Message{Role: llm.RoleAssistant, Content: step.Response.Content})
			return out, nil
		}
		if turn == maxTurns {
			break
		}
		// An operator deciding an approval reads the conversation up to the model's turn
		// that asked for the calls.
		asked := append(slices.Clone(out.Messages), Turn(step, calls, nil)[0])
		results, err := runTools(ctx, job, tools, calls, asked)
		if err != nil {
			return nil, err
		}
		out.ToolCalls += len(calls)
		out.Messages = append(slices.Clone(out.Messages), Turn(step, calls, results)...)
	}
	return nil, retry.Permanent(fmt.Errorf("%w: %d turns, and the model still calls tools", ErrAgentTurnLimit, maxTurns))
}

// agentTurn makes one model turn, streamed or not.
func agentTurn[T JobArgs](ctx context.Context, job *Job[T], step string, req *llm.Request, turn int, cfg AgentConfig) (*Step, error) {
	if !cfg.Stream {
		return job.Complete(ctx, step, req)
	}
	s := job.Stream(ctx, step, req)
	for ch, err := range s.All() {
		if err != nil {
			return nil, err
		}
		if cfg.OnChunk != nil {
			cfg.OnChunk(turn, ch)
		}
	}
	if s.Step() == nil {
		return nil, fmt.Errorf("onceflow: agent step %q: the stream ended without an answer", step)
	}
	return s.Step(), nil
}

// runTools runs one turn's calls in parallel and returns their results in order.
func runTools[T JobArgs](ctx context.Context, job *Job[T], tools map[string]*AgentTool, calls []ToolCall, messages []llm.Message) ([]string, error) {
	results := make([]string, len(calls))
	errs := make([]error, len(calls))
	var wg sync.WaitGroup
	for i, call := range calls {
		t := tools[call.Name]
		if t == nil {
			results[i] = fmt.Sprintf("error: there is no tool %q", call.Name)
			continue
		}
		wg.Go(func() {
			if t.needsApproval != nil {
				need, err := t.needsApproval(json.RawMessage(call.Arguments))
				var bad *badArgs
				if errors.As(err, &bad) {
					results[i] = "error: the arguments do not decode: " + bad.Error()
					return
				}
				if need {
					d, err := job.Approval(ctx, call, ApprovalConfig{Timeout: t.ApprovalTimeout, ApproveOnTimeout: t.ApproveOnTimeout, Messages: messages})
					if err != nil {
						errs[i] = err
						return
					}
					if !d.Approved {
						results[i] = "rejected: the operator did not approve this call"
						if d.Note != "" {
							results[i] += ": " + d.Note
						}
						return
					}
				}
			}
			fn := func(ctx context.Context, key string) (string, error) {
				return t.run(ctx, key, json.RawMessage(call.Arguments))
			}
			run := job.Tool
			if t.AtMostOnce {
				run = job.ToolAtMostOnce
			}
			r, err := run(ctx, call, fn)
			var bad *badArgs
			if errors.As(err, &bad) {
				r, err = "error: the arguments do not decode: "+bad.Error(), nil
			}
			results[i], errs[i] = r, err
		})
	}
	wg.Wait()
	// A call waiting for approval parks the job (the earliest deadline first) once the
	// turn's other calls ran; any other failure wins over a wait.
	var wait *retry.WaitError
	var others []error
	for _, err := range errs {
		var w *retry.WaitError
		switch {
		case err == nil:
		case errors.As(err, &w):
			if wait == nil || w.Delay < wait.Delay {
				wait = w
			}
		default:
			others = append(others, err)
		}
	}
	if err := errors.Join(others...); err != nil {
		return nil, err
	}
	if wait != nil {
		return nil, wait
	}
	return results, nil
}
