package toolkey

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"slices"
	"strings"
)

// ErrInvalidJSON is matched (errors.Is) by CanonicalJSON's errors for input that is not
// exactly one JSON value.
var ErrInvalidJSON = errors.New("toolkey: not a JSON value")

// CanonicalJSON returns the canonical form of one JSON value, so that two encodings of
// the same arguments give the same bytes:
//
//   - object keys are sorted (by their UTF-8 bytes) and there is no insignificant
//     whitespace;
//   - strings are decoded and re-encoded with encoding/json's escaping, HTML escapes
//     off, so \u0041 and A are one string;
//   - numbers are compared by value, exactly (no float64 rounding): 1, 1.0, 1e0, 10e-1
//     and 0.1e1 are all written 1, -0 is 0, and integers of any length keep every
//     digit (see CanonicalNumber).
//
// Two limits come from encoding/json: an object with a repeated key keeps its last
// value (what a Go tool decoding the arguments would see), and invalid UTF-8 becomes
// U+FFFD. Input that is not exactly one JSON value returns an error matching
// ErrInvalidJSON. CanonicalJSON is idempotent (its output is its own canonical form),
// never panics and is safe for concurrent use.
func CanonicalJSON(data []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: data after the first value", ErrInvalidJSON)
	}
	var out bytes.Buffer
	out.Grow(len(data))
	if err := writeCanonical(&out, v); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

func writeCanonical(out *bytes.Buffer, v any) error {
	switch v := v.(type) {
	case nil:
		out.WriteString("null")
	case bool:
		if v {
			out.WriteString("true")
		} else {
			out.WriteString("false")
		}
	case json.Number:
		n, err := CanonicalNumber(string(v))
		if err != nil {
			return err
		}
		out.WriteString(n)
	case string:
		writeString(out, v)
	case []any:
		out.WriteByte('[')
		for i, e := range v {
			if i > 0 {
				out.WriteByte(',')
			}
			if err := writeCanonical(out, e); err != nil {
				return err
			}
		}
		out.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		out.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				out.WriteByte(',')
			}
			writeString(out, k)
			out.WriteByte(':')
			if err := writeCanonical(out, v[k]); err != nil {
				return err
			}
		}
		out.WriteByte('}')
	default:
		return fmt.Errorf("%w: unexpected %T", ErrInvalidJSON, v) // unreachable with encoding/json
	}
	return nil
}

func writeString(out *bytes.Buffer, s string) {
	enc := json.NewEncoder(out)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // a string always encodes
	out.Truncate(out.Len() - 1)
}

// CanonicalNumber returns the canonical text of a JSON number literal: the shortest
// exact decimal with no leading or trailing zeros, written as an integer when its
// value is a whole number below 10^21, as a decimal fraction when its exponent is
// between -6 and 21 (the ranges ECMAScript uses), and otherwise in scientific form
// d.ddde±n. Equal values give equal text whatever their spelling (1.50, 15e-1 and
// 0.15E+1 are 1.5); the conversion is exact for any number of digits and any exponent,
// since it never goes through float64. A literal that is not JSON number syntax
// returns an error matching ErrInvalidJSON.
func CanonicalNumber(lit string) (string, error) {
	bad := func() (string, error) { return "", fmt.Errorf("%w: bad number %.40q", ErrInvalidJSON, lit) }
	s := lit
	neg := false
	if strings.HasPrefix(s, "-") {
		neg, s = true, s[1:]
	}
	intEnd := 0
	for intEnd < len(s) && isDigit(s[intEnd]) {
		intEnd++
	}
	if intEnd == 0 || (s[0] == '0' && intEnd > 1) {
		return bad()
	}
	intPart, rest := s[:intEnd], s[intEnd:]
	var frac string
	if strings.HasPrefix(rest, ".") {
		n := 1
		for n < len(rest) && isDigit(rest[n]) {
			n++
		}
		if n == 1 {
			return bad()
		}
		frac, rest = rest[1:n], rest[n:]
	}
	exp := new(big.Int)
	if rest != "" {
		if rest[0] != 'e' && rest[0] != 'E' {
			return bad()
		}
		e, sign := rest[1:], ""
		if e != "" && (e[0] == '+' || e[0] == '-') {
			if e[0] == '-' {
				sign = "-"
			}
			e = e[1:]
		}
		if !allDigits(e) {
			return bad()
		}
		if _, ok := exp.SetString(sign+e, 10); !ok {
			return bad()
		}
	}

	// value = digits × 10^exp10, with digits stripped of leading and trailing zeros.
	digits := strings.TrimLeft(intPart+frac, "0")
	if digits == "" {
		return "0", nil // 0, -0, 0.000e7 are all zero
	}
	exp10 := new(big.Int).Sub(exp, big.NewInt(int64(len(frac))))
	trimmed := strings.TrimRight(digits, "0")
	exp10.Add(exp10, big.NewInt(int64(len(digits)-len(trimmed))))
	digits = trimmed

	// k is the position of the decimal point relative to the first digit:
	// value = 0.d1d2...dn × 10^k.
	n := len(digits)
	k := new(big.Int).Add(exp10, big.NewInt(int64(n)))
	var b strings.Builder
	if neg {
		b.WriteByte('-')
	}
	switch {
	case exp10.Sign() >= 0 && k.Cmp(big.NewInt(21)) <= 0:
		b.WriteString(digits)
		b.WriteString(strings.Repeat("0", int(exp10.Int64())))
	case k.Sign() > 0 && k.Cmp(big.NewInt(21)) <= 0:
		ki := int(k.Int64())
		b.WriteString(digits[:ki])
		b.WriteByte('.')
		b.WriteString(digits[ki:])
	case k.Sign() <= 0 && k.Cmp(big.NewInt(-6)) > 0:
		b.WriteString("0.")
		b.WriteString(strings.Repeat("0", int(-k.Int64())))
		b.WriteString(digits)
	default:
		b.WriteByte(digits[0])
		if n > 1 {
			b.WriteByte('.')
			b.WriteString(digits[1:])
		}
		b.WriteByte('e')
		sci := new(big.Int).Sub(k, big.NewInt(1))
		if sci.Sign() >= 0 {
			b.WriteByte('+')
		}
		b.WriteString(sci.String())
	}
	return b.String(), nil
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func allDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) {
			return false
		}
	}
	return true
}
