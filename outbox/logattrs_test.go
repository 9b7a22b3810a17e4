package outbox

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestLogAttrsNameTheJobWhenThePayloadDoes(t *testing.T) {
	get := func(attrs []any, key string) any {
		for i := 0; i+1 < len(attrs); i += 2 {
			if attrs[i] == key {
				return attrs[i+1]
			}
		}
		return nil
	}
	m := Message{ID: 7, Topic: "email.summary_ready", DedupeKey: "summary_ready:j1",
		Payload: json.RawMessage(`{"job_id":"j1","tenant":"acme","to":"a@example.com"}`)}
	a := logAttrs(m)
	if get(a, "job_id") != "j1" || get(a, "tenant") != "acme" || get(a, "dedupe_key") != "summary_ready:j1" || get(a, "id") != int64(7) {
		t.Fatalf("attrs %v", a)
	}
	if get(a, "to") != nil {
		t.Fatalf("attrs carry payload fields beyond the job: %v", a)
	}
	for _, p := range []string{`[1,2]`, `{"job_id":5}`, `not json`, ``, `{"tenant":null}`} {
		a := logAttrs(Message{ID: 1, Topic: "t", DedupeKey: "k", Payload: json.RawMessage(p)})
		if get(a, "job_id") != nil || get(a, "tenant") != nil || get(a, "dedupe_key") != "k" {
			t.Errorf("payload %q: attrs %v", p, a)
		}
	}
}

// A payload is read from the database; any bytes give bounded, valid attributes.
func FuzzLogAttrs(f *testing.F) {
	f.Add([]byte(`{"job_id":"j1","tenant":"acme"}`), "summary_ready:j1")
	f.Add([]byte(`{"job_id":"`+strings.Repeat("é", 200)+`"}`), strings.Repeat("k", 300))
	f.Fuzz(func(t *testing.T, payload []byte, key string) {
		a := logAttrs(Message{Payload: payload, DedupeKey: key})
		for i := 1; i < len(a); i += 2 {
			if s, ok := a[i].(string); ok && (len(s) > 131 || utf8.ValidString(key) && utf8.ValidString(string(payload)) && !utf8.ValidString(s)) {
				t.Fatalf("attribute %v = %q", a[i-1], s)
			}
		}
	})
}
