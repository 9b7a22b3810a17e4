package gateway

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzRequestFingerprint: the keyed request's fingerprint and model label never panic,
// the label stays bounded, and a JSON body spelled differently (indented, keys
// reordered by a round trip through a map) has the same fingerprint, so a client that
// re-encodes its retry is not answered 422.
func FuzzRequestFingerprint(f *testing.F) {
	for _, s := range []string{`{"model":"` + strings.Repeat("é", 70) + `"}`, `{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"hi"}]}`, `{"model":1}`, `[]`, `not json`, `{"model":"` + strings.Repeat("m", 100) + `"}`, ``} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r := httptest.NewRequest("POST", "/v1/chat/completions?x=1", nil)
		h := requestHash(r, body)
		if len(h) != 64 {
			t.Fatalf("hash %q", h)
		}
		if m := modelOf(body); utf8.RuneCountInString(m) > 64 || !utf8.ValidString(m) {
			t.Fatalf("model label %q", m)
		}
		var v any
		if json.Unmarshal(body, &v) == nil {
			respelled, _ := json.MarshalIndent(v, "", "  ")
			if json.Valid(body) && requestHash(r, respelled) != h {
				// encoding/json rounds numbers through float64 here; the fingerprint keeps
				// their literal text, so only compare when the round trip kept them.
				if !strings.ContainsAny(string(body), "0123456789") {
					t.Fatalf("respelled body %s has another fingerprint than %s", respelled, body)
				}
			}
		}
	})
}
