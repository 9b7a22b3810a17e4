package retry

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"
)

// Class names why an error is, or is not, worth retrying. Its values are a small fixed
// set (Classes), so it is safe as a metrics label.
type Class string

// The classes Classify returns.
const (
	// ClassTimeout: one attempt ran out of time (the per-call timeout, a net timeout,
	// a TLS handshake timeout) or the server answered 408. Retryable.
	ClassTimeout Class = "timeout"
	// ClassConnection: the connection or the protocol failed (reset, refused, DNS,
	// unexpected EOF, an HTTP/2 RST_STREAM or GOAWAY, a lost connection). Retryable.
	ClassConnection Class = "connection"
	// ClassRateLimited: HTTP 429 without a quota verdict. Retryable.
	ClassRateLimited Class = "rate_limited"
	// ClassConflict: HTTP 409 (for example an idempotent request still in progress).
	// Retryable.
	ClassConflict Class = "conflict"
	// ClassServerError: HTTP 5xx (529 overloaded included), or a provider error type
	// that names a server-side failure. Retryable.
	ClassServerError Class = "server_error"
	// ClassQuota: a 4xx whose provider error type or code says a quota, spend limit or
	// billing limit is exhausted (insufficient_quota and similar). Not retried
	// in-process (it will not clear within seconds, and usually needs a person), but
	// Transient: an exhausted quota is the provider account's state, not the job's, so
	// a job that meets it waits for the quota to come back instead of being
	// dead-lettered (see the breaker package, which stops calls meanwhile).
	ClassQuota Class = "quota"
	// ClassClientError: any other 4xx. Permanent.
	ClassClientError Class = "client_error"
	// ClassDeadline: the delivery's Deadline ran out (*DeadlineExceededError). Never
	// retried in-process; Transient reports it so the queue redelivers.
	ClassDeadline Class = "deadline"
	// ClassCanceled: the caller's context was cancelled (shutdown). Not retried.
	ClassCanceled Class = "canceled"
	// ClassPermanent: the error was marked with Permanent. Not retried.
	ClassPermanent Class = "permanent"
	// ClassUnavailable: a dependency is known to be down, so the call was not made
	// (errors matching ErrUnavailable, such as an open circuit breaker's). Not retried
	// in-process; Transient.
	ClassUnavailable Class = "unavailable"
	// ClassWaiting: the call was not made because a limiter has no capacity for it now
	// (errors matching ErrWaiting, a *WaitError). Not retried in-process (the caller
	// waits elsewhere, holding nothing); Transient, and not an Outage.
	ClassWaiting Class = "waiting"
	// ClassUnknown: nothing above. Permanent: unknown means bug until proven otherwise.
	ClassUnknown Class = "unknown"
)

// Classes returns every Class, for initialising metrics label values.
func Classes() []Class {
	return []Class{ClassTimeout, ClassConnection, ClassRateLimited, ClassConflict, ClassServerError,
		ClassQuota, ClassClientError, ClassDeadline, ClassCanceled, ClassPermanent, ClassUnavailable, ClassWaiting, ClassUnknown}
}

// Verdict is what Classify decides about one error.
type Verdict struct {
	// Retryable reports whether another attempt in this process may succeed.
	Retryable bool
	// Class is the bounded reason, usable as a metrics label.
	Class Class
	// Reason is a short human explanation ("HTTP 429, code insufficient_quota").
	Reason string
	// RetryAfter is the server's requested wait, valid when HasRetryAfter.
	RetryAfter time.Duration
	// HasRetryAfter reports whether the error carried a Retry-After hint.
	HasRetryAfter bool
}

// HTTPStatuser is implemented by errors that carry an HTTP response status code.
type HTTPStatuser interface {
	HTTPStatus() int
}

// RetryAfterer is implemented by errors that carry a server's Retry-After hint; ok is
// false when the response had none.
type RetryAfterer interface {
	RetryAfter() (d time.Duration, ok bool)
}

