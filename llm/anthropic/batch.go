package anthropic

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"net/http"
	"net/url"
	"strings"
	"time"

	asdk "github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/anthropics/anthropic-sdk-go/v2/packages/param"

	"github.com/onceflow/onceflow/llm"
)

// maxResultLine bounds one line of a message batch's results.
const maxResultLine = 16 << 20

// listPageSize is how many batches List asks for a page (the API allows 1 to 1000).
const listPageSize = 100

// Batches is Anthropic's Message Batches API (/v1/messages/batches) as onceflow's
// batch lane uses it (onceflow.BatchAPI). A message batch keeps no metadata, so the
// batches it reports name no submission (llm.BatchInfo.Submission is ""): after a
// crash the lane recognises its batch by its size and creation time (docs/batch.md).
type Batches struct {
	c *Client
}

// Batches returns the Message Batches API of c's account and base URL.
func (c *Client) Batches() *Batches { return &Batches{c: c} }

// Submit creates a message batch of s's items: each a request {custom_id, params} whose
// params are exactly those Complete sends for the item's request. s.ID is not sent: a
// message batch keeps no metadata.
func (b *Batches) Submit(ctx context.Context, s llm.BatchSubmission) (llm.BatchInfo, error) {
	reqs := make([]asdk.MessageBatchNewParamsRequest, 0, len(s.Items))
	for _, it := range s.Items {
		p, err := b.c.params(it.Request)
		if err != nil {
			return llm.BatchInfo{}, fmt.Errorf("%s batch: %w", Provider, &llm.BatchItemError{CustomID: it.CustomID, Err: err})
		}
		// The batch's params type is not MessageNewParams: send the JSON of the one
		// Complete sends, so that both lanes send the same request.
		raw, err := json.Marshal(p)
		if err != nil {
			return llm.BatchInfo{}, fmt.Errorf("%s batch: %w", Provider, &llm.BatchItemError{CustomID: it.CustomID, Err: err})
		}
		reqs = append(reqs, asdk.MessageBatchNewParamsRequest{CustomID: it.CustomID,
			Params: param.Override[asdk.MessageBatchNewParamsRequestParams](json.RawMessage(raw))})
	}
	bt, err := b.c.sdk.Messages.Batches.New(ctx, asdk.MessageBatchNewParams{Requests: reqs})
	if err != nil {
		return llm.BatchInfo{}, fmt.Errorf("%s batch: create: %w", Provider, mapError(err, nil))
	}
	return batchInfo(bt), nil
}

// List returns the message batches created since then: the API lists them newest
// first, and List stops at the first one created before since.
func (b *Batches) List(ctx context.Context, since time.Time) ([]llm.BatchInfo, error) {
	var out []llm.BatchInfo
	pager := b.c.sdk.Messages.Batches.ListAutoPaging(ctx, asdk.MessageBatchListParams{Limit: asdk.Int(listPageSize)})
	for pager.Next() {
		bt := pager.Current()
		if bt.CreatedAt.Before(since) {
			break
		}
		out = append(out, batchInfo(&bt))
	}
	if err := pager.Err(); err != nil {
		return nil, fmt.Errorf("%s batch: list: %w", Provider, mapError(err, nil))
	}
	return out, nil
}

// Get says how message batch id stands.
func (b *Batches) Get(ctx context.Context, id string) (llm.BatchInfo, error) {
	bt, err := b.c.sdk.Messages.Batches.Get(ctx, id, asdk.MessageBatchGetParams{})
	if err != nil {
		return llm.BatchInfo{}, fmt.Errorf("%s batch %s: %w", Provider, id, mapError(err, nil))
	}
	return batchInfo(bt), nil
}

// Cancel asks the API to cancel message batch id: it is "canceling", then ends with
// the requests not done by then canceled. A batch that has ended cannot be canceled
// (an error).
func (b *Batches) Cancel(ctx context.Context, id string) error {
	if _, err := b.c.sdk.Messages.Batches.Cancel(ctx, id, asdk.MessageBatchCancelParams{}); err != nil {
		return fmt.Errorf("%s batch %s: cancel: %w", Provider, id, mapError(err, nil))
	}
	return nil
}

// batchInfo is what the lane reads of a message batch: ended when its
// processing_status is "ended", its items the sum of its request_counts.
func batchInfo(bt *asdk.MessageBatch) llm.BatchInfo {
	rc := bt.RequestCounts
	return llm.BatchInfo{ID: bt.ID, Status: string(bt.ProcessingStatus), CreatedAt: bt.CreatedAt,
		Ended: bt.ProcessingStatus == asdk.MessageBatchProcessingStatusEnded,
		Items: int(rc.Processing + rc.Succeeded + rc.Errored + rc.Canceled + rc.Expired)}
}

