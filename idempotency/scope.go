package idempotency

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
)

// Scope is what one idempotency key protects: the key is unique per tenant, method and
// path, so two tenants (or two routes) using the same key never see each other's
// results. Tenant comes from the authenticated principal, never from a request header.
type Scope struct {
	Tenant string
	Method string
	Path   string
	Key    string
}

// Encode returns the scope's canonical, unambiguous byte form: a version tag and the four
// fields, each as its decimal length, a colon, the bytes and a comma (netstring style):
//
//	idem1;6:tenant,4:POST,13:/v1/summaries,20:client-key-12345678,
//
// Because every field is length-prefixed, no choice of field values can make two
// different scopes encode alike (a tenant "a:b" with path "c" differs from tenant "a" with
// path "b:c"). The form is stable: derived identifiers (record keys, a route's job id as
// UUIDv5 of Encode) depend on it.
func (s Scope) Encode() []byte {
	n := len("idem1;") + len(s.Tenant) + len(s.Method) + len(s.Path) + len(s.Key) + 4*6
	b := make([]byte, 0, n)
	b = append(b, "idem1;"...)
	for _, f := range [...]string{s.Tenant, s.Method, s.Path, s.Key} {
		b = strconv.AppendInt(b, int64(len(f)), 10)
		b = append(b, ':')
		b = append(b, f...)
		b = append(b, ',')
	}
	return b
}

// Hash returns the lower-case hex SHA-256 of Encode. Stores name records by it, so a
// record's key reveals neither the tenant nor the client's key, and logs use it to refer
// to a key without showing it.
func (s Scope) Hash() string {
	sum := sha256.Sum256(s.Encode())
	return hex.EncodeToString(sum[:])
}
