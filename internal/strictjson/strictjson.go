// Package strictjson decodes JSON that comes from outside (request bodies, job
// arguments) into Go values strictly, and says which field is wrong when it refuses.
//
// It is github.com/go-json-experiment/json, the upstream of encoding/json/v2 (Go 1.26's
// encoding/json/v2 needs GOEXPERIMENT=jsonv2, which a library cannot ask of its users),
// with RejectUnknownMembers. Unlike encoding/json (v1) it:
//
//   - matches member names to struct fields case-sensitively: {"TEXT": ...} is an
//     unknown member, not the field tagged "text";
//   - rejects a member name that appears twice in one object (v1 keeps the last);
//   - rejects invalid UTF-8 and unpaired UTF-16 surrogates (\ud800) in strings (v1
//     replaces them with U+FFFD).
//
// As with v1, null leaves a field unchanged and a missing field is its zero value:
// checking required fields is the caller's job.
package strictjson

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"unicode/utf8"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// Kind says what is wrong with a document.
type Kind string

// The kinds of Error.
const (
	// KindEmpty: the document is empty or only whitespace.
	KindEmpty Kind = "empty"
	// KindInvalidUTF8: the document is not valid UTF-8.
	KindInvalidUTF8 Kind = "invalid_utf8"
	// KindSyntax: the document is not JSON (Offset says where).
	KindSyntax Kind = "syntax"
	// KindTruncated: the document ends in the middle of a value.
	KindTruncated Kind = "truncated"
	// KindTrailingData: something follows the first JSON value.
	KindTrailingData Kind = "trailing_data"
	// KindUnknownField: a member name matches no field (names are case-sensitive).
	KindUnknownField Kind = "unknown_field"
	// KindDuplicateField: a member name appears twice in one object.
	KindDuplicateField Kind = "duplicate_field"
	// KindType: a value has the wrong JSON type for its field (or the document for v).
	KindType Kind = "type"
	// KindInvalidValue: a value of the right type that its field rejects (a custom
	// unmarshaler's error, a number out of range).
	KindInvalidValue Kind = "invalid_value"
)

// Error is what Decode returns for a document it refuses.
type Error struct {
	// Kind says what is wrong.
	Kind Kind
	// Field is the member concerned, as the path of member names (and array indexes)
	// from the top, joined by dots: "text", "user.email", "items.2". It is the
	// offending name itself for KindUnknownField and KindDuplicateField, and the value
	// the decoder was in for KindSyntax and KindTruncated (an unpaired surrogate in
	// "text" names text). Empty when the problem is the document as a whole (syntax
	// between members, trailing data, the top-level type), and for the empty member
	// name at the top level (Msg then ends in "").
	Field string
	// Offset is the byte offset where the problem was found, when known (else 0).
	Offset int64
	// Msg explains the problem without naming the field: "unknown field", "duplicate
	// field", "must be a string", "invalid JSON at byte 12".
	Msg string
	// Err is the decoder's own error, if any.
	Err error
}

// Error returns "strictjson: FIELD: MSG", or "strictjson: MSG" without a field.
func (e *Error) Error() string {
	if e.Field == "" {
		return "strictjson: " + e.Msg
	}
	return "strictjson: " + e.Field + ": " + e.Msg
}

// Unwrap returns the decoder's error.
func (e *Error) Unwrap() error { return e.Err }

// Decode unmarshals data, exactly one JSON value with optional surrounding whitespace,
// into v, a non-nil pointer. A document it refuses returns an *Error naming the field;
// an unusable v returns another error. It never panics on any input and is safe for
// concurrent use.
func Decode(data []byte, v any) error {
	if rv := reflect.ValueOf(v); rv.Kind() != reflect.Pointer || rv.IsNil() {
		return fmt.Errorf("strictjson: Decode needs a non-nil pointer, not %T", v)
	}
	if !utf8.Valid(data) {
		return &Error{Kind: KindInvalidUTF8, Msg: "not valid UTF-8"}
	}
	if len(bytes.TrimLeft(data, " \t\r\n")) == 0 {
		return &Error{Kind: KindEmpty, Msg: "empty; want a JSON value"}
	}
	dec := jsontext.NewDecoder(bytes.NewReader(data))
	if err := json.UnmarshalDecode(dec, v, json.RejectUnknownMembers(true)); err != nil {
		return describe(err)
	}
	if _, err := dec.ReadToken(); !errors.Is(err, io.EOF) {
		return &Error{Kind: KindTrailingData, Offset: dec.InputOffset(), Msg: "unexpected data after the JSON value"}
	}
	return nil
}

