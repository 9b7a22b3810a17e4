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

// The wire format: a stream entry has exactly the fields of its version, in this order.
// Version 2 (written for every message with a Kind) adds "kind" after "job_id", allows
// any printable job id and an empty tenant; version 1 (written for a message without a
// Kind, and what every release before kinds wrote) is still read, so entries already in a
// stream are processed after an upgrade.
const (
	fieldVersion     = "v"
	fieldJobID       = "job_id"
	fieldKind        = "kind"
	fieldTenant      = "tenant"
	fieldPayload     = "payload"
	fieldEnqueuedAt  = "enqueued_at"
	fieldTraceParent = "traceparent"
	// fieldAttempts is optional in both versions: the attempts the job spent before this
	// entry, written by the worker when it schedules a retry (a positive decimal).
	fieldAttempts = "attempts"

	// FormatVersion is the version this package writes for a message with a Kind.
	FormatVersion = "2"
	// FormatVersion1 is the version of a message without a Kind, which this package
	// writes for such messages and reads for ever.
	FormatVersion1 = "1"
)

var (
	messageFieldsV1 = []string{fieldVersion, fieldJobID, fieldTenant, fieldPayload, fieldEnqueuedAt, fieldTraceParent}
	messageFieldsV2 = []string{fieldVersion, fieldJobID, fieldKind, fieldTenant, fieldPayload, fieldEnqueuedAt, fieldTraceParent}
)

// Limits of the wire format.
const (
	// MaxJobIDLen is the longest job id, in bytes.
	MaxJobIDLen = 200
	// MaxKindLen is the longest kind name, in bytes.
	MaxKindLen = 64
	// MaxTenantLen is the longest tenant name, in bytes.
	MaxTenantLen = 64
	// MaxAttempts is the largest "attempts" field a message may carry.
	MaxAttempts = 1 << 20
)

// Message is one job as it travels through the stream.
type Message struct {
	// JobID identifies the job; field "job_id". Version 2: 1 to MaxJobIDLen bytes of
	// printable ASCII without spaces, not shaped like a stream entry id (digits, a dash,
	// digits). Version 1 (no Kind): a UUID in canonical lower-case form. The caller
	// derives it from the request (for example a UUIDv5 of the idempotency scope),
	// never at random per attempt: two deliveries of one job, or two enqueues of one
	// request, carry the same id, which is what makes handlers' deduplication work.
	JobID string
	// Kind names the job's type, which routes it to its handler; field "kind" (version 2
	// only). 1 to MaxKindLen bytes of a-z 0-9 . _ - and :, starting with a letter or a
	// digit. Empty for a version 1 message: the queue's default kind handles it.
	Kind string
	// Tenant owns the job; field "tenant". Up to MaxTenantLen characters of A-Z a-z 0-9
	// . _ -; it may be empty in version 2 (a job no tenant owns), not in version 1.
	Tenant string
	// Payload is the job's input; field "payload". It must be a JSON object.
	Payload json.RawMessage
	// EnqueuedAt is when the job was enqueued; field "enqueued_at", Unix milliseconds.
	EnqueuedAt time.Time
	// TraceParent is the W3C traceparent of the request that enqueued the job, or empty;
	// field "traceparent".
	TraceParent string
	// Attempts is how many attempts of the job's budget (WorkerConfig.MaxDeliveries)
	// were spent before this entry: 0 for a job as enqueued; the worker writes it in the
	// entry of the next attempt after a failure. Field "attempts", optional in both
	// versions, present only when positive.
	Attempts int
}

// ErrMalformed is wrapped by every error ParseMessage returns. A Worker dead-letters a
// malformed entry at once, with the reason "malformed: <what was wrong>".
var ErrMalformed = errors.New("malformed message")

// Values returns the XADD field/value list of m, the complete wire format, every value a
// string: v, job_id, kind, tenant, payload, enqueued_at, traceparent (version 2), or
// without kind (version 1) when m has no Kind, then attempts when m.Attempts is
// positive. Anything that XADDs a job (including a Lua script) must write exactly this
// list.
func (m Message) Values() []any {
	v := m.values()
	if m.Attempts > 0 {
		v = append(v, fieldAttempts, strconv.Itoa(m.Attempts))
	}
	return v
}

func (m Message) values() []any {
	if m.Kind == "" {
		return []any{
			fieldVersion, FormatVersion1,
			fieldJobID, m.JobID,
			fieldTenant, m.Tenant,
			fieldPayload, string(m.Payload),
			fieldEnqueuedAt, strconv.FormatInt(m.EnqueuedAt.UnixMilli(), 10),
			fieldTraceParent, m.TraceParent,
		}
	}
	return []any{
		fieldVersion, FormatVersion,
		fieldJobID, m.JobID,
		fieldKind, m.Kind,
		fieldTenant, m.Tenant,
		fieldPayload, string(m.Payload),
		fieldEnqueuedAt, strconv.FormatInt(m.EnqueuedAt.UnixMilli(), 10),
		fieldTraceParent, m.TraceParent,
	}
}

