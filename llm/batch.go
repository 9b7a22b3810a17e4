package llm

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"iter"
	"time"
)

// BatchItem is one request of a batch, named by its CustomID (unique within the batch:
// onceflow's batch lane uses the 64 hex digits of the call's ledger key).
type BatchItem struct {
	CustomID string
	Request  *Request
}

// BatchSubmission is a batch to create: its items, all of one model, and the id of the
// submission record that names it (sent as the batch's metadata where the provider
// keeps metadata, so the batch can be found again after a crash).
type BatchSubmission struct {
	ID    string
	Model string
	Items []BatchItem
}

// BatchInfo is what a provider says of a batch.
type BatchInfo struct {
	// ID is the provider's batch id.
	ID string
	// Submission is the submission id the batch was created with ("" when the provider
	// keeps no metadata).
	Submission string
	// Status is the provider's word for it ("in_progress", "completed", "ended").
	Status string
	// Ended says whether its results are final: completed, failed, expired, cancelled.
	Ended bool
	// Items counts its requests.
	Items int
	// CreatedAt is when the provider created it.
	CreatedAt time.Time
}

// Batch result outcomes (BatchResult.Outcome), in Anthropic's vocabulary.
const (
	BatchSucceeded = "succeeded"
	BatchErrored   = "errored"
	BatchExpired   = "expired"
	BatchCanceled  = "canceled"
)

// BatchResult is the outcome of one item of an ended batch.
type BatchResult struct {
	CustomID string
	// Outcome is BatchSucceeded (Response is set), BatchErrored, BatchExpired or
	// BatchCanceled (Error says what happened).
	Outcome  string
	Response *Response
	Error    string
}

// ErrBatchResult is matched by the error a batch's Results yields for a result it
// cannot read (not JSON, an unknown outcome, a line over the limit): the results go on
// after it, and the item it was for ends without an answer (the batch lane makes it in
// the synchronous lane). Any other error of Results (a download failing) ends them.
var ErrBatchResult = errors.New("llm: an unreadable batch result")

// BatchItemError is Submit's error for an item the adapter cannot send (a request it
// cannot encode), returned before anything reached the provider: the batch lane fails
// that item alone and submits the others.
type BatchItemError struct {
	CustomID string
	Err      error
}

func (e *BatchItemError) Error() string { return "batch item " + e.CustomID + ": " + e.Err.Error() }

// Unwrap returns the item's error.
func (e *BatchItemError) Unwrap() error { return e.Err }

// BatchResultLines yields the results of a batch's JSON Lines body r, each line read by
// parse: an empty line is skipped; a line parse refuses, or one longer than max bytes
// (skipped to its end), yields an error matching ErrBatchResult and the lines go on; an
// error reading r yields that error and ends them.
func BatchResultLines(r io.Reader, max int, parse func([]byte) (BatchResult, error)) iter.Seq2[BatchResult, error] {
	return func(yield func(BatchResult, error) bool) {
		br := bufio.NewReaderSize(r, 64<<10)
		var line []byte
		for n := 1; ; n++ {
			line = line[:0]
			long := false
			var err error
			for {
				var chunk []byte
				chunk, err = br.ReadSlice('\n')
				if !long {
					if len(line)+len(chunk) > max {
						long, line = true, line[:0]
					} else {
						line = append(line, chunk...)
					}
				}
				if !errors.Is(err, bufio.ErrBufferFull) {
					break
				}
			}
			if err != nil && !errors.Is(err, io.EOF) {
				yield(BatchResult{}, fmt.Errorf("batch results, line %d: %w", n, err))
				return
			}
			switch {
			case long:
				if !yield(BatchResult{}, fmt.Errorf("%w: line %d is longer than %d bytes", ErrBatchResult, n, max)) {
					return
				}
			case len(bytes.TrimSpace(line)) > 0:
				res, perr := parse(line)
				if perr != nil {
					perr = fmt.Errorf("%w: line %d: %w", ErrBatchResult, n, perr)
				}
				if !yield(res, perr) {
					return
				}
			}
			if err != nil { // io.EOF
				return
			}
		}
	}
}