// Check reports whether data is exactly one JSON value of any type, read as strictly
// as Decode reads one (valid UTF-8, no unpaired surrogates, no member name twice in an
// object, nothing after the value), for a body kept as it is (a signal's payload): nil,
// or the *Error Decode would give. It is safe for concurrent use.
func Check(data []byte) error {
	var v jsontext.Value
	return Decode(data, &v)
}

// Encode marshals v with the same JSON semantics Decode reads (encoding/json/v2's), so
// whatever Encode writes, Decode reads back into the same type: a type the two cannot
// round-trip (a time.Duration without a format, a channel) fails here, not when the
// other side decodes it.
func Encode(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("strictjson: %w", err)
	}
	return b, nil
}

// describe turns the decoder's errors into an *Error.
func describe(err error) error {
	var syn *jsontext.SyntacticError
	var sem *json.SemanticError
	switch {
	case errors.As(err, &syn):
		switch {
		case errors.Is(syn.Err, jsontext.ErrDuplicateName):
			f := field(syn.JSONPointer)
			return &Error{Kind: KindDuplicateField, Field: f, Offset: syn.ByteOffset, Msg: nameMsg("duplicate field", f), Err: err}
		case errors.Is(syn.Err, io.ErrUnexpectedEOF):
			return &Error{Kind: KindTruncated, Field: field(syn.JSONPointer), Offset: syn.ByteOffset, Msg: "truncated JSON", Err: err}
		}
		return &Error{Kind: KindSyntax, Field: field(syn.JSONPointer), Offset: syn.ByteOffset, Msg: fmt.Sprintf("invalid JSON at byte %d", syn.ByteOffset), Err: err}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &Error{Kind: KindTruncated, Msg: "truncated JSON", Err: err}
	case errors.As(err, &sem):
		f := field(sem.JSONPointer)
		switch {
		case errors.Is(sem.Err, json.ErrUnknownName):
			return &Error{Kind: KindUnknownField, Field: f, Offset: sem.ByteOffset, Msg: nameMsg("unknown field", f), Err: err}
		case sem.Err == nil && sem.GoType != nil:
			return &Error{Kind: KindType, Field: f, Offset: sem.ByteOffset, Msg: "must be " + jsonType(sem.GoType), Err: err}
		case sem.Err != nil:
			return &Error{Kind: KindInvalidValue, Field: f, Offset: sem.ByteOffset, Msg: "invalid value: " + sem.Err.Error(), Err: err}
		}
		return &Error{Kind: KindInvalidValue, Field: f, Offset: sem.ByteOffset, Msg: "invalid value", Err: err}
	}
	return err
}

// nameMsg is msg, or for the one name that leaves Field empty, the empty member name
// at the top level, msg followed by "" so the message still says which name.
func nameMsg(msg, field string) string {
	if field == "" {
		return msg + ` ""`
	}
	return msg
}

// Bounds of Error.Field, which a 400 quotes: the input chooses the names.
const (
	maxFieldDepth = 8  // deeper paths are reported by their top-level member alone
	maxNameBytes  = 64 // longer names are clipped, with "..."
)

// field turns a JSON Pointer ("/user/email") into Error.Field ("user.email"): at most
// maxFieldDepth names of at most maxNameBytes each, so a hostile document (a member name
// of 100 KB, a value nested 20,000 deep) cannot make a huge error.
func field(p jsontext.Pointer) string {
	var parts []string
	for tok := range p.Tokens() {
		parts = append(parts, clipName(tok))
	}
	if len(parts) > maxFieldDepth {
		parts = parts[:1]
	}
	return strings.Join(parts, ".")
}

// clipName cuts a member name to maxNameBytes on a rune boundary.
func clipName(s string) string {
	if len(s) <= maxNameBytes {
		return s
	}
	cut := maxNameBytes
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// jsonType names the JSON a Go type wants: "a string", "a number", "an object".
func jsonType(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Struct, reflect.Map:
		return "a JSON object"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return "a " + t.String()
}
