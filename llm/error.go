package llm

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/onceflow/onceflow/retry"
)

// ErrMalformedResponse is matched by the error an adapter returns when a provider's
// answer cannot be parsed (not JSON, no choices, a stream event that is not an
// event). Such errors are permanent: the same request would get the same answer.
var ErrMalformedResponse = errors.New("malformed provider response")

// Malformed returns the permanent error for an unparseable answer from provider:
// it matches ErrMalformedResponse and retry.IsPermanent, and wraps cause.
func Malformed(provider, requestID string, cause error) error {
	msg := provider + ": " + ErrMalformedResponse.Error()
	if requestID != "" {
		msg += " (request " + requestID + ")"
	}
	return retry.Permanent(&malformedError{msg: msg, cause: cause})
}

type malformedError struct {
	msg   string
	cause error
}

func (e *malformedError) Error() string {
	if e.cause == nil {
		return e.msg
	}
	return e.msg + ": " + e.cause.Error()
}
func (e *malformedError) Unwrap() []error { return []error{ErrMalformedResponse, e.cause} }

// MaxErrorBody bounds APIError.Body: a provider's error body is kept up to this size.
const MaxErrorBody = 64 << 10

// APIError is a provider's error answer: an HTTP status of 400 or more, or an error
// event inside a stream. It implements retry.HTTPStatuser, retry.RetryAfterer,
// retry.ShouldRetrier and retry.ProviderCoder, so retry.Classify reads it without
// knowing providers, and it unwraps to the SDK's own error. Its Error text never
// includes headers or credentials.
type APIError struct {
	// Provider is "openai", "anthropic" or another adapter's name.
	Provider string
	// StatusCode is the HTTP status; for an error event inside a stream, the stream's
	// own status (usually 200).
	StatusCode int
	// Type and Code are the provider's error type and code (OpenAI error.type and
	// error.code, Anthropic error.type and error.details.error_code); Param is
	// OpenAI's error.param.
	Type, Code, Param string
	// Message is the provider's human-readable message, at most 1 KiB.
	Message string
	// RequestID is the provider's request id (x-request-id or request-id header).
	RequestID string
	// RetryAfterDelay is the server's Retry-After (retry-after-ms, Retry-After seconds
	// or HTTP-date), valid when RetryAfterSet.
	RetryAfterDelay time.Duration
	RetryAfterSet   bool
	// ShouldRetryHeader is the x-should-retry header ("true"/"false"), empty if absent.
	ShouldRetryHeader string
	// RateLimit is what the answer's headers said of the provider's rate limits (see
	// ParseRateLimit); nil when they said nothing.
	RateLimit *RateLimit
	// Body is the raw error body, at most MaxErrorBody bytes.
	Body []byte
	// Err is the SDK's error, if any.
	Err error
}

var (
	_ retry.HTTPStatuser  = (*APIError)(nil)
	_ retry.RetryAfterer  = (*APIError)(nil)
	_ retry.ShouldRetrier = (*APIError)(nil)
	_ retry.ProviderCoder = (*APIError)(nil)
)

// NewAPIError builds an APIError from an error response: its status, headers and
// body (parsed with ParseErrorBody); now turns an HTTP-date Retry-After into a delay.
// sdkErr is kept for Unwrap. It never fails: an unparseable body leaves Type, Code and
// Message empty.
func NewAPIError(provider string, status int, h http.Header, body []byte, now time.Time, sdkErr error) *APIError {
	if len(body) > MaxErrorBody {
		body = body[:MaxErrorBody]
	}
	e := &APIError{Provider: provider, StatusCode: status, Body: body, Err: sdkErr}
	if h != nil {
		e.RequestID = cmp.Or(h.Get("X-Request-Id"), h.Get("Request-Id"))
		e.RetryAfterDelay, e.RetryAfterSet = retry.RetryAfterFromHeader(h, now)
		e.ShouldRetryHeader = h.Get("X-Should-Retry")
		e.RateLimit = RateLimitOf(h, now)
	}
	if eb, ok := ParseErrorBody(body); ok {
		e.Type, e.Code, e.Param, e.Message = eb.Type, eb.Code, eb.Param, eb.Message
	}
	return e
}

