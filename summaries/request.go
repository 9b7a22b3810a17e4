package summaries

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/mail"
	"strings"
	"unicode/utf8"
)

// Limits of a summary request.
const (
	// MaxBodyBytes is the largest request body accepted; larger bodies get 413.
	MaxBodyBytes = 1 << 20
	// MaxTextChars is the longest text accepted, in characters (Unicode code points).
	MaxTextChars = 100_000
)

// Request is the body of POST /v1/summaries.
type Request struct {
	// Text is what to summarise: 1 to MaxTextChars characters.
	Text string `json:"text"`
	// Notify is the email address told when the summary is ready.
	Notify string `json:"notify"`
}

// FieldError says which field of a request is wrong; the API answers it with 400.
type FieldError struct {
	Field string // JSON name, or "body" for the document as a whole
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// DecodeRequest parses and validates a request body strictly: one JSON object, no unknown
// fields, no trailing data, both fields present and valid. Errors are *FieldError.
func DecodeRequest(body []byte) (Request, error) {
	var r Request
	if !utf8.Valid(body) {
		return r, &FieldError{"body", "not valid UTF-8"}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return r, decodeError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return r, &FieldError{"body", "unexpected data after the JSON object"}
	}
	// DisallowUnknownFields does not catch a duplicated key; nor does it tell a missing
	// field from an empty one, which the checks below treat alike.
	switch n := utf8.RuneCountInString(r.Text); {
	case strings.TrimSpace(r.Text) == "":
		return r, &FieldError{"text", "required and must not be blank"}
	case n > MaxTextChars:
		return r, &FieldError{"text", fmt.Sprintf("too long: %d characters, at most %d", n, MaxTextChars)}
	}
	if err := validEmail(r.Notify); err != nil {
		return r, &FieldError{"notify", err.Error()}
	}
	return r, nil
}

// Canonical returns the request re-encoded with a fixed field order and no insignificant
// whitespace: the form the Idempotency-Key fingerprint is computed over, so two bodies
// that differ only in whitespace or key order are the same request.
func (r Request) Canonical() []byte {
	b, _ := json.Marshal(r) // a struct of two strings cannot fail to encode
	return b
}

func validEmail(s string) error {
	if s == "" {
		return errors.New("required")
	}
	if len(s) > 254 {
		return errors.New("too long for an email address")
	}
	a, err := mail.ParseAddress(s)
	if err != nil || a.Address != s || a.Name != "" {
		return errors.New("not an email address (want user@example.com)")
	}
	local, domain, _ := strings.Cut(s, "@")
	if local == "" || !strings.Contains(domain, ".") || strings.HasPrefix(domain, ".") || strings.HasSuffix(domain, ".") {
		return errors.New("not an email address (want user@example.com)")
	}
	return nil
}

// decodeError turns encoding/json's errors into a FieldError naming the field.
func decodeError(err error) error {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		field := te.Field
		if field == "" {
			return &FieldError{"body", "must be a JSON object"}
		}
		return &FieldError{field, "must be a " + strings.TrimPrefix(te.Type.String(), "*")}
	case errors.As(err, &se):
		return &FieldError{"body", fmt.Sprintf("invalid JSON at byte %d", se.Offset)}
	case errors.Is(err, io.EOF):
		return &FieldError{"body", "empty body; want a JSON object"}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &FieldError{"body", "truncated JSON"}
	}
	if f, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		if name := strings.Trim(f, `"`); name != "" {
			return &FieldError{name, "unknown field"}
		}
		return &FieldError{"body", `unknown field ""`}
	}
	return &FieldError{"body", "invalid JSON"}
}
