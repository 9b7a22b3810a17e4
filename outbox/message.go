package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/onceflow/onceflow/retry"
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
	// Attempts counts the failed sends before this one, not counting those that failed
	// with an error marked Unavailable.
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
// Permanent when retrying cannot help, an error wrapped with Unavailable when the
// provider (or a dependency of the send) is down, and any other error for a failure a
// later attempt may fix. It must return when ctx is done. A Relay calls Send concurrently for
// different messages, so implementations must be safe for concurrent use.
type Sender interface {
	Send(ctx context.Context, m Message) error
}

// SenderFunc adapts a function to the Sender interface.
type SenderFunc func(ctx context.Context, m Message) error

// Send calls f(ctx, m).
func (f SenderFunc) Send(ctx context.Context, m Message) error { return f(ctx, m) }

// ErrPermanent is retry.ErrPermanent, the one permanent marker of onceflow: a send
// whose error matches it (retry.Permanent, onceflow.Permanent) exhausts its row at once
// instead of retrying it.
//
// Deprecated: use retry.ErrPermanent; this alias goes in a later release.
var ErrPermanent = retry.ErrPermanent

// Permanent marks err as a failure that retrying cannot fix: it is retry.Permanent.
//
// Deprecated: use retry.Permanent; this forwarder goes in a later release.
func Permanent(err error) error { return retry.Permanent(err) }

// IsPermanent reports whether err was marked permanent: it is retry.IsPermanent.
//
// Deprecated: use retry.IsPermanent; this forwarder goes in a later release.
func IsPermanent(err error) bool { return retry.IsPermanent(err) }

// ErrUnavailable matches, with errors.Is, every error marked Unavailable: a send that
// failed because a dependency is down (the provider unreachable, Redis for the enqueue
// of a committed job), not because of the row. It is retry.ErrUnavailable, the one
// outage marker of onceflow, which queue.Unavailable marks too.
var ErrUnavailable = retry.ErrUnavailable

// Unavailable marks err as a dependency's outage: the relay tries the row again after
// a backoff that grows with the outage, without counting the attempt, and never
// exhausts it for this failure. The result unwraps to err and matches ErrUnavailable
// with errors.Is; it is retry.Unavailable. Unavailable(nil) is nil. Return it only for
// failures that say the dependency is down (a refused connection): a row whose sends
// fail with it waits for as long as they do.
func Unavailable(err error) error { return retry.Unavailable(err) }

// RetryAfter returns err annotated with the delay the provider asked for (an HTTP
// Retry-After header): the relay schedules the next attempt after d instead of its own
// backoff. It is retry.RetryAfter with the arguments in this package's order. A
// non-positive d, or a nil err, returns err unchanged.
func RetryAfter(err error, d time.Duration) error {
	if err == nil || d <= 0 {
		return err
	}
	return retry.RetryAfter(d, err)
}

// RetryAfterOf returns the delay carried by err or an error it wraps: any
// retry.RetryAfterer (retry.RetryAfter's *retry.DelayError, a provider's *llm.APIError, a
// webhook's *webhook.StatusError) that reports a positive delay.
func RetryAfterOf(err error) (time.Duration, bool) {
	var ra retry.RetryAfterer
	if errors.As(err, &ra) {
		if d, ok := ra.RetryAfter(); ok && d > 0 {
			return d, true
		}
	}
	return 0, false
}
