package queue

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Wire format, version 1: a stream entry has exactly these fields, in this order.
const (
	fieldVersion     = "v"
	fieldJobID       = "job_id"
	fieldTenant      = "tenant"
	fieldPayload     = "payload"
	fieldEnqueuedAt  = "enqueued_at"
	fieldTraceParent = "traceparent"

	// FormatVersion is the value of the "v" field this package writes and accepts.
	FormatVersion = "1"
)

var messageFields = []string{fieldVersion, fieldJobID, fieldTenant, fieldPayload, fieldEnqueuedAt, fieldTraceParent}

// Message is one job as it travels through the stream (format version 1).
type Message struct {
	// JobID identifies the job; field "job_id". It is a UUID in canonical lower-case form
	// that the caller derives from the request (for example a UUIDv5 of the idempotency
	// scope), never a random one: two deliveries of one job, or two enqueues of one
	// request, carry the same id, which is what makes handlers' deduplication work.
	JobID string
	// Tenant owns the job; field "tenant". 1 to 64 characters of A-Z a-z 0-9 . _ -.
	Tenant string
	// Payload is the job's input; field "payload". It must be a JSON object.
	Payload json.RawMessage
	// EnqueuedAt is when the job was enqueued; field "enqueued_at", Unix milliseconds.
	EnqueuedAt time.Time
	// TraceParent is the W3C traceparent of the request that enqueued the job, or empty;
	// field "traceparent".
	TraceParent string
}

// ErrMalformed is wrapped by every error ParseMessage returns. A Worker dead-letters a
// malformed entry at once, with the reason "malformed: <what was wrong>".
var ErrMalformed = errors.New("malformed message")

// Values returns the XADD field/value list of m, the complete wire format: v, job_id,
// tenant, payload, enqueued_at, traceparent, in that order, every value a string.
// Anything that XADDs a job (including a Lua script) must write exactly this list.
func (m Message) Values() []any {
	return []any{
		fieldVersion, FormatVersion,
		fieldJobID, m.JobID,
		fieldTenant, m.Tenant,
		fieldPayload, string(m.Payload),
		fieldEnqueuedAt, strconv.FormatInt(m.EnqueuedAt.UnixMilli(), 10),
		fieldTraceParent, m.TraceParent,
	}
}

// Validate reports the first reason m cannot be enqueued, as an error wrapping
// ErrMalformed: the same checks ParseMessage applies to what it reads back.
func (m Message) Validate() error {
	switch {
	case !ValidJobID(m.JobID):
		return malformedf("job_id %q is not a canonical lower-case UUID", clip(m.JobID))
	case !validTenant(m.Tenant):
		return malformedf("tenant %q is not 1-64 characters of A-Z a-z 0-9 . _ -", clip(m.Tenant))
	case m.EnqueuedAt.UnixMilli() <= 0:
		return malformedf("enqueued_at %d is not a positive Unix millisecond time", m.EnqueuedAt.UnixMilli())
	}
	if err := validPayload(m.Payload); err != nil {
		return err
	}
	if m.TraceParent != "" && !validTraceParent(m.TraceParent) {
		return malformedf("traceparent %q is not a W3C traceparent", clip(m.TraceParent))
	}
	return nil
}

// ParseMessage decodes the fields of one stream entry (as go-redis returns them: string
// values). It is strict: every field of the format must be present with a string value,
// no other field may be, "v" must be FormatVersion and each value must be valid (see
// Message). Its errors wrap ErrMalformed and say what was wrong.
func ParseMessage(fields map[string]any) (Message, error) {
	var vals [6]string // in messageFields order
	for i, f := range messageFields {
		v, ok := fields[f]
		if !ok {
			if i == 0 {
				return Message{}, malformedf("missing field %q", f)
			}
			continue // reported below, after the version check
		}
		s, ok := v.(string)
		if !ok {
			return Message{}, malformedf("field %q is a %T, not a string", f, v)
		}
		vals[i] = s
		if i == 0 && s != FormatVersion {
			return Message{}, malformedf("unknown version %q", clip(s))
		}
	}
	for _, f := range messageFields[1:] {
		if _, ok := fields[f]; !ok {
			return Message{}, malformedf("missing field %q", f)
		}
	}
	if len(fields) != len(messageFields) {
		var extra []string
		for k := range fields {
			if !slices.Contains(messageFields, k) {
				extra = append(extra, clip(k))
			}
		}
		slices.Sort(extra)
		return Message{}, malformedf("unknown field(s) %s", strings.Join(extra, ", "))
	}
	at := vals[4]
	ms, err := strconv.ParseInt(at, 10, 64)
	if err != nil || ms <= 0 || at[0] == '0' || at[0] == '+' {
		return Message{}, malformedf("enqueued_at %q is not a positive Unix millisecond time", clip(at))
	}
	m := Message{
		JobID:       vals[1],
		Tenant:      vals[2],
		Payload:     json.RawMessage(vals[3]),
		EnqueuedAt:  time.UnixMilli(ms),
		TraceParent: vals[5],
	}
	if err := m.Validate(); err != nil {
		return Message{}, err
	}
	return m, nil
}

// ValidJobID reports whether id is a UUID in canonical lower-case form
// (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), the only form a job id takes.
func ValidJobID(id string) bool {
	if len(id) != 36 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !isLowerHex(c) {
				return false
			}
		}
	}
	return true
}

func validTenant(t string) bool {
	if len(t) == 0 || len(t) > 64 {
		return false
	}
	for i := 0; i < len(t); i++ {
		c := t[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

func validPayload(p json.RawMessage) error {
	if len(p) == 0 {
		return malformedf("payload is empty")
	}
	if !json.Valid(p) {
		return malformedf("payload is not valid JSON")
	}
	if t := bytes.TrimLeft(p, " \t\r\n"); t[0] != '{' {
		return malformedf("payload is not a JSON object")
	}
	return nil
}

// validTraceParent checks the W3C Trace Context traceparent syntax: version 00 is exactly
// 00-<32 hex trace id, not all zero>-<16 hex parent id, not all zero>-<2 hex flags>; a
// later version (not ff) has that prefix and may continue after a dash.
func validTraceParent(s string) bool {
	if len(s) < 55 || !hexOnly(s[0:2]) || s[0:2] == "ff" || s[2] != '-' || s[35] != '-' || s[52] != '-' {
		return false
	}
	trace, parent, flags := s[3:35], s[36:52], s[53:55]
	if !hexOnly(trace) || !hexOnly(parent) || !hexOnly(flags) ||
		trace == "00000000000000000000000000000000" || parent == "0000000000000000" {
		return false
	}
	if s[0:2] == "00" {
		return len(s) == 55
	}
	return len(s) == 55 || s[55] == '-'
}

func hexOnly(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isLowerHex(s[i]) {
			return false
		}
	}
	return true
}

func isLowerHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' }

func malformedf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// clip shortens untrusted text quoted in an error, so a huge field cannot make a huge
// log line or dead-letter reason.
func clip(s string) string {
	const max = 64
	if len(s) <= max {
		return s
	}
	return s[:max] + "..."
}
