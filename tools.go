package onceflow

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
	"github.com/onceflow/onceflow/retry"
)

// ToolCall is a model's tool call as a job runs it (Job.ToolCalls): the provider's call
// with a stable ID, and the call's content-addressed key.
type ToolCall struct {
	// ToolCall is the call: the tool's Name and the Arguments the model wrote; ID is
	// the stable id toolkey.CallID(Key), which the canonical conversation (Turn) gives
	// the call in place of the provider's.
	llm.ToolCall
	// Key identifies the call in its job: toolkey.JobKey of the job, the tool name, the
	// canonical arguments and which of the job's identical calls this is. It is the
	// same on every delivery that makes the same call, whatever id the provider gave
	// it, so Job.Tool records the result under it and passes it to the tool as the
	// Idempotency-Key to send downstream.
	Key string
	// ProviderID is the id the provider gave the call ("" for none).
	ProviderID string
}

// InDoubtError is the error of a job in doubt: the tool call nobody knows the outcome
// of. It matches ErrInDoubt.
type InDoubtError struct {
	// Tool and Arguments are the call's; Key is its key (ToolCall.Key).
	Tool, Arguments, Key string
}

func (e *InDoubtError) Error() string {
	return fmt.Sprintf("onceflow: in doubt: tool %q (key %s) was started and its outcome never recorded: an operator decides whether it happened", e.Tool, e.Key)
}

// Is makes an InDoubtError match ErrInDoubt.
func (e *InDoubtError) Is(target error) bool { return target == ErrInDoubt }

// ToolFunc runs one tool call: key is the call's key (ToolCall.Key), to send downstream
// as the Idempotency-Key of the effect; the returned string is the tool's result as
// the model will read it.
type ToolFunc func(ctx context.Context, key string) (string, error)

// ToolCalls returns the tool calls of the model step s (s.Response.ToolCalls, in order),
// each keyed by its content (ToolCall.Key) and given its stable id. The key counts the
// job's identical calls in the order this delivery asks for them, so ask for every
// turn's calls in turn order, as a loop does (RunAgent does); asking again for one
// step's calls returns the same calls.
func (j *Job[T]) ToolCalls(s *Step) []ToolCall {
	if s == nil || s.Response == nil || len(s.Response.ToolCalls) == 0 {
		return nil
	}
	js := &j.run.recorded
	js.mu.Lock()
	defer js.mu.Unlock()
	if calls, ok := js.calls[s.Key]; ok && s.Key != "" {
		return slices.Clone(calls)
	}
	if js.seen == nil {
		js.seen, js.calls = map[string]int{}, map[string][]ToolCall{}
	}
	out := make([]ToolCall, 0, len(s.Response.ToolCalls))
	for _, c := range s.Response.ToolCalls {
		content := toolkey.ContentKey(c)
		n := js.seen[content]
		js.seen[content] = n + 1
		key := toolkey.JobKey(j.Tenant, j.ID, c, n)
		out = append(out, ToolCall{ToolCall: llm.ToolCall{ID: toolkey.CallID(key), Name: c.Name, Arguments: c.Arguments}, Key: key, ProviderID: c.ID})
	}
	if s.Key != "" {
		js.calls[s.Key] = out
	}
	return slices.Clone(out)
}

// Tool runs the tool call call through fn, once per key: the first successful result
// is recorded (as Do records a step's) and every later delivery that makes the same
// call gets it back, byte for byte, without calling fn. fn gets the call's key to send
// downstream as the Idempotency-Key of its effect.
//
// As with Do, a crash between fn's return and the record makes a later delivery call fn
// again with the same key: a downstream that honours the key (a payments API, onceflow's
// own routes, the outbox's senders) turns that into one effect. For one that honours no
// key, use ToolAtMostOnce. A failure of fn is returned as it is and nothing is recorded.
func (j *Job[T]) Tool(ctx context.Context, call ToolCall, fn ToolFunc) (string, error) {
	if err := checkToolCall(call); err != nil {
		return "", err
	}
	name := toolStepPrefix + call.Key
	js, err := j.run.steps(ctx)
	if err != nil {
		return "", err
	}
	if r, ok := js.lookup(name); ok {
		if r.state == stepDone {
			return string(r.result), nil
		}
		return "", retry.Permanent(&InDoubtError{Tool: call.Name, Arguments: call.Arguments, Key: call.Key})
	}
	if err := j.run.flushBeforeEffect(ctx); err != nil {
		return "", err
	}
	out, err := fn(ctx, call.Key)
	if err != nil {
		return "", err
	}
	rec, err := j.run.record(ctx, js, name, []byte(out), call.Name, call.Arguments)
	if err != nil {
		return "", err
	}
	return string(rec), nil
}

