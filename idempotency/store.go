package idempotency

import (
	"context"
	"errors"
	"net/http"
	"time"
)

// Errors a Store returns and the middleware maps to statuses (see WriteError).
var (
	// ErrKeyReused: the key was used before with a different fingerprint (422).
	ErrKeyReused = errors.New("idempotency key reused with a different request")
	// ErrInProgress: another request with the same key and fingerprint holds the key and
	// has not finished (409 with Retry-After).
	ErrInProgress = errors.New("request with this idempotency key in progress")
	// ErrLockLost: Complete or Release found that the key no longer holds the caller's
	// in-progress marker, because the lock TTL ran out while the handler was running
	// (and possibly another request took the key since). Nothing was written.
	ErrLockLost = errors.New("idempotency lock lost")
	// ErrBodyTooLarge: the request body is over the configured limit (413).
	ErrBodyTooLarge = errors.New("request body too large")
	// ErrBodyTimeout: the request body did not arrive before the server's read deadline
	// (http.Server.ReadTimeout, or one set with http.ResponseController) (408).
	ErrBodyTimeout = errors.New("request body not received in time")
)

// Response is a stored response: what a replay sends back.
type Response struct {
	// Status is the HTTP status code.
	Status int
	// Header holds the stored headers (an allow-list; see Config.StoredHeaders).
	Header http.Header
	// Body is the response body; empty when Truncated.
	Body []byte
	// Truncated reports that the original body was over the stored-response limit and
	// was not stored: a replay sends the status and headers with an empty body.
	Truncated bool
}

// Lock is held by the request that claimed a key: its scope, fingerprint and the random
// token that makes its in-progress marker unique. Complete and Release act only while
// the key still holds exactly this marker.
type Lock struct {
	Scope       Scope
	Fingerprint string
	Token       string
}

// Store keeps idempotency records. Implementations must be safe for concurrent use and
// make Claim atomic: of any number of concurrent Claims of one scope, at most one
// returns a Lock. Every error other than ErrKeyReused, ErrInProgress and ErrLockLost
// means the store could not answer (the middleware answers 503). redisstore.Store is the
// Redis implementation; storetest.Run is the conformance suite every implementation
// passes.
type Store interface {
	// Claim takes the key of scope for the caller, or reports why not. Exactly one of its
	// results is set: a Lock when the key was free (an in-progress marker now holds it
	// for lockTTL), a stored Response when a finished request with the same fingerprint
	// holds it (replay), or an error: ErrKeyReused when the holder's fingerprint
	// differs, ErrInProgress when a request with the same fingerprint is in progress.
	Claim(ctx context.Context, scope Scope, fingerprint string, lockTTL time.Duration) (*Lock, *Response, error)
	// Complete replaces the caller's in-progress marker with resp, kept for resultTTL.
	// It returns ErrLockLost, writing nothing, when the marker is no longer there. It
	// must not retain resp (or its Body, which the caller reuses) after returning.
	Complete(ctx context.Context, lock *Lock, resp *Response, resultTTL time.Duration) error
	// Release deletes the caller's in-progress marker so that a retry runs the handler
	// again. It returns ErrLockLost, deleting nothing, when the marker is no longer there.
	Release(ctx context.Context, lock *Lock) error
}

// DefaultStoredHeaders are the response headers a stored response keeps: what describes
// the representation and where the created resource lives. Per-request headers
// (Set-Cookie, Date, tracing) are never replayed.
var DefaultStoredHeaders = []string{
	"Content-Type", "Content-Language", "Content-Location", "Location",
	"ETag", "Last-Modified", "Link", "Cache-Control",
}
