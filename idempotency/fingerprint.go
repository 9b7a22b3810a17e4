package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
)

// Fingerprint returns the lower-case hex SHA-256 of canonical, the route's canonical form
// of a request. Two requests with the same key are the same request exactly when their
// fingerprints are equal; a different fingerprint under a used key is answered 422.
func Fingerprint(canonical []byte) string {
	sum := sha256.Sum256(canonical)
	return hex.EncodeToString(sum[:])
}

// CanonicalFunc returns the canonical form of a request whose body (already read and
// size-limited) is body. A returned error is answered 400 with the error's text as the
// detail, so it must be safe to show the client. It must not read r.Body.
type CanonicalFunc func(r *http.Request, body []byte) ([]byte, error)

// DefaultCanonical is the CanonicalFunc the middleware uses unless configured otherwise:
// an empty body is the empty form; a body whose Content-Type is application/json or
// ends in +json is CanonicalJSON of it (invalid JSON is an error); any other body is its
// own canonical form, byte for byte.
func DefaultCanonical(r *http.Request, body []byte) ([]byte, error) {
	if len(body) == 0 {
		return nil, nil
	}
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if mt == "application/json" || strings.HasSuffix(mt, "+json") {
		return CanonicalJSON(body)
	}
	return body, nil
}

// ErrInvalidJSON is what CanonicalJSON's errors match with errors.Is.
var ErrInvalidJSON = errors.New("request body is not valid JSON")

// CanonicalJSON returns the canonical form of one JSON value: numbers keep their literal
// text (decoded with UseNumber, so 1.0 and 1 differ and large integers keep every
// digit), object keys are sorted, there is no insignificant whitespace, and strings use
// encoding/json's escaping without HTML escapes. Insignificant differences (whitespace,
// key order, escapes such as \u0041 for A) give the same form; anything a handler could
// read differently gives a different one. Two limits of encoding/json apply: an object
// with a repeated key keeps its last value, and invalid UTF-8 is replaced by U+FFFD.
// Input that is not exactly one JSON value returns an error matching ErrInvalidJSON.
func CanonicalJSON(body []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("%w: %s", ErrInvalidJSON, describeJSONError(err))
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: data after the first value", ErrInvalidJSON)
	}
	var out bytes.Buffer
	out.Grow(len(body))
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
	return bytes.TrimSuffix(out.Bytes(), []byte{'\n'}), nil
}

func describeJSONError(err error) string {
	var se *json.SyntaxError
	switch {
	case errors.Is(err, io.EOF):
		return "empty"
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "unexpected end"
	case errors.As(err, &se):
		return fmt.Sprintf("%s (at byte %d)", se.Error(), se.Offset)
	}
	return err.Error()
}