// Results yields the outcome of each request of ended message batch id, read from its
// results_url (the API documents that URL, not its path, as the place of the results)
// line by line, at most 16 MiB a line, and parsed by ParseBatchResult; the first line
// that does not parse ends it with an error. The API key is sent only to the origin of
// Config.BaseURL: a results_url elsewhere is read at its path under Config.BaseURL.
func (b *Batches) Results(ctx context.Context, id string) iter.Seq2[llm.BatchResult, error] {
	return func(yield func(llm.BatchResult, error) bool) {
		fail := func(err error) { yield(llm.BatchResult{}, fmt.Errorf("%s batch %s: results: %w", Provider, id, err)) }
		bt, err := b.c.sdk.Messages.Batches.Get(ctx, id, asdk.MessageBatchGetParams{})
		if err != nil {
			fail(mapError(err, nil))
			return
		}
		if bt.ResultsURL == "" {
			fail(fmt.Errorf("none yet: the batch is %s", bt.ProcessingStatus))
			return
		}
		target, err := b.c.resultsTarget(bt.ResultsURL)
		if err != nil {
			fail(err)
			return
		}
		// The SDK's ResultsStreaming assumes the path, and decodes each line into its
		// own types, within a line limit of its own, before the caller sees it: the body
		// is read here instead, through the same client (key, headers, error type).
		var resp *http.Response
		if err := b.c.sdk.Get(ctx, target, nil, &resp, option.WithHeader("Accept", "application/x-jsonl")); err != nil {
			fail(mapError(err, nil))
			return
		}
		defer resp.Body.Close()
		for r, err := range llm.BatchResultLines(resp.Body, maxResultLine, ParseBatchResult) {
			if err != nil {
				err = fmt.Errorf("%s batch %s: results: %w", Provider, id, err)
			}
			if !yield(r, err) || (err != nil && !errors.Is(err, llm.ErrBatchResult)) {
				return
			}
		}
	}
}

// resultsTarget is where the client reads a batch's results_url: the URL itself when
// it is on the origin (scheme and host) of the client's base URL, else its path and
// query, resolved under the base URL.
func (c *Client) resultsTarget(resultsURL string) (string, error) {
	u, err := url.Parse(resultsURL)
	if err != nil {
		return "", fmt.Errorf("results_url %.200q: %w", resultsURL, err)
	}
	if base, err := url.Parse(c.baseURL); err == nil && u.Scheme == base.Scheme && u.Host == base.Host {
		return u.String(), nil
	}
	ref := strings.TrimLeft(u.EscapedPath(), "/")
	if u.RawQuery != "" {
		ref += "?" + u.RawQuery
	}
	return ref, nil
}

// resultLine is one line of a message batch's results.
type resultLine struct {
	CustomID string `json:"custom_id"`
	Result   *struct {
		Type    string          `json:"type"`
		Message json.RawMessage `json:"message"`
		Error   *struct {
			Error struct {
				Type    string `json:"type"`
				Message string `json:"message"`
			} `json:"error"`
			RequestID string `json:"request_id"`
		} `json:"error"`
	} `json:"result"`
}

// ParseBatchResult reads one line of a message batch's results, {"custom_id",
// "result": {"type", ...}}: "succeeded" is llm.BatchSucceeded with its message decoded
// as Complete decodes an answer (DecodeMessage: content, tool calls, stop reason,
// usage), or llm.BatchErrored when the message does not decode; "errored",
// "canceled" and "expired" are llm.BatchErrored (Error holds the error's type and
// message), llm.BatchCanceled and llm.BatchExpired. A line that is not JSON, names no
// custom_id or has no result of one of those types is an error.
func ParseBatchResult(line []byte) (llm.BatchResult, error) {
	var l resultLine
	if err := json.Unmarshal(line, &l); err != nil {
		return llm.BatchResult{}, fmt.Errorf("a result line is not JSON: %w", err)
	}
	if l.CustomID == "" {
		return llm.BatchResult{}, errors.New("a result line has no custom_id")
	}
	if l.Result == nil {
		return llm.BatchResult{}, fmt.Errorf("result %s has no result", l.CustomID)
	}
	r := llm.BatchResult{CustomID: l.CustomID}
	switch l.Result.Type {
	case "succeeded":
		resp, err := DecodeMessage(l.Result.Message)
		if err != nil {
			r.Outcome, r.Error = llm.BatchErrored, "a malformed answer: "+err.Error()
			return r, nil
		}
		r.Outcome, r.Response = llm.BatchSucceeded, resp
	case "errored":
		r.Outcome, r.Error = llm.BatchErrored, "errored"
		if e := l.Result.Error; e != nil && (e.Error.Type != "" || e.Error.Message != "") {
			r.Error = fmt.Sprintf("%s: %.200s", e.Error.Type, e.Error.Message)
			if e.RequestID != "" {
				r.Error += " (request " + fmt.Sprintf("%.64s", e.RequestID) + ")"
			}
		}
	case "canceled":
		r.Outcome, r.Error = llm.BatchCanceled, "its batch was canceled before it was processed"
	case "expired":
		r.Outcome, r.Error = llm.BatchExpired, "its batch expired before it was processed"
	default:
		return llm.BatchResult{}, fmt.Errorf("result %s has the unknown type %.40q", l.CustomID, l.Result.Type)
	}
	return r, nil
}