// Error renders the provider, status, type/code, message (left out for 401 and 403)
// and request id on one line.
func (e *APIError) Error() string {
	var b strings.Builder
	b.WriteString(cmp.Or(e.Provider, "llm"))
	b.WriteString(": ")
	if e.StatusCode >= 400 {
		fmt.Fprintf(&b, "HTTP %d %s", e.StatusCode, http.StatusText(e.StatusCode))
	} else {
		b.WriteString("error event in stream")
	}
	if tc := joinTypeCode(e.Type, e.Code); tc != "" {
		b.WriteString(" (" + tc + ")")
	}
	// Authentication failures may echo part of a key: leave their message out.
	if e.Message != "" && e.StatusCode != http.StatusUnauthorized && e.StatusCode != http.StatusForbidden {
		b.WriteString(": " + truncateUTF8(e.Message, 300))
	}
	if e.RequestID != "" {
		b.WriteString(" [request " + e.RequestID + "]")
	}
	return b.String()
}

// Unwrap returns the SDK's error.
func (e *APIError) Unwrap() error { return e.Err }

// HTTPStatus implements retry.HTTPStatuser.
func (e *APIError) HTTPStatus() int { return e.StatusCode }

// RetryAfter implements retry.RetryAfterer.
func (e *APIError) RetryAfter() (time.Duration, bool) { return e.RetryAfterDelay, e.RetryAfterSet }

// ShouldRetry implements retry.ShouldRetrier.
func (e *APIError) ShouldRetry() (bool, bool) { return retry.ParseShouldRetry(e.ShouldRetryHeader) }

// ProviderCode implements retry.ProviderCoder.
func (e *APIError) ProviderCode() (string, string) { return e.Type, e.Code }

// ErrorBody is what ParseErrorBody finds in a provider's error body.
type ErrorBody struct {
	Type, Code, Param, Message string
}

// ParseErrorBody reads the error object of a provider's error body. It understands
// OpenAI's {"error": {"message", "type", "param", "code"}} (code and param may be
// strings, numbers or null), Anthropic's {"type": "error", "error": {"type",
// "message", "details": {"error_code"}}}, and the plainer {"error": "text"},
// {"detail": "text"} and {"message": "text"} of other compatible servers. ok is false
// when the body is not a JSON object or holds none of these. Values are stripped of
// control characters and truncated (message 1 KiB, the others 128 bytes). It never
// panics and is safe for concurrent use.
func ParseErrorBody(body []byte) (eb ErrorBody, ok bool) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(bytes.TrimSpace(body), &top); err != nil || top == nil {
		return ErrorBody{}, false
	}
	if raw, has := top["error"]; has {
		var obj map[string]json.RawMessage
		if json.Unmarshal(raw, &obj) == nil && obj != nil {
			eb.Type = scalar(obj["type"], 128)
			eb.Code = scalar(obj["code"], 128)
			eb.Param = scalar(obj["param"], 128)
			eb.Message = scalar(obj["message"], 1024)
			if eb.Code == "" {
				var details map[string]json.RawMessage
				if json.Unmarshal(obj["details"], &details) == nil {
					eb.Code = scalar(details["error_code"], 128)
				}
			}
			return eb, eb != (ErrorBody{})
		}
		if msg := scalar(raw, 1024); msg != "" {
			return ErrorBody{Message: msg}, true
		}
	}
	for _, k := range []string{"detail", "message"} {
		if msg := scalar(top[k], 1024); msg != "" {
			return ErrorBody{Message: msg}, true
		}
	}
	return ErrorBody{}, false
}

// scalar renders a JSON string, number or boolean as text, cleaned and truncated to
// max bytes; objects, arrays, null and invalid JSON give "".
func scalar(raw json.RawMessage, max int) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return ""
	}
	var s string
	switch raw[0] {
	case '"':
		if json.Unmarshal(raw, &s) != nil {
			return ""
		}
	case 't', 'f':
		var v bool
		if json.Unmarshal(raw, &v) != nil {
			return ""
		}
		s = strconv.FormatBool(v)
	case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
		var n json.Number
		if json.Unmarshal(raw, &n) != nil {
			return ""
		}
		s = n.String()
	default:
		return ""
	}
	s = strings.Map(func(r rune) rune {
		if r == utf8.RuneError || (unicode.IsControl(r) && r != ' ') {
			return ' '
		}
		return r
	}, s)
	return truncateUTF8(strings.TrimSpace(s), max)
}

// truncateUTF8 cuts s to at most max bytes on a rune boundary.
func truncateUTF8(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

func joinTypeCode(t, c string) string {
	switch {
	case t == "":
		return c
	case c == "" || c == t:
		return t
	}
	return t + "/" + c
}

// PeekBody reads up to MaxErrorBody bytes of resp's body for an error report and puts
// them back, so that whoever reads the body next (an SDK's own error decoding) still
// can. A nil resp or body gives nil.
func PeekBody(resp *http.Response) []byte {
	if resp == nil || resp.Body == nil {
		return nil
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, MaxErrorBody))
	resp.Body = io.NopCloser(bytes.NewReader(b))
	return b
}
