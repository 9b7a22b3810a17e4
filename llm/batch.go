package llm

import "time"

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
