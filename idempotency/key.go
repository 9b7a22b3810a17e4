package idempotency

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// Header names the middleware reads and writes.
const (
	// HeaderKey is the request header carrying the client's key
	// (draft-ietf-httpapi-idempotency-key-header).
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is set to "true" on every replayed response.
	HeaderReplayed = "Idempotent-Replayed"
)

// Key length limits, counted on the key's content (without the quotes and escapes of the
// RFC 8941 quoted form).
const (
	MinKeyLen = 16
	MaxKeyLen = 128
)

// ErrMissingKey reports a request without an Idempotency-Key header (or with an empty
// one). The middleware answers it with 400 {"detail": "Idempotency-Key header is
// required"}.
var ErrMissingKey = &KeyError{Detail: "Idempotency-Key header is required", missing: true}

// ErrMalformedKey is what every malformed-key *KeyError matches with errors.Is.
var ErrMalformedKey = errors.New("malformed idempotency key")

// KeyError reports a missing or malformed Idempotency-Key. Detail is a sentence safe to
// show the client; it never contains the key itself, so it is also safe to log.
type KeyError struct {
	Detail  string
	missing bool
}

// Error implements error.
func (e *KeyError) Error() string { return "idempotency key: " + e.Detail }

// Is makes a malformed-key error match ErrMalformedKey and the missing-key error match
// ErrMissingKey.
func (e *KeyError) Is(target error) bool {
	if target == ErrMalformedKey {
		return !e.missing
	}
	if t, ok := target.(*KeyError); ok {
		return t.missing && e.missing
	}
	return false
}

func malformed(format string, args ...any) error {
	return &KeyError{Detail: fmt.Sprintf(format, args...)}
}

// KeyFromRequest returns the Idempotency-Key of h (a request's headers) with ParseKey.
// A header that appears more than once is malformed: two keys cannot both name the
// request.
func KeyFromRequest(h http.Header) (string, error) {
	vs := h.Values(HeaderKey)
	switch len(vs) {
	case 0:
		return "", ErrMissingKey
	case 1:
		return ParseKey(vs[0])
	default:
		return "", malformed("Idempotency-Key must appear once, got %d header lines", len(vs))
	}
}

// ParseKey parses one Idempotency-Key header value and returns the key's content.
//
// Two forms are the same key: the bare form (abc...) and the RFC 8941 sf-string form the
// draft uses ("abc...", where \" and \\ stand for " and \). The content must be MinKeyLen
// to MaxKeyLen printable ASCII characters (0x20 to 0x7E). A bare key cannot start with a
// double quote, which marks the quoted form. Surrounding spaces and tabs are ignored, as
// HTTP does. An empty value returns ErrMissingKey; any other problem returns a *KeyError
// matching ErrMalformedKey whose Detail says what is wrong. ParseKey never panics.
func ParseKey(v string) (string, error) {
	v = strings.Trim(v, " \t")
	if v == "" {
		return "", ErrMissingKey
	}
	var key string
	if v[0] == '"' {
		var err error
		if key, err = unquote(v); err != nil {
			return "", err
		}
	} else {
		for i := 0; i < len(v); i++ {
			if c := v[i]; c < 0x20 || c > 0x7e {
				return "", malformed("Idempotency-Key must be printable ASCII; byte %d is 0x%02x", i+1, c)
			}
		}
		key = v
	}
	if n := len(key); n < MinKeyLen || n > MaxKeyLen {
		return "", malformed("Idempotency-Key must be %d to %d characters, got %d", MinKeyLen, MaxKeyLen, n)
	}
	return key, nil
}

// unquote decodes an RFC 8941 sf-string ("..." with \" and \\ escapes).
func unquote(v string) (string, error) {
	var b strings.Builder
	b.Grow(len(v))
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i >= len(v) {
				return "", malformed("Idempotency-Key quoted string ends inside an escape")
			}
			if v[i] != '"' && v[i] != '\\' {
				return "", malformed(`Idempotency-Key quoted string may only escape " and \; byte %d is an invalid escape`, i+1)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", malformed("Idempotency-Key has characters after its closing quote")
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", malformed("Idempotency-Key must be printable ASCII; byte %d is 0x%02x", i+1, c)
		default:
			b.WriteByte(c)
		}
	}
	return "", malformed("Idempotency-Key quoted string has no closing quote")
}

// QuoteKey returns key in the RFC 8941 sf-string form ("..." with " and \ escaped), the
// form the draft sends. ParseKey(QuoteKey(k)) returns k for every valid key k.
func QuoteKey(key string) string {
	var b strings.Builder
	b.Grow(len(key) + 2)
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		if key[i] == '"' || key[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(key[i])
	}
	b.WriteByte('"')
	return b.String()
}
