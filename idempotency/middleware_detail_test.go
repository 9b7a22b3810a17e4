package idempotency

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
)

// Details may quote client input (an unknown JSON field's name, say); the error body must
// stay valid JSON whatever that input holds.
func TestWriteDetailIsAlwaysJSON(t *testing.T) {
	for _, detail := range []string{"field \x01\x7f: unknown", "quote \" backslash \\ é \u2028"} {
		rec := httptest.NewRecorder()
		writeDetail(rec, 400, detail)
		var body struct{ Detail string }
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
			t.Fatalf("detail %q gave invalid JSON %q: %v", detail, rec.Body, err)
		}
		if body.Detail != detail {
			t.Fatalf("detail %q came back as %q", detail, body.Detail)
		}
	}
}
