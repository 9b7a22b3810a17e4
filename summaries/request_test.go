package summaries

import (
	"errors"
	"strings"
	"testing"
)

func TestDecodeRequest(t *testing.T) {
	long := strings.Repeat("é", MaxTextChars) // 100k characters, 200k bytes: allowed
	cases := []struct {
		body  string
		field string // "" means valid
	}{
		{`{"text":"hello","notify":"a@example.com"}`, ""},
		{` { "notify" : "a@example.com" , "text" : "hello" } `, ""},
		{`{"text":"` + long + `","notify":"a@example.com"}`, ""},
		{`{"text":"` + long + `x","notify":"a@example.com"}`, "text"},
		{`{"text":"","notify":"a@example.com"}`, "text"},
		{`{"text":"   ","notify":"a@example.com"}`, "text"},
		{`{"notify":"a@example.com"}`, "text"},
		{`{"text":5,"notify":"a@example.com"}`, "text"},
		{`{"text":"hi","notify":"nope"}`, "notify"},
		{`{"text":"hi","notify":"Bob <a@example.com>"}`, "notify"},
		{`{"text":"hi","notify":"a@localhost"}`, "notify"},
		{`{"text":"hi"}`, "notify"},
		{`{"text":"hi","notify":"a@example.com","cc":"b@example.com"}`, "cc"},
		{`{"text":"hi","notify":"a@example.com"} {}`, "body"},
		{`[1,2]`, "body"},
		{`{"text":"hi",`, "body"},
		{``, "body"},
		{`nul`, "body"},
		{"{\"text\":\"\xff\",\"notify\":\"a@example.com\"}", "body"},
	}
	for _, tc := range cases {
		name := tc.body
		if len(name) > 60 {
			name = name[:60]
		}
		t.Run(name, func(t *testing.T) {
			_, err := DecodeRequest([]byte(tc.body))
			if tc.field == "" {
				if err != nil {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			var fe *FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("error %v, want a FieldError on %s", err, tc.field)
			}
			if fe.Field != tc.field {
				t.Fatalf("error on %q (%v), want on %q", fe.Field, fe, tc.field)
			}
		})
	}
}

func TestCanonicalIgnoresWhitespaceAndOrder(t *testing.T) {
	a, err := DecodeRequest([]byte(`{"text":"hello","notify":"a@example.com"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := DecodeRequest([]byte("{\n  \"notify\": \"a@example.com\",\n  \"text\": \"hello\"\n}"))
	if err != nil {
		t.Fatal(err)
	}
	if string(a.Canonical()) != string(b.Canonical()) {
		t.Fatalf("%s != %s", a.Canonical(), b.Canonical())
	}
	c, _ := DecodeRequest([]byte(`{"text":"hello!","notify":"a@example.com"}`))
	if string(a.Canonical()) == string(c.Canonical()) {
		t.Fatal("different texts share a canonical form")
	}
}

func FuzzDecodeRequest(f *testing.F) {
	f.Add([]byte(`{"text":"hello","notify":"a@example.com"}`))
	f.Add([]byte(`{"text":"","notify":""}`))
	f.Add([]byte(`{"text":"x","notify":"a@example.com","z":1}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := DecodeRequest(body)
		if err != nil {
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field == "" || fe.Msg == "" {
				t.Fatalf("error %v is not a FieldError naming a field", err)
			}
			return
		}
		// A valid request survives its canonical form unchanged.
		again, err := DecodeRequest(r.Canonical())
		if err != nil || again != r {
			t.Fatalf("canonical form %s does not decode back: %v", r.Canonical(), err)
		}
	})
}
