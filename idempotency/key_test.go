package idempotency

import (
	"errors"
	"net/http"
	"strings"
	"testing"
)

const key16 = "0123456789abcdef"

func TestParseKeyAcceptsBareAndQuotedKeys(t *testing.T) {
	long := strings.Repeat("k", MaxKeyLen)
	cases := []struct {
		in, want string
	}{
		{key16, key16},
		{" \t" + key16 + " ", key16},
		{`"` + key16 + `"`, key16},
		{long, long},
		{`"` + long + `"`, long},
		{`"` + `a\"b\\c` + strings.Repeat("x", 12) + `"`, `a"b\c` + strings.Repeat("x", 12)},
		{"with space and punct!@#$%^&*()", "with space and punct!@#$%^&*()"},
		{`"  leading spaces inside quotes"`, "  leading spaces inside quotes"},
		{`abc"def\ghi-0123456`, `abc"def\ghi-0123456`}, // bare keys may contain " and \ after the first byte
		{"550e8400-e29b-41d4-a716-446655440000", "550e8400-e29b-41d4-a716-446655440000"},
	}
	for _, c := range cases {
		got, err := ParseKey(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseKey(%q) = (%q, %v), want %q", c.in, got, err, c.want)
		}
	}
}

func TestParseKeyErrors(t *testing.T) {
	cases := []struct {
		in     string
		detail string // a fragment of the detail
	}{
		{strings.Repeat("k", MinKeyLen-1), "16 to 128 characters, got 15"},
		{strings.Repeat("k", MaxKeyLen+1), "got 129"},
		{`"` + strings.Repeat("k", MaxKeyLen+1) + `"`, "got 129"},
		// The escapes do not count: 15 characters of content.
		{`"` + `\"\"\"` + strings.Repeat("k", 12) + `"`, "got 15"},
		{key16 + "\x7f", "printable ASCII"},
		{key16 + "é", "printable ASCII"},
		{"\x00" + key16, "printable ASCII"},
		{`"` + key16, "no closing quote"},
		{`"` + key16 + `"x`, "after its closing quote"},
		{`"` + key16 + `\n"`, "invalid escape"},
		{`"` + key16 + `\`, "inside an escape"},
		{`"` + key16 + "\t" + `"`, "printable ASCII"},
	}
	for _, c := range cases {
		_, err := ParseKey(c.in)
		var ke *KeyError
		if !errors.As(err, &ke) || !errors.Is(err, ErrMalformedKey) || errors.Is(err, ErrMissingKey) {
			t.Errorf("ParseKey(%q) = %v, want a malformed-key error", c.in, err)
			continue
		}
		if !strings.Contains(ke.Detail, c.detail) || !strings.HasPrefix(ke.Detail, "Idempotency-Key") {
			t.Errorf("ParseKey(%q) detail %q, want it to mention %q", c.in, ke.Detail, c.detail)
		}
		if len(c.in) > 3 && strings.Contains(ke.Detail, strings.Trim(c.in, `"`)) {
			t.Errorf("detail %q repeats the key", ke.Detail)
		}
	}
	for _, in := range []string{"", "  ", "\t"} {
		if _, err := ParseKey(in); !errors.Is(err, ErrMissingKey) || errors.Is(err, ErrMalformedKey) {
			t.Errorf("ParseKey(%q) = %v, want ErrMissingKey", in, err)
		}
	}
}

func TestKeyFromRequest(t *testing.T) {
	h := http.Header{}
	if _, err := KeyFromRequest(h); !errors.Is(err, ErrMissingKey) {
		t.Fatalf("no header: %v", err)
	}
	if ErrMissingKey.Detail != "Idempotency-Key header is required" {
		t.Fatalf("missing-key detail %q", ErrMissingKey.Detail)
	}
	h.Set(HeaderKey, QuoteKey(key16))
	if k, err := KeyFromRequest(h); err != nil || k != key16 {
		t.Fatalf("quoted header: (%q, %v)", k, err)
	}
	h.Add(HeaderKey, key16)
	if _, err := KeyFromRequest(h); !errors.Is(err, ErrMalformedKey) {
		t.Fatalf("two header lines: %v, want malformed", err)
	}
}

func TestQuoteKeyEscapesQuotesAndBackslashes(t *testing.T) {
	if got := QuoteKey(`a"b\c`); got != `"a\"b\\c"` {
		t.Fatalf("QuoteKey = %s", got)
	}
}

// FuzzParseKey: ParseKey never panics; every key it accepts is valid content that
// round-trips through QuoteKey; and any valid content parses to itself in both forms
// (bare where the bare form can carry it).
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{key16, `"` + key16 + `"`, `"a\"b\\c0123456789abcdef"`, "", `"`, `"\`, "\x00", strings.Repeat("z", 200), ` "x" `} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := ParseKey(in)
		if err != nil {
			var ke *KeyError
			if !errors.As(err, &ke) || ke.Detail == "" {
				t.Fatalf("ParseKey(%q) error %v is not a *KeyError with a detail", in, err)
			}
		} else {
			if !validContent(key) {
				t.Fatalf("ParseKey(%q) accepted invalid content %q", in, key)
			}
			if again, err := ParseKey(QuoteKey(key)); err != nil || again != key {
				t.Fatalf("quoted round trip of %q = (%q, %v)", key, again, err)
			}
		}
		// Treat the input as content: if valid, both forms must parse to it.
		if validContent(in) {
			if got, err := ParseKey(QuoteKey(in)); err != nil || got != in {
				t.Fatalf("quoted form of %q = (%q, %v)", in, got, err)
			}
			if in[0] != '"' && strings.Trim(in, " \t") == in {
				if got, err := ParseKey(in); err != nil || got != in {
					t.Fatalf("bare form of %q = (%q, %v)", in, got, err)
				}
			}
		}
	})
}

func validContent(s string) bool {
	if len(s) < MinKeyLen || len(s) > MaxKeyLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