// ShouldRetrier is implemented by errors whose response carried an explicit retry
// verdict (OpenAI's and Anthropic's x-should-retry header); ok is false when absent.
type ShouldRetrier interface {
	ShouldRetry() (retry bool, ok bool)
}

// ProviderCoder is implemented by errors that carry a provider's error type and code
// (OpenAI's error.type and error.code, Anthropic's error.type and
// error.details.error_code); either may be empty.
type ProviderCoder interface {
	ProviderCode() (errType, code string)
}

// quotaMarkers are provider error types and codes that mean a quota, spend or billing
// limit is exhausted: waiting seconds will not help. Matching is exact.
var quotaMarkers = map[string]bool{
	"insufficient_quota":                      true, // OpenAI 429
	"billing_hard_limit_reached":              true, // OpenAI
	"billing_not_active":                      true, // OpenAI
	"access_terminated":                       true, // OpenAI
	"quota_exceeded":                          true,
	"billing_error":                           true, // Anthropic type
	"contract_spend_limit_reached":            true, // Anthropic 429
	"enforced_spend_limit_reached":            true, // Anthropic 429
	"linked_organization_spend_limit_reached": true, // Anthropic 402
	"credit_balance_too_low":                  true, // Anthropic 400, code set by llm/anthropic
}

// IsQuota reports whether a provider error type or code says a quota, spend or billing
// limit is exhausted: one of the known markers (insufficient_quota,
// billing_hard_limit_reached, contract_spend_limit_reached, ...) or any value
// containing "quota" or "spend_limit".
func IsQuota(errType, code string) bool {
	for _, v := range []string{errType, code} {
		v = strings.ToLower(v)
		if v != "" && (quotaMarkers[v] || strings.Contains(v, "quota") || strings.Contains(v, "spend_limit")) {
			return true
		}
	}
	return false
}

// transientProviderTypes are provider error types that name a server-side, passing
// failure. They matter when an error arrives without a meaningful HTTP status, such as
// an error event in the middle of a stream that started with 200.
var transientProviderTypes = map[string]Class{
	"server_error":     ClassServerError,
	"api_error":        ClassServerError,
	"overloaded_error": ClassServerError,
	"timeout_error":    ClassTimeout,
	"rate_limit_error": ClassRateLimited,
}

// ClassifyStatus classifies an HTTP response status on its own: 408 timeout, 409
// conflict, 429 rate_limited and every 5xx server_error are retryable; any other 4xx
// is a permanent client_error. Statuses below 400 are not errors and return a
// permanent ClassUnknown verdict. The outbox's webhook sender uses it as is.
func ClassifyStatus(status int) Verdict {
	reason := fmt.Sprintf("HTTP %d", status)
	switch {
	case status == http.StatusRequestTimeout:
		return Verdict{Retryable: true, Class: ClassTimeout, Reason: reason}
	case status == http.StatusConflict:
		return Verdict{Retryable: true, Class: ClassConflict, Reason: reason}
	case status == http.StatusTooManyRequests:
		return Verdict{Retryable: true, Class: ClassRateLimited, Reason: reason}
	case status >= 500 && status <= 599:
		return Verdict{Retryable: true, Class: ClassServerError, Reason: reason}
	case status >= 400 && status <= 499:
		return Verdict{Class: ClassClientError, Reason: reason}
	}
	return Verdict{Class: ClassUnknown, Reason: reason + " is not an error status"}
}

