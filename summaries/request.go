package summaries

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"net/mail"
	"strings"
	"unicode/utf8"

	"github.com/onceflow/onceflow/internal/strictjson"
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

// DecodeRequest parses and validates a request body strictly (internal/strictjson): one
// JSON object, member names matched case-sensitively, no unknown or duplicate member, no
// trailing data, valid UTF-8, both fields present and valid. Errors are *FieldError
// naming the field ("body" for the document as a whole). The API decodes POST bodies
// with it and the job handler the queued payloads, so both sides accept the same
// documents.
func DecodeRequest(body []byte) (Request, error) {
	var r Request
	if err := strictjson.Decode(body, &r); err != nil {
		return Request{}, decodeError(err)
	}
	return r, r.validate()
}

// validate checks a decoded request's fields; errors are *FieldError.
func (r *Request) validate() error {
	// PostgreSQL's text holds no U+0000: a job carrying one could never store its
	// summary (or its email), so it is refused here rather than dead-lettered later.
	for _, f := range []struct{ name, v string }{{"text", r.Text}, {"notify", r.Notify}} {
		if strings.ContainsRune(f.v, 0) {
			return &FieldError{f.name, "must not contain U+0000"}
		}
	}
	// A missing field and an empty one are alike to the checks below.
	switch n := utf8.RuneCountInString(r.Text); {
	case strings.TrimSpace(r.Text) == "":
		return &FieldError{"text", "required and must not be blank"}
	case n > MaxTextChars:
		return &FieldError{"text", fmt.Sprintf("too long: %d characters, at most %d", n, MaxTextChars)}
	}
	if err := validEmail(r.Notify); err != nil {
		return &FieldError{"notify", err.Error()}
	}
	return nil
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

// decodeError turns strictjson's errors into a FieldError naming the field.
func decodeError(err error) error {
	var se *strictjson.Error
	if !errors.As(err, &se) {
		return &FieldError{"body", "invalid JSON"}
	}
	field := cmp.Or(se.Field, "body")
	switch se.Kind {
	case strictjson.KindEmpty:
		return &FieldError{"body", "empty body; want a JSON object"}
	case strictjson.KindTrailingData:
		return &FieldError{"body", "unexpected data after the JSON object"}
	}
	return &FieldError{field, se.Msg}
}
