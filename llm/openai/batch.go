package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"time"

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/shared"

	"github.com/onceflow/onceflow/llm"
)

// SubmissionKey is the metadata key of a batch onceflow's batch lane creates: its
// submission id, by which the lane finds the batch again after a crash.
const SubmissionKey = "onceflow_submission"

// maxResultLine bounds one line of a batch's output or error file.
const maxResultLine = 16 << 20

// Batches is the OpenAI Batch API (files with purpose "batch", /v1/batches) as
// onceflow's batch lane uses it (onceflow.BatchAPI): requests to /v1/chat/completions,
// a 24h completion window, the submission id in the batch's metadata.
type Batches struct {
	c *Client
}

// Batches returns the Batch API of c's account and base URL.
func (c *Client) Batches() *Batches { return &Batches{c: c} }

// batchLine is one line of a batch's input file.
type batchLine struct {
	CustomID string `json:"custom_id"`
	Method   string `json:"method"`
	URL      string `json:"url"`
	Body     any    `json:"body"`
}

// Submit uploads s's requests as a JSONL file and creates the batch.
func (b *Batches) Submit(ctx context.Context, s llm.BatchSubmission) (llm.BatchInfo, error) {
	var file bytes.Buffer
	enc := json.NewEncoder(&file)
	for _, it := range s.Items {
		p, err := b.c.params(it.Request)
		if err != nil {
			return llm.BatchInfo{}, fmt.Errorf("%s batch: %w", Provider, &llm.BatchItemError{CustomID: it.CustomID, Err: err})
		}
		if err := enc.Encode(batchLine{CustomID: it.CustomID, Method: "POST", URL: "/v1/chat/completions", Body: p}); err != nil {
			return llm.BatchInfo{}, fmt.Errorf("%s batch: %w", Provider, &llm.BatchItemError{CustomID: it.CustomID, Err: err})
		}
	}
	f, err := b.c.sdk.Files.New(ctx, oai.FileNewParams{File: oai.File(&file, "onceflow-"+s.ID+".jsonl", "application/jsonl"), Purpose: oai.FilePurposeBatch})
	if err != nil {
		return llm.BatchInfo{}, fmt.Errorf("%s batch: upload: %w", Provider, mapError(err, nil))
	}
	bt, err := b.c.sdk.Batches.New(ctx, oai.BatchNewParams{InputFileID: f.ID, Endpoint: oai.BatchNewParamsEndpointV1ChatCompletions,
		CompletionWindow: oai.BatchNewParamsCompletionWindow24h, Metadata: shared.Metadata{SubmissionKey: s.ID}})
	if err != nil {
		// The file is of no use without its batch: delete it, so that retries do not
		// leave an upload each at the provider (best effort; if the batch was created
		// after all, the provider has read its file already).
		if _, derr := b.c.sdk.Files.Delete(context.WithoutCancel(ctx), f.ID); derr != nil {
			err = errors.Join(err, fmt.Errorf("delete the uploaded file %s: %w", f.ID, derr))
		}
		return llm.BatchInfo{}, fmt.Errorf("%s batch: create: %w", Provider, mapError(err, nil))
	}
	return batchInfo(bt), nil
}

// List returns the batches created since then (newest first, as the API lists them).
func (b *Batches) List(ctx context.Context, since time.Time) ([]llm.BatchInfo, error) {
	var out []llm.BatchInfo
	pager := b.c.sdk.Batches.ListAutoPaging(ctx, oai.BatchListParams{Limit: oai.Int(100)})
	for pager.Next() {
		bt := pager.Current()
		if time.Unix(bt.CreatedAt, 0).Before(since.Truncate(time.Second)) {
			break
		}
		out = append(out, batchInfo(&bt))
	}
	if err := pager.Err(); err != nil {
		return nil, fmt.Errorf("%s batch: list: %w", Provider, mapError(err, nil))
	}
	return out, nil
}

// Get says how batch id stands.
func (b *Batches) Get(ctx context.Context, id string) (llm.BatchInfo, error) {
	bt, err := b.c.sdk.Batches.Get(ctx, id)
	if err != nil {
		return llm.BatchInfo{}, fmt.Errorf("%s batch %s: %w", Provider, id, mapError(err, nil))
	}
	return batchInfo(bt), nil
}