// Classify decides whether err is worth another attempt, in this order:
//
//  1. *DeadlineExceededError: deadline, never retried in-process;
//  2. context.Canceled: canceled;
//  3. Permanent(err): permanent; an error matching ErrUnavailable: unavailable; an
//     error matching ErrWaiting (a *WaitError): waiting;
//  4. an x-should-retry verdict (ShouldRetrier), when present, wins over what follows,
//     keeping the class the status gives;
//  5. an HTTP status (HTTPStatuser) of 400 or more: ClassifyStatus, except that a 4xx
//     whose provider type or code names an exhausted quota (IsQuota) is a permanent
//     quota error;
//  6. a provider error type without an error status (an error event inside a stream):
//     server_error, api_error, overloaded_error, timeout_error and rate_limit_error
//     are retryable;
//  7. the per-attempt timeout (*AttemptTimeoutError, and a bare
//     context.DeadlineExceeded, which inside Do can only come from it), net.Error
//     timeouts and TLS handshake timeouts: timeout;
//  8. connection reset, refused, aborted, broken pipe, unreachable network or host,
//     io.ErrUnexpectedEOF; HTTP/2 stream resets (RST_STREAM, any code), GOAWAY,
//     "http2: client connection lost" and other HTTP/2 connection errors; HTTP/1
//     "transport connection broken" and "server closed idle connection"; TLS alerts
//     after the handshake; *net.DNSError, any other *net.OpError, and io.EOF from an
//     HTTP exchange (*url.Error): connection (see NotProcessed for which of them say
//     the request was not processed);
//  9. anything else: unknown, permanent.
//
// Retry-After travels with the verdict whenever err carries one (RetryAfterer). A nil
// err returns the zero Verdict. Classify is safe for concurrent use.
func Classify(err error) Verdict {
	if err == nil {
		return Verdict{}
	}
	v := classify(err)
	var ra RetryAfterer
	if errors.As(err, &ra) && v.Class != ClassDeadline && v.Class != ClassCanceled {
		v.RetryAfter, v.HasRetryAfter = ra.RetryAfter()
		if v.RetryAfter < 0 {
			v.RetryAfter, v.HasRetryAfter = 0, false
		}
	}
	return v
}

func classify(err error) Verdict {
	var dl *DeadlineExceededError
	if errors.As(err, &dl) {
		return Verdict{Class: ClassDeadline, Reason: "delivery deadline exceeded"}
	}
	if errors.Is(err, context.Canceled) {
		return Verdict{Class: ClassCanceled, Reason: "context canceled"}
	}
	if errors.Is(err, ErrPermanent) {
		return Verdict{Class: ClassPermanent, Reason: "marked permanent"}
	}
	if errors.Is(err, ErrUnavailable) {
		return Verdict{Class: ClassUnavailable, Reason: "dependency unavailable"}
	}
	if errors.Is(err, ErrWaiting) {
		return Verdict{Class: ClassWaiting, Reason: "waiting for capacity"}
	}

	status := 0
	var hs HTTPStatuser
	if errors.As(err, &hs) {
		status = hs.HTTPStatus()
	}
	var errType, code string
	var pc ProviderCoder
	if errors.As(err, &pc) {
		errType, code = pc.ProviderCode()
	}

	var v Verdict
	switch {
	case status >= 400:
		v = ClassifyStatus(status)
		if status < 500 && IsQuota(errType, code) {
			v = Verdict{Class: ClassQuota, Reason: fmt.Sprintf("HTTP %d, quota exhausted (%s)", status, joinNonEmpty(errType, code))}
		} else if errType != "" || code != "" {
			v.Reason += " (" + joinNonEmpty(errType, code) + ")"
		}
	case errType != "" || code != "":
		if IsQuota(errType, code) {
			v = Verdict{Class: ClassQuota, Reason: "quota exhausted (" + joinNonEmpty(errType, code) + ")"}
		} else if c, ok := transientProviderTypes[strings.ToLower(errType)]; ok {
			v = Verdict{Retryable: true, Class: c, Reason: "provider error " + joinNonEmpty(errType, code)}
		} else {
			v = Verdict{Class: ClassUnknown, Reason: "provider error " + joinNonEmpty(errType, code)}
		}
	default:
		v = classifyTransport(err)
	}

	var sr ShouldRetrier
	if errors.As(err, &sr) {
		if retry, ok := sr.ShouldRetry(); ok {
			v.Retryable = retry
			v.Reason += fmt.Sprintf("; x-should-retry: %t", retry)
		}
	}
	return v
}

