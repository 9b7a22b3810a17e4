package httpapi

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
)

// Authenticator maps bearer API keys to tenants. The tenant of a request comes only from
// its key, never from a header the client chooses.
type Authenticator struct {
	keys []apiKey
}

type apiKey struct {
	digest [sha256.Size]byte
	tenant string
}

// NewAuthenticator returns an Authenticator for keys, a map from API key to tenant.
func NewAuthenticator(keys map[string]string) *Authenticator {
	a := &Authenticator{}
	for k, tenant := range keys {
		a.keys = append(a.keys, apiKey{sha256.Sum256([]byte(k)), tenant})
	}
	return a
}

// Tenant returns the tenant whose key the request carries in `Authorization: Bearer KEY`,
// or false. Every configured key is compared, in constant time over digests of equal
// length, so neither the position of a match nor the key's length shows in the timing.
func (a *Authenticator) Tenant(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	scheme, key, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || key == "" {
		return "", false
	}
	d := sha256.Sum256([]byte(strings.TrimSpace(key)))
	tenant, found := "", 0
	for _, k := range a.keys {
		if subtle.ConstantTimeCompare(d[:], k.digest[:]) == 1 {
			tenant, found = k.tenant, 1
		}
	}
	return tenant, found == 1
}

// Unauthorized answers a request without a known API key: 401 with
// `WWW-Authenticate: Bearer realm="onceflow"` and {"detail": "missing or unknown API key
// (Authorization: Bearer KEY)"}, the answer of every route of the onceflow command
// (package cli's Host.Unauthorized).
func Unauthorized(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="onceflow"`)
	WriteError(w, http.StatusUnauthorized, "missing or unknown API key (Authorization: Bearer KEY)")
}