// Cancel asks the provider to cancel batch id: the items not done by then end
// cancelled.
func (b *Batches) Cancel(ctx context.Context, id string) error {
	if _, err := b.c.sdk.Batches.Cancel(ctx, id); err != nil {
		return fmt.Errorf("%s batch %s: cancel: %w", Provider, id, mapError(err, nil))
	}
	return nil
}

func batchInfo(bt *oai.Batch) llm.BatchInfo {
	st := bt.Status
	return llm.BatchInfo{ID: bt.ID, Submission: bt.Metadata[SubmissionKey], Status: string(st), Items: int(bt.RequestCounts.Total),
		CreatedAt: time.Unix(bt.CreatedAt, 0),
		Ended:     st == oai.BatchStatusCompleted || st == oai.BatchStatusFailed || st == oai.BatchStatusExpired || st == oai.BatchStatusCancelled}
}

// resultLine is one line of a batch's output or error file.
type resultLine struct {
	CustomID string `json:"custom_id"`
	Response *struct {
		StatusCode int             `json:"status_code"`
		Body       json.RawMessage `json:"body"`
	} `json:"response"`
	Error *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// Results yields the outcome of each item of ended batch id: its output file's answers
// and its error file's failures (an expired item is llm.BatchExpired). A line it cannot
// read yields an error matching llm.ErrBatchResult, and the results go on.
func (b *Batches) Results(ctx context.Context, id string) iter.Seq2[llm.BatchResult, error] {
	return func(yield func(llm.BatchResult, error) bool) {
		bt, err := b.c.sdk.Batches.Get(ctx, id)
		if err != nil {
			yield(llm.BatchResult{}, fmt.Errorf("%s batch %s: %w", Provider, id, mapError(err, nil)))
			return
		}
		for _, file := range []string{bt.OutputFileID, bt.ErrorFileID} {
			if file == "" {
				continue
			}
			for r, err := range b.file(ctx, file) {
				if !yield(r, err) || (err != nil && !errors.Is(err, llm.ErrBatchResult)) {
					return
				}
			}
		}
	}
}

// file yields the results in output or error file id (llm.BatchResultLines: a line it
// cannot read is an error matching llm.ErrBatchResult, and the lines go on).
func (b *Batches) file(ctx context.Context, id string) iter.Seq2[llm.BatchResult, error] {
	return func(yield func(llm.BatchResult, error) bool) {
		resp, err := b.c.sdk.Files.Content(ctx, id)
		if err != nil {
			yield(llm.BatchResult{}, fmt.Errorf("%s batch file %s: %w", Provider, id, mapError(err, nil)))
			return
		}
		defer resp.Body.Close()
		for r, err := range llm.BatchResultLines(resp.Body, maxResultLine, ParseBatchResult) {
			if err != nil {
				err = fmt.Errorf("%s batch file %s: %w", Provider, id, err)
			}
			if !yield(r, err) || (err != nil && !errors.Is(err, llm.ErrBatchResult)) {
				return
			}
		}
	}
}

// ParseBatchResult reads one line of a batch's output or error file: an answer (status
// 200 and a chat.completion body, decoded strictly) is llm.BatchSucceeded; an error (a
// "batch_expired" code is llm.BatchExpired) or another status is llm.BatchErrored. A line
// that is none of these is an error.
func ParseBatchResult(line []byte) (llm.BatchResult, error) {
	var l resultLine
	if err := json.Unmarshal(line, &l); err != nil {
		return llm.BatchResult{}, fmt.Errorf("a result line is not JSON: %w", err)
	}
	if l.CustomID == "" {
		return llm.BatchResult{}, errors.New("a result line has no custom_id")
	}
	r := llm.BatchResult{CustomID: l.CustomID}
	switch {
	case l.Error != nil:
		r.Outcome, r.Error = llm.BatchErrored, l.Error.Code+": "+l.Error.Message
		if l.Error.Code == "batch_expired" {
			r.Outcome = llm.BatchExpired
		}
	case l.Response == nil:
		return llm.BatchResult{}, fmt.Errorf("result %s has neither a response nor an error", l.CustomID)
	case l.Response.StatusCode != 200:
		r.Outcome, r.Error = llm.BatchErrored, fmt.Sprintf("status %d: %.200s", l.Response.StatusCode, l.Response.Body)
	default:
		resp, err := DecodeCompletion(l.Response.Body)
		if err != nil {
			r.Outcome, r.Error = llm.BatchErrored, "a malformed answer: "+err.Error()
			return r, nil
		}
		r.Outcome, r.Response = llm.BatchSucceeded, resp
	}
	return r, nil
}
