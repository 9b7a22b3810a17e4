package httpapi

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestAuthenticatorAuthenticatesByKeyOnly(t *testing.T) {
	a := NewAuthenticator(map[string]string{"key-acme-0123456789": "acme", "key-globex-0123456789": "globex"})
	var seen string
	// As the command's routes do: the tenant, or Unauthorized's 401.
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t, ok := a.Tenant(r)
		if !ok {
			Unauthorized(w, r)
			return
		}
		seen = t
	})
	cases := []struct {
		auth, tenantHeader string
		code               int
		tenant             string
	}{
		{"Bearer key-acme-0123456789", "", 200, "acme"},
		{"bearer key-globex-0123456789", "", 200, "globex"},
		{"Bearer key-acme-0123456789", "globex", 200, "acme"}, // a tenant header changes nothing
		{"", "acme", 401, ""},
		{"Bearer ", "", 401, ""},
		{"Basic key-acme-0123456789", "", 401, ""},
		{"Bearer key-acme-012345678", "", 401, ""}, // a prefix of a key
		{"Bearer key-acme-0123456789x", "", 401, ""},
	}
	for _, tc := range cases {
		seen = ""
		r := httptest.NewRequest("GET", "/", nil)
		if tc.auth != "" {
			r.Header.Set("Authorization", tc.auth)
		}
		if tc.tenantHeader != "" {
			r.Header.Set("X-Tenant-Id", tc.tenantHeader)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		if rec.Code != tc.code || seen != tc.tenant {
			t.Errorf("auth %q: code %d tenant %q, want %d %q", tc.auth, rec.Code, seen, tc.code, tc.tenant)
		}
		if rec.Code == 401 && (rec.Header().Get("WWW-Authenticate") != `Bearer realm="onceflow"` ||
			rec.Body.String() != `{"detail":"missing or unknown API key (Authorization: Bearer KEY)"}`+"\n") {
			t.Errorf("auth %q: 401 %v %q, want the API's", tc.auth, rec.Header(), rec.Body)
		}
	}
}
