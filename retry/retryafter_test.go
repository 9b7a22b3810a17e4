package retry_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
)

var now = time.Date(2026, 10, 21, 7, 28, 0, 0, time.UTC)

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"0", 0, true},
		{"1", time.Second, true},
		{" 120 ", 2 * time.Minute, true},
		{"1.5", 1500 * time.Millisecond, true},
		{"Wed, 21 Oct 2026 07:28:30 GMT", 30 * time.Second, true}, // IMF-fixdate
		{"Wednesday, 21-Oct-26 07:29:00 GMT", time.Minute, true},  // RFC 850
		{"Wed Oct 21 07:28:10 2026", 10 * time.Second, true},      // asctime
		{"Wed, 21 Oct 2026 07:00:00 GMT", 0, true},                // in the past
		{"99999999999999999999999", retry.MaxRetryAfter, true},    // clamped
		{"", 0, false},
		{"-1", 0, false},
		{"+5", 0, false},
		{"1e3", 0, false},
		{"1.2.3", 0, false},
		{".", 0, false},
		{"NaN", 0, false},
		{"Inf", 0, false},
		{"soon", 0, false},
		{"2026-10-21T07:28:30Z", 0, false}, // RFC 3339 is not an HTTP-date
	}
	for _, tc := range cases {
		got, err := retry.ParseRetryAfter(tc.in, now)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, ok=%t", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestParseRetryAfterMs(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{"0": 0, "250": 250 * time.Millisecond, "1500.5": 1500*time.Millisecond + 500*time.Microsecond} {
		if got, err := retry.ParseRetryAfterMs(in); err != nil || got != want {
			t.Errorf("ParseRetryAfterMs(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-5", "abc", "Wed, 21 Oct 2026 07:28:30 GMT"} {
		if _, err := retry.ParseRetryAfterMs(in); err == nil {
			t.Errorf("ParseRetryAfterMs(%q) accepted", in)
		}
	}
}

func TestRetryAfterFromHeaderPrefersMs(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	if _, ok := retry.RetryAfterFromHeader(h, now); ok {
		t.Fatal("no header, ok")
	}
	h.Set("Retry-After", "3")
	if d, ok := retry.RetryAfterFromHeader(h, now); !ok || d != 3*time.Second {
		t.Fatalf("Retry-After 3: %v %v", d, ok)
	}
	h.Set("retry-after-ms", "250")
	if d, ok := retry.RetryAfterFromHeader(h, now); !ok || d != 250*time.Millisecond {
		t.Fatalf("retry-after-ms wins: %v %v", d, ok)
	}
	h.Set("retry-after-ms", "garbage")
	if d, ok := retry.RetryAfterFromHeader(h, now); !ok || d != 3*time.Second {
		t.Fatalf("invalid ms falls back to Retry-After: %v %v", d, ok)
	}
	h.Set("Retry-After", "later")
	if d, ok := retry.RetryAfterFromHeader(h, now); ok {
		t.Fatalf("both invalid, got %v", d)
	}
}

// FuzzParseRetryAfter checks that any header value either fails cleanly or yields a
// duration in [0, MaxRetryAfter], and that plain integers mean seconds.
func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"0", "1", "120", "1.5", " 7 ", "-1", "", "Wed, 21 Oct 2026 07:28:30 GMT",
		"Wednesday, 21-Oct-26 07:29:00 GMT", "Wed Oct 21 07:28:10 2026", "99999999999999999999", "1e9", "0x10", "\x00", "١٢"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := retry.ParseRetryAfter(s, now)
		if err != nil {
			if d != 0 {
				t.Fatalf("error with a duration: %v %v", d, err)
			}
			if len(err.Error()) > 512 {
				t.Fatalf("error message not bounded: %d bytes", len(err.Error()))
			}
			return
		}
		if d < 0 || d > retry.MaxRetryAfter {
			t.Fatalf("ParseRetryAfter(%q) = %v out of range", s, d)
		}
		trimmed := strings.TrimSpace(s)
		if n, ok := smallInt(trimmed); ok && d != time.Duration(n)*time.Second {
			t.Fatalf("ParseRetryAfter(%q) = %v, want %ds", s, d, n)
		}
		ms, errMs := retry.ParseRetryAfterMs(s)
		if errMs == nil && (ms < 0 || ms > retry.MaxRetryAfter) {
			t.Fatalf("ParseRetryAfterMs(%q) = %v out of range", s, ms)
		}
	})
}

func smallInt(s string) (int64, bool) {
	if s == "" || len(s) > 9 {
		return 0, false
	}
	var n int64
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}
