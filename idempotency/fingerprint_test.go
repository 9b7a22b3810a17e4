package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"testing"
)

func TestCanonicalJSON(t *testing.T) {
	same := []string{
		`{"text":"hello","notify":"a@example.com","n":[1,2.50,{"z":true,"a":null}]}`,
		"{\n  \"notify\" : \"a@example.com\",\n  \"text\": \"hello\",\n \"n\": [ 1, 2.50, {\"a\": null, \"z\": true} ]\n}\n",
		`{"notify":"a@example.com","text":"h\u0065llo","n":[1,2.50,{"a":null,"z":true}]}`,
	}
	want := `{"n":[1,2.50,{"a":null,"z":true}],"notify":"a@example.com","text":"hello"}`
	for _, in := range same {
		got, err := CanonicalJSON([]byte(in))
		if err != nil || string(got) != want {
			t.Errorf("CanonicalJSON(%s) = (%s, %v), want %s", in, got, err, want)
		}
	}
	different := []string{
		`{"n":[1,2.5,{"a":null,"z":true}],"notify":"a@example.com","text":"hello"}`,  // 2.5 is not 2.50
		`{"n":[2.50,1,{"a":null,"z":true}],"notify":"a@example.com","text":"hello"}`, // order of an array matters
		`{"n":[1,2.50,{"a":null,"z":true}],"notify":"a@example.com","text":"hello "}`,
	}
	for _, in := range different {
		got, _ := CanonicalJSON([]byte(in))
		if string(got) == want {
			t.Errorf("CanonicalJSON(%s) equals a different document's form", in)
		}
	}
	big, _ := CanonicalJSON([]byte(`{"id":12345678901234567890123}`))
	if string(big) != `{"id":12345678901234567890123}` {
		t.Errorf("large integer lost digits: %s", big)
	}
	html, _ := CanonicalJSON([]byte(`"<a>&"`))
	if string(html) != `"<a>&"` {
		t.Errorf("HTML characters escaped: %s", html)
	}
	for _, bad := range []string{``, `{`, `{"a":1}{"b":2}`, `{"a":1} x`, `nul`, `{'a':1}`} {
		if _, err := CanonicalJSON([]byte(bad)); !errors.Is(err, ErrInvalidJSON) {
			t.Errorf("CanonicalJSON(%q) = %v, want ErrInvalidJSON", bad, err)
		}
	}
}

func TestDefaultCanonical(t *testing.T) {
	r, _ := http.NewRequest("POST", "/", nil)
	r.Header.Set("Content-Type", "application/json; charset=utf-8")
	got, err := DefaultCanonical(r, []byte(`{ "b":1, "a":2 }`))
	if err != nil || string(got) != `{"a":2,"b":1}` {
		t.Fatalf("JSON body: (%s, %v)", got, err)
	}
	if _, err := DefaultCanonical(r, []byte(`{`)); err == nil {
		t.Fatal("invalid JSON accepted")
	}
	r.Header.Set("Content-Type", "application/merge-patch+json")
	if got, _ := DefaultCanonical(r, []byte(` {"a":1}`)); string(got) != `{"a":1}` {
		t.Fatalf("+json body: %s", got)
	}
	r.Header.Set("Content-Type", "text/plain")
	if got, _ := DefaultCanonical(r, []byte(" raw ")); string(got) != " raw " {
		t.Fatalf("text body: %q", got)
	}
	if got, err := DefaultCanonical(r, nil); err != nil || got != nil {
		t.Fatalf("empty body: (%q, %v)", got, err)
	}
	if Fingerprint([]byte("x")) == Fingerprint([]byte("y")) || len(Fingerprint(nil)) != 64 {
		t.Fatal("Fingerprint is not a SHA-256 hex")
	}
}

// FuzzCanonicalJSON: never panics; the canonical form is valid JSON, a fixed point, and
// the same for the input re-indented (insignificant whitespace never changes it).
func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{`{"a":1,"b":[true,null,"x"]}`, `[1.0, 1e3, -0]`, `"\u00e9\ud83d\ude00"`, `{"a":{"b":{"c":{}}}}`, `{`, ``, `123`, `{"a":1,"a":2}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		c, err := CanonicalJSON(in)
		if err != nil {
			if !errors.Is(err, ErrInvalidJSON) {
				t.Fatalf("error %v does not match ErrInvalidJSON", err)
			}
			return
		}
		if !json.Valid(c) {
			t.Fatalf("canonical form %q is not valid JSON", c)
		}
		again, err := CanonicalJSON(c)
		if err != nil || !bytes.Equal(again, c) {
			t.Fatalf("canonical form is not a fixed point: %q -> %q (%v)", c, again, err)
		}
		var indented bytes.Buffer
		if json.Indent(&indented, in, "", "  ") == nil {
			if ci, err := CanonicalJSON(indented.Bytes()); err != nil || !bytes.Equal(ci, c) {
				t.Fatalf("re-indenting %q changed the canonical form: %q vs %q (%v)", in, ci, c, err)
			}
		}
	})
}
