package retry

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// MaxRetryAfter is the largest duration the Retry-After parsers return; longer values
// are clamped to it (Policy.RetryAfterCap then applies its own, much smaller, cap).
const MaxRetryAfter = 1_000_000 * time.Hour

// ParseRetryAfter parses a Retry-After header value (RFC 9110 section 10.2.3): either
// delta-seconds (digits; a decimal fraction such as "1.5" is accepted too, as
// providers' SDKs do) or an HTTP-date, which is turned into a duration from now (a date
// in the past gives 0). Surrounding spaces are ignored; values beyond MaxRetryAfter are
// clamped to it. Anything else, negative numbers included, is an error. It is a pure
// function, safe for concurrent use.
func ParseRetryAfter(v string, now time.Time) (time.Duration, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, errors.New("empty Retry-After")
	}
	if isDecimal(v) {
		return parseDecimal(v, time.Second)
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, fmt.Errorf("Retry-After %q is neither delta-seconds nor an HTTP-date", truncate(v, 64))
	}
	d := t.Sub(now)
	switch {
	case d < 0:
		return 0, nil
	case d > MaxRetryAfter:
		return MaxRetryAfter, nil
	}
	return d, nil
}

// ParseRetryAfterMs parses a retry-after-ms header value (milliseconds, digits with an
// optional decimal fraction), clamped to MaxRetryAfter.
func ParseRetryAfterMs(v string) (time.Duration, error) {
	v = strings.TrimSpace(v)
	if !isDecimal(v) {
		return 0, fmt.Errorf("retry-after-ms %q is not a non-negative number", truncate(v, 64))
	}
	return parseDecimal(v, time.Millisecond)
}

// RetryAfterFromHeader returns the wait a response asks for: retry-after-ms when present
// and valid, else Retry-After (delta-seconds or HTTP-date, relative to now). ok is false
// when neither header is present and valid.
func RetryAfterFromHeader(h http.Header, now time.Time) (d time.Duration, ok bool) {
	if v := h.Get("Retry-After-Ms"); v != "" {
		if d, err := ParseRetryAfterMs(v); err == nil {
			return d, true
		}
	}
	if v := h.Get("Retry-After"); v != "" {
		if d, err := ParseRetryAfter(v, now); err == nil {
			return d, true
		}
	}
	return 0, false
}

// isDecimal reports whether v is digits with at most one '.' and at least one digit.
func isDecimal(v string) bool {
	digits, dots := 0, 0
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c >= '0' && c <= '9':
			digits++
		case c == '.':
			dots++
		default:
			return false
		}
	}
	return digits > 0 && dots <= 1
}

// parseDecimal turns a validated decimal string into unit multiples, clamped.
func parseDecimal(v string, unit time.Duration) (time.Duration, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		// Only a range error is possible for validated input: clamp it.
		return MaxRetryAfter, nil
	}
	if f*float64(unit) >= float64(MaxRetryAfter) {
		return MaxRetryAfter, nil
	}
	return time.Duration(f * float64(unit)), nil
}

func equalFoldTrim(v, want string) bool { return strings.EqualFold(strings.TrimSpace(v), want) }

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
