package ledger

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"strings"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// Client is an llm.Client that sends every call through the ledger: a call whose
// response is recorded is replayed and never made again; a call another attempt is
// making is waited for; a new call is recorded in_flight before it goes out and
// succeeded (in a commit of its own) when its answer arrives. It is safe for
// concurrent use.
//
// Each request names its work in IdempotencyKey (see Work): the row's key is
// Key(IdempotencyKey, req), and that key, derived from the work and the request, is
// what the provider receives as Idempotency-Key, so a provider (or onceflow gateway)
// honouring keys replays an ambiguous attempt instead of billing it again. A request
// without IdempotencyKey fails with ErrNoWork (permanent).
type Client struct {
	l        *Ledger
	next     llm.Client
	provider string
}

var _ llm.Client = (*Client)(nil)

// Wrap returns next going through the ledger. provider is a fixed name ("openai",
// "anthropic", "fake") that labels rows and metrics.
func (l *Ledger) Wrap(provider string, next llm.Client) *Client {
	l.InitMetrics(provider)
	return &Client{l: l, next: next, provider: provider}
}

func (c *Client) call(ctx context.Context, req *llm.Request) (Call, *llm.Request, error) {
	if req.IdempotencyKey == "" {
		return Call{}, nil, retry.Permanent(ErrNoWork)
	}
	key := Key(req.IdempotencyKey, req)
	out := *req
	out.IdempotencyKey = key
	call := Call{Key: key, Work: req.IdempotencyKey, RequestHash: RequestHash(req), Provider: c.provider, Model: req.Model,
		Tenant: llm.TenantFrom(ctx)}
	if c.l.cfg.KeepRequests {
		call.Request, _ = json.Marshal(req) // nil when it does not encode (a tool's Parameters that are not JSON)
	}
	return call, &out, nil
}

// Complete implements llm.Client through the ledger. A replayed response carries the
// recorded Raw bytes. Errors are Begin's (an *InFlightError after waiting for a live
// attempt, which package retry retries) or the provider's, unchanged, after the
// attempt was recorded as failed or ambiguous (IsAmbiguous). If the response cannot be
// recorded (PostgreSQL down), it is still returned, and the failure logged: a later
// retry may then call the model again, which costs money but no duplicate effect.
// Under HoldAnswers a new response is returned unrecorded, held for the caller to
// record (Held).
func (c *Client) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	call, out, err := c.call(ctx, req)
	if err != nil {
		return nil, err
	}
	att, rec, err := c.l.Begin(ctx, call)
	if err != nil {
		return nil, err
	}
	if rec != nil {
		llm.MarkReplayed(ctx)
		return rec.LLMResponse()
	}
	if err := ctx.Err(); err != nil { // nothing sent: a clear failure
		c.fail(ctx, att, err, false)
		return nil, err
	}
	resp, err := c.next.Complete(ctx, out)
	if err != nil {
		c.fail(ctx, att, err, IsAmbiguous(err))
		return nil, err
	}
	return c.succeed(ctx, att, resp)
}

func (c *Client) fail(ctx context.Context, att *Attempt, cause error, ambiguous bool) {
	if err := att.Fail(ctx, cause, ambiguous); err != nil {
		c.l.log.WarnContext(ctx, "ledger: could not record a failed model call; its lease will expire", "key", att.Key(), "err", err)
	}
}

func (c *Client) succeed(ctx context.Context, att *Attempt, resp *llm.Response) (*llm.Response, error) {
	res := ResultOf(resp)
	if h := heldFrom(ctx); h != nil {
		h.hold(att, res)
		return replayShape(att.Key(), res, resp)
	}
	rec, ours, err := att.Succeed(ctx, res)
	switch {
	case errors.Is(err, ErrKeyReused):
		return nil, err
	case err != nil:
		c.l.log.WarnContext(ctx, "ledger: could not record a model response; returning it unrecorded", "key", att.Key(), "err", err)
		return resp, nil
	case ours:
		return replayShape(att.Key(), res, resp)
	}
	return rec.LLMResponse()
}

// replayShape returns resp as a replay of its record res will: recorded with U+FFFD
// for each U+0000 (jsonb holds none), so that every delivery acts on the same answer.
func replayShape(key string, res Result, resp *llm.Response) (*llm.Response, error) {
	if bytes.Contains(res.Response, []byte(`\u0000`)) {
		return (&Record{Key: key, Response: JSONBSafe(res.Response), Raw: res.Raw}).LLMResponse()
	}
	return resp, nil
}

// SupersededError is what Client.Stream yields when another attempt recorded a
// response first (possible only after this attempt lost its lease): the text streamed
// so far is not the recorded answer. Retry: the repeat replays the recorded one.
type SupersededError struct{ Key string }

