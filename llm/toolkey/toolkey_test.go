package toolkey_test

import (
	"encoding/json"
	"errors"
	"math/big"
	"regexp"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
)

func TestCanonicalNumberSpellsEachNumberOneWayAndRefusesInvalidOnes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"0", "0"}, {"-0", "0"}, {"0.000", "0"}, {"0e99", "0"}, {"-0.0e-5", "0"},
		{"1", "1"}, {"1.0", "1"}, {"1e0", "1"}, {"1E+0", "1"}, {"10e-1", "1"}, {"0.1e1", "1"}, {"100e-2", "1"},
		{"-1.50", "-1.5"}, {"15e-1", "1.5"}, {"0.15E+1", "1.5"},
		{"100", "100"}, {"1e2", "100"}, {"1.00e2", "100"},
		{"123456789012345678901", "123456789012345678901"}, // 21 digits: still an integer
		{"1e21", "1e+21"}, {"1234567890123456789012", "1.234567890123456789012e+21"},
		{"12345678901234567890123456789", "1.2345678901234567890123456789e+28"}, // no float64 rounding
		{"0.000001", "0.000001"}, {"1e-6", "0.000001"}, {"1e-7", "1e-7"}, {"0.00000012", "1.2e-7"},
		{"3.14159", "3.14159"}, {"314159e-5", "3.14159"},
		{"1e400", "1e+400"}, {"-2.5e-400", "-2.5e-400"},
		{"1e99999999999999999999", "1e+99999999999999999999"},
	} {
		got, err := toolkey.CanonicalNumber(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("CanonicalNumber(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "-", "01", "1.", ".5", "1e", "1e+", "+1", "1x", "0x10", "1.2.3", "--1", "1e-+2", "NaN", "Infinity"} {
		if got, err := toolkey.CanonicalNumber(bad); !errors.Is(err, toolkey.ErrInvalidJSON) {
			t.Errorf("CanonicalNumber(%q) = %q, %v; want ErrInvalidJSON", bad, got, err)
		}
	}
}

func TestCanonicalJSONIgnoresSpelling(t *testing.T) {
	t.Parallel()
	groups := [][]string{
		{
			`{"order":"A-17","amount":10,"refund":true}`,
			"{ \"refund\" : true,\n\t\"amount\": 10.0, \"order\": \"A-\\u0031\\u0037\" }",
			`{"amount":1e1,"order":"A-17","refund":true}`,
			`{"amount":100e-1,"refund":true,"order":"A-17"}`,
		},
		{`[1, 2.0, {"b":null,"a":[]}]`, `[1e0,2,{"a":[],"b":null}]`},
		{`"<&>"`, `"\u003c\u0026\u003e"`},
	}
	for _, g := range groups {
		want, err := toolkey.CanonicalJSON([]byte(g[0]))
		if err != nil {
			t.Fatal(err)
		}
		for _, in := range g[1:] {
			got, err := toolkey.CanonicalJSON([]byte(in))
			if err != nil || string(got) != string(want) {
				t.Errorf("CanonicalJSON(%s) = %s, %v; want %s", in, got, err, want)
			}
		}
	}
	got, _ := toolkey.CanonicalJSON([]byte(`{"b":1,"a":"<x>"}`))
	if string(got) != `{"a":"<x>","b":1}` {
		t.Errorf("canonical form %s", got)
	}
	// Different values stay different.
	for _, pair := range [][2]string{{`{"a":1}`, `{"a":1.5}`}, {`{"a":1}`, `{"a":"1"}`}, {`[1,2]`, `[2,1]`}, {`{"a":null}`, `{}`}} {
		a, _ := toolkey.CanonicalJSON([]byte(pair[0]))
		b, _ := toolkey.CanonicalJSON([]byte(pair[1]))
		if string(a) == string(b) {
			t.Errorf("%s and %s have one canonical form %s", pair[0], pair[1], a)
		}
	}
	for _, bad := range []string{``, `{`, `{"a":1} x`, `{"a":01}`, `[1,]`, `nul`} {
		if _, err := toolkey.CanonicalJSON([]byte(bad)); !errors.Is(err, toolkey.ErrInvalidJSON) {
			t.Errorf("CanonicalJSON(%q): err %v, want ErrInvalidJSON", bad, err)
		}
	}
}

func TestToolKeysTellCallsApart(t *testing.T) {
	t.Parallel()
	a := llm.ToolCall{ID: "call_1", Name: "refund", Arguments: `{"order":"A-17","amount":10}`}
	b := llm.ToolCall{ID: "call_2", Name: "refund", Arguments: `{ "amount": 1e1, "order": "A-17" }`}
	t.Run("ArgsKey is one for a call spelled differently with another id", func(t *testing.T) {
		if toolkey.ArgsKey("req-1", a) != toolkey.ArgsKey("req-1", b) {
			t.Error("ArgsKey differs for the same call spelled differently with another id")
		}
	})
	t.Run("ArgsKey differs by request and by tool", func(t *testing.T) {
		if toolkey.ArgsKey("req-1", a) == toolkey.ArgsKey("req-2", a) {
			t.Error("ArgsKey ignores the request key: two jobs' identical calls would collapse")
		}
		if toolkey.ArgsKey("req-1", a) == toolkey.ArgsKey("req-1", llm.ToolCall{Name: "charge", Arguments: a.Arguments}) {
			t.Error("ArgsKey ignores the tool name")
		}
	})
	t.Run("IDKey differs by id and is unambiguous across its parts", func(t *testing.T) {
		if toolkey.IDKey("req-1", a.ID) == toolkey.IDKey("req-1", b.ID) {
			t.Error("IDKey equal for two ids")
		}
		// Length-prefixing: shifting characters between parts changes the key.
		if toolkey.IDKey("ab", "c") == toolkey.IDKey("a", "bc") {
			t.Error("IDKey is ambiguous across its parts")
		}
	})
	t.Run("Key takes the id only when ids are stable and the call has one", func(t *testing.T) {
		if toolkey.Key("r", a, true) != toolkey.IDKey("r", "call_1") || toolkey.Key("r", a, false) != toolkey.ArgsKey("r", a) ||
			toolkey.Key("r", llm.ToolCall{Name: "x", Arguments: "{}"}, true) != toolkey.ArgsKey("r", llm.ToolCall{Name: "x", Arguments: "{}"}) {
			t.Error("Key does not choose as documented")
		}
	})
	t.Run("invalid arguments are keyed by their exact bytes", func(t *testing.T) {
		// Invalid JSON arguments still get a key, matching only an identical repeat.
		bad := llm.ToolCall{Name: "refund", Arguments: `{"order": A-17}`}
		again := llm.ToolCall{ID: "other", Name: "refund", Arguments: `{"order": A-17}`}
		if toolkey.ArgsKey("r", bad) != toolkey.ArgsKey("r", again) || toolkey.ArgsKey("r", bad) == toolkey.ArgsKey("r", llm.ToolCall{Name: "refund", Arguments: `{"order":  A-17}`}) {
			t.Error("invalid arguments are not keyed by their exact bytes")
		}
	})
	t.Run("a key is tool- and 64 hex digits", func(t *testing.T) {
		key := toolkey.IDKey("r", "x")
		if !regexp.MustCompile(`^tool-[0-9a-f]{64}$`).MatchString(key) {
			t.Errorf("key %q", key)
		}
	})
}

func TestCompareTellsWhetherAProvidersToolCallIDsAreStable(t *testing.T) {
	t.Parallel()
	call := func(id, args string) llm.ToolCall { return llm.ToolCall{ID: id, Name: "refund", Arguments: args} }
	for _, tc := range []struct {
		name          string
		first, second []llm.ToolCall
		want          toolkey.Stability
	}{
		{"same ids", []llm.ToolCall{call("c1", `{"a":1}`)}, []llm.ToolCall{call("c1", `{"a":1.0}`)}, toolkey.Stable},
		{"new id", []llm.ToolCall{call("c1", `{"a":1}`)}, []llm.ToolCall{call("c9", `{"a":1}`)}, toolkey.Unstable},
		{"different calls", []llm.ToolCall{call("c1", `{"a":1}`)}, []llm.ToolCall{call("c2", `{"a":2}`)}, toolkey.Unknown},
		{"no ids", []llm.ToolCall{call("", `{"a":1}`)}, []llm.ToolCall{call("", `{"a":1}`)}, toolkey.Unknown},
		{"repeated calls matched in order", []llm.ToolCall{call("c1", `{}`), call("c2", `{}`)}, []llm.ToolCall{call("c1", `{}`), call("c2", `{}`)}, toolkey.Stable},
		{"one of two changed", []llm.ToolCall{call("c1", `{}`), call("c2", `{}`)}, []llm.ToolCall{call("c1", `{}`), call("c3", `{}`)}, toolkey.Unstable},
	} {
		if got := toolkey.Compare(tc.first, tc.second); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	if toolkey.Unstable.String() != "unstable" || toolkey.Stable.String() != "stable" || toolkey.Unknown.String() != "unknown" {
		t.Error("Stability.String")
	}
}

// numberSyntax is JSON's number grammar (RFC 8259 section 6).
var numberSyntax = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$`)

func FuzzCanonicalNumber(f *testing.F) {
	for _, s := range []string{"0", "-0", "1.0", "1e0", "10e-1", "123456789012345678901234567890", "1e-7", "1e21", "-2.5E+3", "01", "1.", "1e", "0.1e1", "1e99999"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, lit string) {
		got, err := toolkey.CanonicalNumber(lit)
		if !numberSyntax.MatchString(lit) {
			if err == nil {
				t.Fatalf("CanonicalNumber(%q) = %q, want an error for non-number syntax", lit, got)
			}
			return
		}
		if err != nil {
			t.Fatalf("CanonicalNumber(%q): %v", lit, err)
		}
		if !numberSyntax.MatchString(got) {
			t.Fatalf("CanonicalNumber(%q) = %q is not a JSON number", lit, got)
		}
		again, err := toolkey.CanonicalNumber(got)
		if err != nil || again != got {
			t.Fatalf("not idempotent: %q -> %q -> %q, %v", lit, got, again, err)
		}
		// Same value, exactly (big.Rat parses decimal exponents), when the exponent is
		// small enough to expand.
		if exponentSmall(lit) && exponentSmall(got) {
			a, ok1 := new(big.Rat).SetString(lit)
			b, ok2 := new(big.Rat).SetString(got)
			if !ok1 || !ok2 || a.Cmp(b) != 0 {
				t.Fatalf("CanonicalNumber(%q) = %q changes the value", lit, got)
			}
		}
	})
}

func exponentSmall(lit string) bool {
	i := strings.IndexAny(lit, "eE")
	if i < 0 {
		return len(lit) < 400
	}
	e := strings.TrimLeft(lit[i+1:], "+-")
	return len(e) <= 3 && len(lit) < 400
}

func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{`{"a":1,"b":[1.0,2e0,"x"]}`, `{"b":1,"a":1}`, `[]`, `"\u00e9"`, `{"a":{"a":{"a":null}}}`, `{"a":1,"a":2}`, `{`, `1 2`, "\"\xff\""} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		canon, err := toolkey.CanonicalJSON(data)
		if err != nil {
			if !errors.Is(err, toolkey.ErrInvalidJSON) {
				t.Fatalf("error %v does not match ErrInvalidJSON", err)
			}
			if json.Valid(data) {
				t.Fatalf("valid JSON %q rejected: %v", data, err)
			}
			return
		}
		if !json.Valid(canon) {
			t.Fatalf("canonical form %q of %q is not valid JSON", canon, data)
		}
		again, err := toolkey.CanonicalJSON(canon)
		if err != nil || string(again) != string(canon) {
			t.Fatalf("not idempotent: %q -> %q -> %q, %v", data, canon, again, err)
		}
		// Re-encoding the decoded value (another spelling of the same value) gives the
		// same canonical form.
		var v any
		dec := json.NewDecoder(strings.NewReader(string(data)))
		dec.UseNumber()
		if dec.Decode(&v) == nil {
			respelled, _ := json.MarshalIndent(v, "", "   ")
			other, err := toolkey.CanonicalJSON(respelled)
			if err != nil || string(other) != string(canon) {
				t.Fatalf("respelled %q gives %q, want %q (%v)", respelled, other, canon, err)
			}
		}
	})
}
