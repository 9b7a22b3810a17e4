package queue

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"
)

// fieldsOf turns a Values() list into the map go-redis returns for a stream entry.
func fieldsOf(values []any) map[string]any {
	m := make(map[string]any, len(values)/2)
	for i := 0; i+1 < len(values); i += 2 {
		m[fmt.Sprint(values[i])] = values[i+1]
	}
	return m
}

func TestValuesIsTheWireFormat(t *testing.T) {
	t.Parallel()
	m := Message{JobID: jobID(1), Tenant: "acme", Payload: json.RawMessage(`{"text":"hi"}`), EnqueuedAt: time.UnixMilli(1_700_000_000_123),
		TraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	want := []any{"v", "1", "job_id", jobID(1), "tenant", "acme", "payload", `{"text":"hi"}`, "enqueued_at", "1700000000123",
		"traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	if got := m.Values(); !reflect.DeepEqual(got, want) {
		t.Fatalf("Values() = %v\nwant       %v", got, want)
	}
	back, err := ParseMessage(fieldsOf(m.Values()))
	if err != nil {
		t.Fatal(err)
	}
	if back.JobID != m.JobID || back.Tenant != m.Tenant || string(back.Payload) != string(m.Payload) ||
		!back.EnqueuedAt.Equal(m.EnqueuedAt) || back.TraceParent != m.TraceParent {
		t.Errorf("round trip: %+v != %+v", back, m)
	}
}

func TestParseMessageRejects(t *testing.T) {
	t.Parallel()
	good := fieldsOf(message(1, nil).Values())
	with := func(k string, v any) map[string]any {
		m := make(map[string]any, len(good))
		for kk, vv := range good {
			m[kk] = vv
		}
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
		return m
	}
	cases := map[string]map[string]any{
		`missing field "v"`:                             with("v", nil),
		`unknown version "3"`:                           with("v", "3"),
		`missing field "kind"`:                          with("v", "2"),
		`missing field "traceparent"`:                   with("traceparent", nil),
		`unknown field(s) extra`:                        with("extra", "x"),
		`field "tenant" is a int`:                       with("tenant", 7),
		`job_id "42" is not a canonical`:                with("job_id", "42"),
		`job_id "00000000-0000-4000-8000-00000000000A"`: with("job_id", "00000000-0000-4000-8000-00000000000A"),
		`tenant is empty (a message without a kind`:     with("tenant", ""),
		`tenant "a b" is not`:                           with("tenant", "a b"),
		"payload is empty":                              with("payload", ""),
		"payload is not valid JSON":                     with("payload", `{"a":`),
		"payload is not a JSON object":                  with("payload", `"str"`),
		`enqueued_at "-5"`:                              with("enqueued_at", "-5"),
		`enqueued_at "0012"`:                            with("enqueued_at", "0012"),
		`enqueued_at "soon"`:                            with("enqueued_at", "soon"),
		`traceparent "00-abc" is not`:                   with("traceparent", "00-abc"),
		`traceparent "00-00000000000000000000000000000000-00f067aa0ba902b7-01"`: with("traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
		`traceparent "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"`: with("traceparent", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
	}
	for want, fields := range cases {
		_, err := ParseMessage(fields)
		if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseMessage: %v, want ErrMalformed mentioning %q", err, want)
		}
	}
	// Later traceparent versions may carry more after a dash.
	if _, err := ParseMessage(with("traceparent", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more")); err != nil {
		t.Errorf("future traceparent version refused: %v", err)
	}
	// A huge value is clipped in the error.
	_, err := ParseMessage(with("tenant", strings.Repeat("x", 10_000)))
	if err == nil || len(err.Error()) > 300 {
		t.Errorf("error for a huge tenant: %d characters", len(err.Error()))
	}
}

// Version 2: a kind, any printable job id and an optional tenant; it round-trips, and
// its own rules are enforced.
func TestMessageVersion2(t *testing.T) {
	t.Parallel()
	m := Message{JobID: "ticket-42/refund", Kind: "triage.ticket", Payload: []byte(`{"n":1}`), EnqueuedAt: time.UnixMilli(1_700_000_000_000)}
	vals := m.Values()
	if vals[1] != FormatVersion || vals[4] != fieldKind || vals[5] != "triage.ticket" {
		t.Fatalf("values %v", vals)
	}
	got, err := ParseMessage(fieldsOf(vals))
	if err != nil {
		t.Fatal(err)
	}
	if got.JobID != m.JobID || got.Kind != m.Kind || got.Tenant != "" || string(got.Payload) != `{"n":1}` || !got.EnqueuedAt.Equal(m.EnqueuedAt) {
		t.Fatalf("round trip %+v", got)
	}
	bad := map[string]Message{
		"kind":          {JobID: "j", Kind: "Triage", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt},
		`kind "-x"`:     {JobID: "j", Kind: "-x", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt},
		`job_id "a b"`:  {JobID: "a b", Kind: "k", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt},
		`job_id "12-3"`: {JobID: "12-3", Kind: "k", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt},
		`job_id ""`:     {JobID: "", Kind: "k", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt},
		`tenant "a/b"`:  {JobID: "j", Kind: "k", Tenant: "a/b", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt},
	}
	for want, bm := range bad {
		if err := bm.Validate(); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate(%+v) = %v, want one mentioning %s", bm, err, want)
		}
	}
	if ValidJobID(strings.Repeat("x", MaxJobIDLen+1)) || !ValidJobID(strings.Repeat("x", MaxJobIDLen)) {
		t.Error("MaxJobIDLen not enforced")
	}
	// Version 1 (no kind) still needs a UUID and a tenant.
	if err := (Message{JobID: "ticket-1", Tenant: "t", Payload: []byte(`{}`), EnqueuedAt: m.EnqueuedAt}).Validate(); err == nil {
		t.Error("a message without a kind took a non-UUID job id")
	}
}

func TestPermanentWrapsItsErrorAndNilStaysNil(t *testing.T) {
	t.Parallel()
	base := errors.New("400 bad request")
	err := fmt.Errorf("summarise: %w", Permanent(base))
	if !errors.Is(err, ErrPermanent) || !errors.Is(err, base) || err.Error() != "summarise: 400 bad request" {
		t.Errorf("Permanent: %v", err)
	}
	if Permanent(nil) != nil {
		t.Error("Permanent(nil) != nil")
	}
}

func TestKeysCarryTheQueuesHashTagAndValidateRefusesBadNames(t *testing.T) {
	t.Parallel()
	k := Keys{Prefix: "onceflow", Queue: "summaries"}
	if k.Stream() != "onceflow:{summaries}:stream" || k.Dead() != "onceflow:{summaries}:dead" || k.Job("j") != "onceflow:{summaries}:job:j" {
		t.Errorf("keys %s %s %s", k.Stream(), k.Dead(), k.Job("j"))
	}
	for _, bad := range []Keys{{}, {Prefix: "a:b", Queue: "q"}, {Prefix: "p", Queue: "q r"}, {Prefix: "p", Queue: "{q"}} {
		if bad.Validate() == nil {
			t.Errorf("%+v validated", bad)
		}
	}
}

// streamIDShapeRE is the definition streamIDShaped writes out.
var streamIDShapeRE = regexp.MustCompile(`^[0-9]+(-[0-9]+)?$`)

func TestStreamIDShapedIsTheRegularExpression(t *testing.T) {
	for _, id := range []string{"", "1", "0", "123-4", "123-", "-4", "1-2-3", "12a", "a-1", "1-a", "--", "-", "1526919030474-55",
		"00-00", "9999999999999999999999", "1 2", "١"} {
		if got, want := streamIDShaped(id), streamIDShapeRE.MatchString(id); got != want {
			t.Errorf("streamIDShaped(%q) = %v, the expression says %v", id, got, want)
		}
	}
}

func FuzzStreamIDShaped(f *testing.F) {
	for _, seed := range []string{"1-2", "1", "x", "1-", "-1", "1-2-3"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if got, want := streamIDShaped(id), streamIDShapeRE.MatchString(id); got != want {
			t.Fatalf("streamIDShaped(%q) = %v, the expression says %v", id, got, want)
		}
	})
}

func FuzzParseMessage(f *testing.F) {
	good := message(1, nil)
	good.TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	v := good.Values()
	f.Add(v[1].(string), v[3].(string), v[5].(string), v[7].(string), v[9].(string), v[11].(string), "")
	f.Add("1", jobID(2), "t", `{}`, "1", "", "")
	f.Add("2", "x", "", `[`, "-1", "00-", "extra")
	f.Add("2", "job/1", "", `{}`, "1", "", "")
	f.Add("1", jobID(3), "a.b_c-d", ` {"nested":{"a":[1,2]}} `, "99999999999999", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", "")
	f.Fuzz(func(t *testing.T, ver, id, tenant, payload, at, tp, extra string) {
		fields := map[string]any{"v": ver, "job_id": id, "tenant": tenant, "payload": payload, "enqueued_at": at, "traceparent": tp}
		if ver == FormatVersion {
			fields["kind"] = "kind." + tenant
		}
		if extra != "" {
			fields[extra] = "x"
		}
		m, err := ParseMessage(fields)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		// Whatever parses must validate and survive its own wire format unchanged.
		if err := m.Validate(); err != nil {
			t.Fatalf("parsed message does not validate: %v", err)
		}
		back, err := ParseMessage(fieldsOf(m.Values()))
		if err != nil {
			t.Fatalf("re-parse: %v", err)
		}
		if back.JobID != m.JobID || back.Tenant != m.Tenant || string(back.Payload) != string(m.Payload) ||
			!back.EnqueuedAt.Equal(m.EnqueuedAt) || back.TraceParent != m.TraceParent {
			t.Fatalf("round trip changed the message: %+v -> %+v", m, back)
		}
		if !json.Valid(m.Payload) {
			t.Fatalf("payload %q is not JSON", m.Payload)
		}
	})
}

func FuzzParseDeadLetter(f *testing.F) {
	f.Add("1-1", jobID(1), "acme", `{"a":1}`, "exceeded 3 deliveries", "4", "1700000000000", "")
	f.Add("1-2", "", "", "", "malformed: x", "1", "1", `{"v":"9"}`)
	f.Add("", "x", "y", "{", "", "z", "-", "[")
	f.Fuzz(func(t *testing.T, id, job, tenant, payload, reason, deliveries, failedAt, raw string) {
		fields := map[string]any{"v": "1", "job_id": job, "tenant": tenant, "payload": payload, "enqueued_at": "1",
			"traceparent": "", "reason": reason, "deliveries": deliveries, "original_id": "1-0", "failed_at": failedAt}
		if raw != "" {
			fields["raw"] = raw
		}
		d := ParseDeadLetter(id, fields)
		if d.ID != id || d.Reason != reason {
			t.Fatalf("lost id or reason: %+v", d)
		}
		if d.Message == nil && !json.Valid(d.Raw) {
			t.Fatalf("unreadable record without valid raw JSON: %q", d.Raw)
		}
		if _, err := json.Marshal(d); err != nil {
			t.Fatalf("cannot render %+v: %v", d, err)
		}
	})
}