// ToolAtMostOnce runs the tool call call through fn at most once, for a downstream that
// honours no idempotency key (an email server, a legacy API): it records the intent,
// durably, before fn runs, and the result after. A delivery that finds the intent
// without a result (an earlier delivery died while fn ran, or before its result was
// recorded) does not call fn: it fails with an InDoubtError (ErrInDoubt, permanent),
// the job is dead-lettered in doubt, and an operator decides (Inspector.ResolveInDoubt:
// it happened, with this result; or it did not, run it again).
//
// fn returning an error says the effect did not happen: the intent is removed and the
// error returned, so a later delivery calls fn again. A fn that cannot tell (a timeout
// after the request went out) returns an error wrapping ErrInDoubt: the intent stays
// and the job goes in doubt. Each call costs one more durable commit than Tool's.
func (j *Job[T]) ToolAtMostOnce(ctx context.Context, call ToolCall, fn ToolFunc) (string, error) {
	if err := checkToolCall(call); err != nil {
		return "", err
	}
	name := toolStepPrefix + call.Key
	inDoubt := retry.Permanent(&InDoubtError{Tool: call.Name, Arguments: call.Arguments, Key: call.Key})
	js, err := j.run.steps(ctx)
	if err != nil {
		return "", err
	}
	if r, ok := js.lookup(name); ok {
		if r.state == stepDone {
			return string(r.result), nil
		}
		return "", inDoubt
	}
	rt := j.run
	s := rt.client.steps
	var won bool
	err = s.db.QueryRow(ctx, recordIntentSQL, rt.delivery.Tenant, rt.delivery.JobID, name, call.Name, call.Arguments, s.intentRetention.Microseconds()).Scan(&won)
	if err != nil {
		if !isNoRows(err) {
			return "", PostgresError(fmt.Errorf("onceflow: record the intent of tool %q: %w", call.Name, err))
		}
		r, err := rt.readStep(ctx, name)
		if err != nil {
			return "", err
		}
		js.remember(name, r)
		if r.state == stepDone {
			return string(r.result), nil
		}
		return "", inDoubt
	}
	js.remember(name, stepRecord{state: stepIntent})
	out, err := fn(ctx, call.Key)
	if err != nil {
		if errors.Is(err, ErrInDoubt) {
			return "", retry.Permanent(fmt.Errorf("%w: %w", &InDoubtError{Tool: call.Name, Arguments: call.Arguments, Key: call.Key}, err))
		}
		if _, derr := s.db.Exec(ctx, `DELETE FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'intent'`,
			rt.delivery.Tenant, rt.delivery.JobID, name); derr != nil {
			// The intent stays: the next delivery finds the job in doubt, which an
			// operator resolves. Say why beside the tool's own failure.
			return "", fmt.Errorf("%w (and its intent could not be removed: %w)", err, PostgresError(derr))
		}
		js.forget(name)
		return "", err
	}
	rt.writeMu.Lock()
	_, err = s.db.Exec(ctx, fulfilIntentSQL, rt.delivery.Tenant, rt.delivery.JobID, name, []byte(out), s.retention.Microseconds())
	rt.writeMu.Unlock()
	if err != nil {
		// fn ran; only its record failed. Retried, the delivery would find the
		// intent: in doubt, which is the truth an operator can resolve.
		return "", PostgresError(fmt.Errorf("onceflow: record the result of tool %q: %w", call.Name, err))
	}
	js.remember(name, stepRecord{state: stepDone, result: []byte(out)})
	return out, nil
}

// checkToolCall refuses a call that ToolCalls did not key.
func checkToolCall(call ToolCall) error {
	if len(call.Key) <= len(toolkey.Prefix) || call.Key[:len(toolkey.Prefix)] != toolkey.Prefix {
		return retry.Permanent(fmt.Errorf("onceflow: tool call %q has no key: take it from Job.ToolCalls", call.Name))
	}
	return nil
}

// Turn returns the messages that carry a model step's tool calls and their results
// into the next request, canonically: the assistant message (the answer's text and
// each call with its stable id, ToolCall.ID, in place of the provider's), then one tool
// message per call with its result, in the order of calls. With results recorded (Tool),
// every delivery builds the same messages, so the next turn is the same request and
// the ledger replays its answer.
func Turn(s *Step, calls []ToolCall, results []string) []llm.Message {
	content := ""
	if s != nil && s.Response != nil {
		content = s.Response.Content
	}
	assistant := llm.Message{Role: llm.RoleAssistant, Content: content}
	for _, c := range calls {
		assistant.ToolCalls = append(assistant.ToolCalls, c.ToolCall)
	}
	out := []llm.Message{assistant}
	for i, c := range calls {
		var r string
		if i < len(results) {
			r = results[i]
		}
		out = append(out, llm.Message{Role: llm.RoleTool, ToolCallID: c.ID, Content: r})
	}
	return out
}