// Error names the key and says to retry.
func (e *SupersededError) Error() string {
	return fmt.Sprintf("ledger: another attempt recorded the response of %s first; retry to replay it", e.Key)
}

// HTTPStatus implements retry.HTTPStatuser: 409, retryable.
func (e *SupersededError) HTTPStatus() int { return 409 }

// Stream implements llm.Client through the ledger. A recorded call is replayed as one
// text chunk and the final chunk. A new call streams as it arrives, and its text is
// persisted on the row in batches (Config.StreamFlushBytes or StreamFlushInterval,
// whichever first, never one write per token); the row becomes succeeded only when
// the final chunk arrives, and is recorded before that chunk is yielded, so a consumer
// that commits its effects on Done commits only complete, recorded answers. A stream
// that fails is recorded like a failed Complete (a dropped connection is ambiguous),
// with its partial output kept on the row for the next attempt (see
// Attempt.PreviousPartial), which makes a new generation: streams cannot resume. A
// consumer that stops early abandons the attempt, recorded as ambiguous.
func (c *Client) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		call, out, err := c.call(ctx, req)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		att, rec, err := c.l.Begin(ctx, call)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if rec != nil {
			llm.MarkReplayed(ctx)
			replay(rec, yield)
			return
		}
		c.stream(ctx, att, out, yield)
	}
}

// replay yields a recorded response as a stream.
func replay(rec *Record, yield func(llm.Chunk, error) bool) {
	resp, err := rec.LLMResponse()
	if err != nil {
		yield(llm.Chunk{}, err)
		return
	}
	if resp.Content != "" && !yield(llm.Chunk{Content: resp.Content, ID: resp.ID, RequestID: resp.RequestID}, nil) {
		return
	}
	usage := resp.Usage
	yield(llm.Chunk{Done: true, ID: resp.ID, RequestID: resp.RequestID, FinishReason: resp.FinishReason,
		ToolCalls: resp.ToolCalls, Usage: &usage}, nil)
}

func (c *Client) stream(ctx context.Context, att *Attempt, req *llm.Request, yield func(llm.Chunk, error) bool) {
	buf := att.PartialBuffer()
	var content strings.Builder
	var raw []byte
	var id, requestID string
	persist := func() {
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.l.cfg.WriteTimeout)
		defer cancel()
		if err := buf.Flush(wctx); err != nil {
			c.l.log.WarnContext(ctx, "ledger: could not persist partial output", "key", att.Key(), "err", err)
		}
	}
	for ch, err := range c.next.Stream(ctx, req) {
		if err != nil {
			persist()
			c.fail(ctx, att, err, IsAmbiguous(err))
			yield(llm.Chunk{}, err)
			return
		}
		if ch.ID != "" {
			id = ch.ID
		}
		if ch.RequestID != "" {
			requestID = ch.RequestID
		}
		if ch.Raw != nil {
			raw = append(append(raw, ch.Raw...), '\n')
		}
		if !ch.Done {
			content.WriteString(ch.Content)
			if err := buf.Add(ctx, ch.Content); err != nil {
				c.l.log.WarnContext(ctx, "ledger: could not persist partial output", "key", att.Key(), "err", err)
			}
			if !yield(ch, nil) {
				persist()
				c.fail(ctx, att, errors.New("stream abandoned by its consumer"), true)
				return
			}
			continue
		}
		// The final chunk: the answer is complete. Record it, then hand it on.
		resp := &llm.Response{ID: id, Model: req.Model, Content: content.String() + ch.Content, ToolCalls: ch.ToolCalls,
			FinishReason: ch.FinishReason, RequestID: requestID, Raw: raw}
		if ch.Usage != nil {
			resp.Usage = *ch.Usage
		}
		if h := heldFrom(ctx); h != nil { // the caller records it (HoldAnswers)
			h.hold(att, ResultOf(resp))
			yield(ch, nil)
			return
		}
		rec, ours, err := att.Succeed(ctx, ResultOf(resp))
		switch {
		case errors.Is(err, ErrKeyReused):
			yield(llm.Chunk{}, err)
			return
		case err != nil:
			c.l.log.WarnContext(ctx, "ledger: could not record a streamed response; passing it on unrecorded", "key", att.Key(), "err", err)
		case !ours:
			yield(llm.Chunk{}, &SupersededError{Key: rec.Key})
			return
		}
		yield(ch, nil)
		return
	}
	// The provider's stream ended without a final chunk and without an error (adapters
	// report that as io.ErrUnexpectedEOF, so this is a defensive branch).
	persist()
	err := fmt.Errorf("ledger: stream of %s ended without a final chunk", att.Key())
	c.fail(ctx, att, err, true)
	yield(llm.Chunk{}, err)
}