// Validate reports the first reason m cannot be enqueued, as an error wrapping
// ErrMalformed: the same checks ParseMessage applies to what it reads back.
func (m Message) Validate() error {
	v1 := m.Kind == ""
	switch {
	case v1 && !IsUUID(m.JobID):
		return malformedf("job_id %q is not a canonical lower-case UUID (a message without a kind)", clip(m.JobID))
	case !ValidJobID(m.JobID):
		return malformedf("job_id %q is not 1-%d printable ASCII characters without spaces (and not shaped like a stream entry id)", clip(m.JobID), MaxJobIDLen)
	case !v1 && !ValidKind(m.Kind):
		return malformedf("kind %q is not 1-%d characters of a-z 0-9 . _ - : starting with a letter or digit", clip(m.Kind), MaxKindLen)
	case v1 && m.Tenant == "":
		return malformedf("tenant is empty (a message without a kind needs one)")
	case m.Attempts < 0 || m.Attempts > MaxAttempts:
		return malformedf("attempts %d is not between 0 and %d", m.Attempts, MaxAttempts)
	case !ValidTenant(m.Tenant):
		return malformedf("tenant %q is not up to %d characters of A-Z a-z 0-9 . _ -", clip(m.Tenant), MaxTenantLen)
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
// values), in either version. It is strict: "v" must be FormatVersion or
// FormatVersion1, every field of that version must be present with a string value, no
// other field may be but the optional "attempts", and each value must be valid (see Message; a version 2 message
// must have a Kind). Its errors wrap ErrMalformed and say what was wrong.
func ParseMessage(fields map[string]any) (Message, error) {
	ver, ok := fields[fieldVersion]
	if !ok {
		return Message{}, malformedf("missing field %q", fieldVersion)
	}
	vs, ok := ver.(string)
	if !ok {
		return Message{}, malformedf("field %q is a %T, not a string", fieldVersion, ver)
	}
	var names []string
	switch vs {
	case FormatVersion:
		names = messageFieldsV2
	case FormatVersion1:
		names = messageFieldsV1
	default:
		return Message{}, malformedf("unknown version %q", clip(vs))
	}
	// The values, read straight from fields (no map of their own: this runs for every
	// job a worker takes).
	var jobID, kind, tenant, payload, at, traceParent string
	for _, f := range names[1:] {
		v, ok := fields[f]
		if !ok {
			return Message{}, malformedf("missing field %q", f)
		}
		s, ok := v.(string)
		if !ok {
			return Message{}, malformedf("field %q is a %T, not a string", f, v)
		}
		switch f {
		case fieldJobID:
			jobID = s
		case fieldKind:
			kind = s
		case fieldTenant:
			tenant = s
		case fieldPayload:
			payload = s
		case fieldEnqueuedAt:
			at = s
		case fieldTraceParent:
			traceParent = s
		}
	}
	attempts := 0
	if v, ok := fields[fieldAttempts]; ok {
		s, _ := v.(string)
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 || s[0] == '0' || s[0] == '+' || n > MaxAttempts {
			return Message{}, malformedf("attempts %q is not a positive decimal up to %d", clip(s), MaxAttempts)
		}
		attempts = n
	}
	if len(fields) != len(names)+min(attempts, 1) {
		var extra []string
		for k := range fields {
			if !slices.Contains(names, k) && k != fieldAttempts {
				extra = append(extra, clip(k))
			}
		}
		slices.Sort(extra)
		return Message{}, malformedf("unknown field(s) %s", strings.Join(extra, ", "))
	}
	ms, err := strconv.ParseInt(at, 10, 64)
	if err != nil || ms <= 0 || at[0] == '0' || at[0] == '+' {
		return Message{}, malformedf("enqueued_at %q is not a positive Unix millisecond time", clip(at))
	}
	m := Message{
		JobID:       jobID,
		Kind:        kind,
		Tenant:      tenant,
		Payload:     json.RawMessage(payload),
		EnqueuedAt:  time.UnixMilli(ms),
		TraceParent: traceParent,
		Attempts:    attempts,
	}
	if vs == FormatVersion && m.Kind == "" {
		return Message{}, malformedf("kind is empty")
	}
	if err := m.Validate(); err != nil {
		return Message{}, err
	}
	return m, nil
}

// streamIDShaped reports whether id looks like a stream entry id, which no job id may:
// digits, optionally a dash and digits (what the regular expression ^[0-9]+(-[0-9]+)?$
// matches; written out, since every job a worker takes is checked).
func streamIDShaped(id string) bool {
	digits := func(s string) bool {
		if s == "" {
			return false
		}
		for i := 0; i < len(s); i++ {
			if s[i] < '0' || s[i] > '9' {
				return false
			}
		}
		return true
	}
	ms, seq, dash := strings.Cut(id, "-")
	return digits(ms) && (!dash || digits(seq))
}

// ValidJobID reports whether id can be a job id: 1 to MaxJobIDLen bytes of printable
// ASCII without spaces (0x21 to 0x7e), not shaped like a stream entry id (digits,
// optionally a dash and digits), so tools that take either an entry id or a job id
// (onceflow dlq replay ID) can tell them apart. A message without a kind (version 1)
// needs a UUID (IsUUID).
func ValidJobID(id string) bool {
	if len(id) == 0 || len(id) > MaxJobIDLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return false
		}
	}
	return !streamIDShaped(id)
}

// ValidKind reports whether kind can name a job kind: 1 to MaxKindLen bytes of a-z 0-9
// . _ - and :, the first a letter or a digit.
func ValidKind(kind string) bool {
	if len(kind) == 0 || len(kind) > MaxKindLen {
		return false
	}
	for i := 0; i < len(kind); i++ {
		c := kind[i]
		alnum := c >= 'a' && c <= 'z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-' && c != ':') {
			return false
		}
	}
	return true
}

// IsUUID reports whether id is a UUID in canonical lower-case form
// (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), the job id of a version 1 message.
func IsUUID(id string) bool {
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

// ValidTenant reports whether t can name a tenant: up to MaxTenantLen characters of
// A-Z a-z 0-9 . _ -, or empty (no tenant).
func ValidTenant(t string) bool {
	if len(t) > MaxTenantLen {
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
