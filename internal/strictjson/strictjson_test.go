package strictjson_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/strictjson"
)

type address struct {
	City string `json:"city"`
}

type doc struct {
	Text  string    `json:"text"`
	Count int       `json:"count"`
	Tags  []string  `json:"tags"`
	Home  address   `json:"home"`
	List  []address `json:"list"`
}

func TestDecodeRefusesUnknownDuplicateAndMistypedFieldsNamingThem(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		in    string
		kind  strictjson.Kind // "" means accepted
		field string
	}{
		{"valid", `{"text":"a","count":2,"tags":["x"],"home":{"city":"Oslo"}}`, "", ""},
		{"whitespace around", " \n{\"text\":\"a\"}\t\n ", "", ""},
		{"escaped name is the same name", `{"te\u0078t":"a"}`, "", ""},
		{"null leaves the field", `{"text":null}`, "", ""},
		{"upper-case name is unknown", `{"TEXT":"x"}`, strictjson.KindUnknownField, "TEXT"},
		{"title-case name is unknown", `{"text":"a","Text":"b"}`, strictjson.KindUnknownField, "Text"},
		{"unknown name", `{"text":"a","cc":"b"}`, strictjson.KindUnknownField, "cc"},
		{"unknown nested name", `{"home":{"City":"Oslo"}}`, strictjson.KindUnknownField, "home.City"},
		{"unknown name in an array element", `{"list":[{"city":"a"},{"town":"b"}]}`, strictjson.KindUnknownField, "list.1.town"},
		{"empty unknown name", `{"":1}`, strictjson.KindUnknownField, ""},
		{"duplicate name", `{"text":"a","text":"b"}`, strictjson.KindDuplicateField, "text"},
		{"duplicate nested name", `{"home":{"city":"a","city":"b"}}`, strictjson.KindDuplicateField, "home.city"},
		{"duplicate through an escape", `{"text":"a","te\u0078t":"b"}`, strictjson.KindDuplicateField, "text"},
		{"wrong type", `{"text":5}`, strictjson.KindType, "text"},
		{"wrong nested type", `{"home":{"city":[]}}`, strictjson.KindType, "home.city"},
		{"wrong element type", `{"tags":["a",1]}`, strictjson.KindType, "tags.1"},
		{"not an object", `[1,2]`, strictjson.KindType, ""},
		{"out of range", `{"count":1e400}`, strictjson.KindInvalidValue, "count"},
		{"empty", ``, strictjson.KindEmpty, ""},
		{"only whitespace", " \n ", strictjson.KindEmpty, ""},
		{"trailing value", `{"text":"a"} {}`, strictjson.KindTrailingData, ""},
		{"trailing garbage", `{"text":"a"}x`, strictjson.KindTrailingData, ""},
		{"truncated", `{"text":"a"`, strictjson.KindTruncated, ""},
		{"syntax", `{"text":"a",}`, strictjson.KindSyntax, ""},
		{"bad literal", `nul`, strictjson.KindTruncated, ""},
		{"bad word", `nope`, strictjson.KindSyntax, ""},
		{"invalid UTF-8", "{\"text\":\"\xff\"}", strictjson.KindInvalidUTF8, ""},
		{"unpaired surrogate", `{"text":"\ud800"}`, strictjson.KindSyntax, "text"},
		{"syntax inside a value", `{"home":{"city":tru}}`, strictjson.KindSyntax, "home.city"},
		{"truncated inside a string", `{"text":"abc`, strictjson.KindTruncated, "text"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var d doc
			err := strictjson.Decode([]byte(tc.in), &d)
			if tc.kind == "" {
				if err != nil {
					t.Fatalf("Decode(%s): %v", tc.in, err)
				}
				return
			}
			var se *strictjson.Error
			if !errors.As(err, &se) {
				t.Fatalf("Decode(%s) = %v, want a *strictjson.Error", tc.in, err)
			}
			if se.Kind != tc.kind || se.Field != tc.field || se.Msg == "" {
				t.Fatalf("Decode(%s) = {kind %s, field %q, msg %q}, want {kind %s, field %q}", tc.in, se.Kind, se.Field, se.Msg, tc.kind, tc.field)
			}
			if tc.field != "" && !strings.Contains(se.Error(), tc.field) {
				t.Fatalf("message %q does not name %q", se.Error(), tc.field)
			}
		})
	}
}

func TestDecodeFillsEveryFieldOfAValidDocument(t *testing.T) {
	t.Parallel()
	var d doc
	if err := strictjson.Decode([]byte(`{"text":"héllo","count":3,"tags":["a","b"],"home":{"city":"Oslo"},"list":[{"city":"x"}]}`), &d); err != nil {
		t.Fatal(err)
	}
	if d.Text != "héllo" || d.Count != 3 || len(d.Tags) != 2 || d.Home.City != "Oslo" || len(d.List) != 1 || d.List[0].City != "x" {
		t.Fatalf("decoded %+v", d)
	}
}

func TestDecodeUnusableTarget(t *testing.T) {
	t.Parallel()
	var d doc
	err := strictjson.Decode([]byte(`{}`), d) // not a pointer
	var se *strictjson.Error
	if err == nil || errors.As(err, &se) {
		t.Fatalf("Decode into a non-pointer = %v, want a plain error (the caller's bug, not the document's)", err)
	}
}

// Check accepts one JSON value of any type and refuses, with Decode's kinds, what
// Decode refuses of a document: duplicate names at any depth, unpaired surrogates,
// invalid UTF-8, trailing data, an empty body.
func TestCheckAnyValue(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{`{"cents":1250}`, `[1,2]`, `"paid"`, `12345678901234567890`, `null`, ` true `, `{"a":{"b":[{"c":1}]}}`} {
		if err := strictjson.Check([]byte(ok)); err != nil {
			t.Errorf("Check(%s) = %v, want nil", ok, err)
		}
	}
	for doc, kind := range map[string]strictjson.Kind{
		``: strictjson.KindEmpty, `  `: strictjson.KindEmpty, `{"a":1,"a":2}`: strictjson.KindDuplicateField,
		`{"x":{"a":1,"a":2}}`: strictjson.KindDuplicateField, `"\ud800"`: strictjson.KindSyntax, "\"\xff\"": strictjson.KindInvalidUTF8,
		`{"a":1} x`: strictjson.KindTrailingData, `{"a":1}{}`: strictjson.KindTrailingData, `{"a":`: strictjson.KindTruncated, `{a:1}`: strictjson.KindSyntax,
	} {
		var se *strictjson.Error
		if err := strictjson.Check([]byte(doc)); !errors.As(err, &se) || se.Kind != kind {
			t.Errorf("Check(%q) = %v, want a %s error", doc, err, kind)
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, s := range []string{`{"text":"a","count":1}`, `{"TEXT":"a"}`, `{"text":"a","text":"b"}`, `{"home":{"city":"x"}}`, `[]`, ``, `{"text":"a"} x`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var d doc
		err := strictjson.Decode(data, &d)
		if err == nil {
			return
		}
		var se *strictjson.Error
		if !errors.As(err, &se) || se.Kind == "" || se.Msg == "" {
			t.Fatalf("Decode(%q) = %v, want a *strictjson.Error with a kind and a message", data, err)
		}
		if (se.Kind == strictjson.KindUnknownField || se.Kind == strictjson.KindDuplicateField) && se.Field == "" && !strings.HasSuffix(se.Msg, `""`) {
			t.Fatalf("Decode(%q) = %v: no field named", data, err)
		}
	})
}
