package idempotency

import (
	"bytes"
	"testing"
)

func TestScopeEncodingCannotCollideAcrossFields(t *testing.T) {
	s := Scope{Tenant: "acme", Method: "POST", Path: "/v1/summaries", Key: key16}
	want := "idem1;4:acme,4:POST,13:/v1/summaries,16:" + key16 + ","
	if got := string(s.Encode()); got != want {
		t.Fatalf("Encode = %q, want %q", got, want)
	}
	if h := s.Hash(); len(h) != 64 || h == (Scope{}).Hash() {
		t.Fatalf("Hash = %q", h)
	}
	// Delimiters inside fields cannot make two scopes collide.
	a := Scope{Tenant: "a:b", Method: "POST", Path: "c", Key: key16}
	b := Scope{Tenant: "a", Method: "POST", Path: "b:c", Key: key16}
	c := Scope{Tenant: "a,1:b", Method: "POST", Path: "c", Key: key16}
	if bytes.Equal(a.Encode(), b.Encode()) || bytes.Equal(a.Encode(), c.Encode()) || a.Hash() == b.Hash() {
		t.Fatal("scopes with shifted delimiters encode alike")
	}
}

// FuzzScopeEncode: two scopes encode alike only when they are equal.
func FuzzScopeEncode(f *testing.F) {
	f.Add("acme", "POST", "/v1/x", key16, "acme", "POST", "/v1/x", key16)
	f.Add("a:b", "POST", "c", key16, "a", "POST", "b:c", key16)
	f.Add("1:a,", "", "", "", "", "1:a,", "", "")
	f.Fuzz(func(t *testing.T, t1, m1, p1, k1, t2, m2, p2, k2 string) {
		a := Scope{t1, m1, p1, k1}
		b := Scope{t2, m2, p2, k2}
		if (a == b) != bytes.Equal(a.Encode(), b.Encode()) {
			t.Fatalf("%+v and %+v: equal %v, encodings equal %v", a, b, a == b, bytes.Equal(a.Encode(), b.Encode()))
		}
	})
}
