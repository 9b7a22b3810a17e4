package summaries

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

func TestDecodeRequestRefusesABadBodyNamingTheField(t *testing.T) {
	t.Parallel()
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
		// Member names are case-sensitive and may appear once (docs/api.md).
		{`{"TEXT":"x","notify":"a@example.com"}`, "TEXT"},
		{`{"Text":"x","notify":"a@example.com"}`, "Text"},
		{`{"text":"x","NOTIFY":"a@example.com"}`, "NOTIFY"},
		{`{"text":"a","Text":"b","notify":"a@example.com"}`, "Text"},
		{`{"text":"a","text":"b","notify":"a@example.com"}`, "text"},
		{`{"text":"a","notify":"a@example.com","notify":"b@example.com"}`, "notify"},
		{`{"text":"a","te\u0078t":"b","notify":"a@example.com"}`, "text"},
		{`{"text":"a","notify":"a@example.com","":1}`, "body"},
		{`{"text":"\ud800","notify":"a@example.com"}`, "text"},
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
	t.Parallel()
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

// FuzzDecodeRequest checks DecodeRequest against an independent reading of the body
// (encoding/json's tokenizer, which keeps names exactly as sent): an accepted body is
// one object whose member names are exactly "text" and "notify", once each, with the
// values decoded; a refusal is a FieldError, and one about an unknown or duplicate
// member names a member the body has.
func FuzzDecodeRequest(f *testing.F) {
	f.Add([]byte(`{"text":"hello","notify":"a@example.com"}`))
	f.Add([]byte(`{"text":"","notify":""}`))
	f.Add([]byte(`{"text":"x","notify":"a@example.com","z":1}`))
	f.Add([]byte(`{"TEXT":"x","notify":"a@example.com"}`))
	f.Add([]byte(`{"text":"a","Text":"b","notify":"a@example.com"}`))
	f.Add([]byte(`{"text":"a","text":"b","notify":"a@example.com"}`))
	f.Add([]byte(`{"te\u0078t":"a","notify":"a@example.com"}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		names, values, readable := topLevelMembers(body)
		r, err := DecodeRequest(body)
		if err != nil {
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field == "" || fe.Msg == "" {
				t.Fatalf("error %v is not a FieldError naming a field", err)
			}
			if readable && fe.Field != "body" && (fe.Msg == "unknown field" || fe.Msg == "duplicate field") && !slices.Contains(names, fe.Field) {
				t.Fatalf("%s names %q, which is not a member of %q", fe.Msg, fe.Field, body)
			}
			return
		}
		if !readable || len(names) != 2 || !slices.Contains(names, "text") || !slices.Contains(names, "notify") {
			t.Fatalf("accepted %q, whose members are %q: want exactly text and notify, once each", body, names)
		}
		if values["text"] != r.Text || values["notify"] != r.Notify {
			t.Fatalf("accepted %q as %+v, but its members say %q", body, r, values)
		}
		// A valid request survives its canonical form unchanged.
		again, err := DecodeRequest(r.Canonical())
		if err != nil || again != r {
			t.Fatalf("canonical form %s does not decode back: %v", r.Canonical(), err)
		}
	})
}

// topLevelMembers reads body as one JSON object with encoding/json's tokenizer and
// returns its member names in order, and the values of its string members; readable is
// false when body is not one such object.
func topLevelMembers(body []byte) (names []string, values map[string]string, readable bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, nil, false
	}
	values = map[string]string{}
	for dec.More() {
		tok, err := dec.Token()
		name, ok := tok.(string)
		if err != nil || !ok {
			return nil, nil, false
		}
		names = append(names, name)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, nil, false
		}
		var s string
		if json.Unmarshal(raw, &s) == nil {
			values[name] = s
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, nil, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, nil, false
	}
	return names, values, true
}

// A 400 names the field, briefly: a value nested past the decoder's depth limit under
// "text" is a FieldError of "text" (not the whole nesting path, garbled: 20 KB of
// "text.:{.:{....a.a.a"), and an unknown member's name is not echoed whole, however
// long: the detail stays under 1 KiB.
func TestFieldErrorsNameTheFieldBriefly(t *testing.T) {
	t.Parallel()
	deep := strings.Repeat(`{"a":`, 20000) + "1" + strings.Repeat("}", 20000)
	for name, body := range map[string]string{
		"deeply nested text": `{"text":` + deep + `,"notify":"team@example.com"}`,
		"long unknown name":  `{"text":"x","notify":"team@example.com","x` + strings.Repeat("y", 100_000) + `":1}`,
	} {
		_, err := DecodeRequest([]byte(body))
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("%s: %v, want a FieldError", name, err)
		}
		if len(fe.Error()) > 1024 {
			t.Errorf("%s: the 400 detail is %d bytes: %.80q...", name, len(fe.Error()), fe.Error())
		}
		if name == "deeply nested text" && fe.Field != "text" {
			t.Errorf("%s: field %.80q..., want text", name, fe.Field)
		}
	}
}