// classifyTransport classifies errors that carry no HTTP status: timeouts, connection
// failures and HTTP/1 and HTTP/2 protocol failures (stream resets, GOAWAY, lost and
// broken connections: recogniseTransport), all retryable. What it does not recognise
// stays unknown, and permanent: a decode error in our own code is a bug to fix, not a
// reason to call the model again.
func classifyTransport(err error) Verdict {
	var at *AttemptTimeoutError
	if errors.As(err, &at) || errors.Is(err, context.DeadlineExceeded) {
		return Verdict{Retryable: true, Class: ClassTimeout, Reason: "attempt timed out"}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return Verdict{Retryable: true, Class: ClassTimeout, Reason: "network timeout"}
	}
	var rh tls.RecordHeaderError
	switch {
	case errors.Is(err, syscall.ECONNRESET):
		return connection("connection reset")
	case errors.Is(err, syscall.ECONNREFUSED):
		return connection("connection refused")
	case errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.EPIPE):
		return connection("connection aborted")
	case errors.Is(err, syscall.ENETUNREACH), errors.Is(err, syscall.EHOSTUNREACH):
		return connection("network unreachable")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return connection("unexpected EOF")
	case errors.As(err, &rh):
		return Verdict{Class: ClassUnknown, Reason: "TLS record header error (not a TLS server?)"}
	}
	if f, ok := recogniseTransport(err); ok {
		return connection(f.reason)
	}
	var op *net.OpError
	if errors.As(err, &op) && (op.Op == "remote error" || op.Op == "local error") && op.Err != nil {
		// crypto/tls reports an alert received from the peer, or one it sent, this way.
		return connection("TLS alert (" + op.Op + "): " + op.Err.Error())
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return connection("DNS failure")
	}
	if errors.As(err, &op) {
		return connection("network error")
	}
	var ue *url.Error
	if errors.As(err, &ue) && errors.Is(err, io.EOF) {
		return connection("connection closed (EOF)")
	}
	if errors.Is(err, net.ErrClosed) {
		return connection("connection closed")
	}
	return Verdict{Class: ClassUnknown, Reason: "unknown error"}
}

func connection(reason string) Verdict {
	return Verdict{Retryable: true, Class: ClassConnection, Reason: reason}
}

func joinNonEmpty(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "" || a == b:
		return a
	}
	return a + "/" + b
}

// Retryable reports whether Classify(err) says another in-process attempt may succeed.
func Retryable(err error) bool { return Classify(err).Retryable }

// Transient reports whether a later delivery may succeed where this one failed: a
// retryable error (including one that outlived MaxAttempts), the delivery deadline,
// cancellation (shutdown), an exhausted quota, an unavailable dependency, or an explicit
// request to run again later (RetryAfter), unless it is marked Permanent. A job
// handler leaves such a message for redelivery and dead-letters everything else. A nil
// err is not transient.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	var de *DelayError
	switch v := Classify(err); {
	case v.Class == ClassPermanent:
		return false
	case v.Retryable, errors.As(err, &de): // an explicit "run again after D" is transient
		return true
	case v.Class == ClassDeadline, v.Class == ClassCanceled, v.Class == ClassQuota, v.Class == ClassUnavailable, v.Class == ClassWaiting:
		return true
	}
	return false
}

// Outage reports whether err says that a dependency as a whole is unusable for now,
// rather than that this call or this job failed: an exhausted quota (ClassQuota) or an
// unavailable dependency (ClassUnavailable). A job that fails with an outage error has
// not failed on its own account; a queue handler reports it as such (queue.Unavailable)
// so that the delivery spends none of the job's budget.
func Outage(err error) bool {
	c := Classify(err).Class
	return err != nil && (c == ClassQuota || c == ClassUnavailable)
}
