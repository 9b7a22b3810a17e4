package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"time"
)

// Message is one outbox row as a Sender sees it.
type Message struct {
	// ID is the row's id. Ids are assigned in insertion order but commit out of order,
	// so they say nothing about which rows are due.
	ID int64 `json:"id"`
	// Topic names the kind of effect, e.g. "email.summary_ready".
	Topic string `json:"topic"`
	// DedupeKey is unique per effect; senders pass it to the provider as the
	// idempotency key, so a repeated send has one effect.
	DedupeKey string `json:"dedupe_key"`
	// Payload is the effect's data as JSON.
	Payload json.RawMessage `json:"payload"`
	// Attempts counts the failed sends before this one.
	Attempts int `json:"attempts"`
	// Traceparent is the W3C trace context of the transaction that wrote the row, or
	// empty.
	Traceparent string `json:"traceparent,omitempty"`
	// CreatedAt is when the row was written.
	CreatedAt time.Time `json:"created_at"`
}

// Sender delivers one message to its provider.
//
// Send must pass m.DedupeKey to the provider as its idempotency key where the provider
// has one. It returns nil when the provider accepted the message, an error wrapped with
// Permanent when retrying cannot help, and any other error for a failure a later
// attempt may fix. It must return when ctx is done. A Relay calls Send concurrently for
// different messages, so implementations must be safe for concurrent use.
type Sender interface {
	Send(ctx context.Context, m Message) error
}

// SenderFunc adapts a function to the Sender interface.
type SenderFunc func(ctx context.Context, m Message) error

// Send calls f(ctx, m).
func (f SenderFunc) Send(ctx context.Context, m Message) error { return f(ctx, m) }

// ErrPermanent matches, with errors.Is, every error wrapped by Permanent.
var ErrPermanent = errors.New("permanent send failure")

// Permanent marks err as a failure that retrying cannot fix (an HTTP 400, an invalid
// recipient): the relay exhausts the row at once instead of retrying it. Permanent(nil)
// is nil. The result unwraps to err and matches ErrPermanent with errors.Is.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string        { return e.err.Error() }
func (e *permanentError) Unwrap() error        { return e.err }
func (e *permanentError) Is(target error) bool { return target == ErrPermanent }

// IsPermanent reports whether err, or an error it wraps, was marked with Permanent.
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

// RetryAfter returns err annotated with the delay the provider asked for (an HTTP
// Retry-After header): the relay schedules the next attempt after d instead of its own
// backoff. A non-positive d, or a nil err, returns err unchanged.
func RetryAfter(err error, d time.Duration) error {
	if err == nil || d <= 0 {
		return err
	}
	return &retryAfterError{err, d}
}

type retryAfterError struct {
	err error
	d   time.Duration
}

func (e *retryAfterError) Error() string             { return e.err.Error() }
func (e *retryAfterError) Unwrap() error             { return e.err }
func (e *retryAfterError) RetryAfter() time.Duration { return e.d }

// RetryAfterOf returns the delay carried by err or an error it wraps: any error with a
// method RetryAfter() time.Duration that returns a positive value.
func RetryAfterOf(err error) (time.Duration, bool) {
	var ra interface{ RetryAfter() time.Duration }
	if errors.As(err, &ra) {
		if d := ra.RetryAfter(); d > 0 {
			return d, true
		}
	}
	return 0, false
}
