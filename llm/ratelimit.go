package llm

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// RateLimit is what a provider's response headers said of its rate limits when it
// answered: OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} and
// Anthropic's anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
// remaining,reset}. Adapters attach it to every Response, final stream Chunk and
// APIError whose answer carried any of them; package limiter learns the fleet's real
// limits from it.
type RateLimit struct {
	// Requests is the requests-per-minute window.
	Requests RateWindow
	// Tokens is the tokens-per-minute window (input and output together).
	Tokens RateWindow
	// InputTokens and OutputTokens are Anthropic's separate token windows.
	InputTokens, OutputTokens RateWindow
}

// RateWindow is one rate limit: its size, what is left of it and when it is whole again.
// A zero field is unknown (the header was absent or unreadable).
type RateWindow struct {
	// Limit is the window's size (requests or tokens per minute); 0 when unknown.
	Limit int64
	// Remaining is what is left now; valid when HasRemaining.
	Remaining    int64
	HasRemaining bool
	// Reset is how long until the window is whole again (OpenAI's reset durations,
	// Anthropic's reset times less the answer's time); valid when HasReset.
	Reset    time.Duration
	HasReset bool
}

// known reports whether any of w's fields was read.
func (w RateWindow) known() bool { return w.Limit > 0 || w.HasRemaining || w.HasReset }

// maxRateValue bounds the limits and remainders ParseRateLimit accepts, and maxRateReset
// the resets: larger values are ignored as nonsense.
const (
	maxRateValue = 1 << 40
	maxRateReset = 24 * time.Hour
)

// ParseRateLimit reads the rate-limit headers of a provider's answer (see RateLimit);
// now turns Anthropic's reset times into durations. ok is false when h carries none of
// them. Unreadable, negative or absurd values (a limit above 2^40, a reset more than a
// day away) are ignored one by one, never an error. It never panics and is safe for
// concurrent use.
func ParseRateLimit(h http.Header, now time.Time) (rl RateLimit, ok bool) {
	if h == nil {
		return RateLimit{}, false
	}
	openai := func(kind string) RateWindow {
		var w RateWindow
		w.Limit, _ = rateValue(h.Get("X-Ratelimit-Limit-" + kind))
		w.Remaining, w.HasRemaining = rateValue(h.Get("X-Ratelimit-Remaining-" + kind))
		w.Reset, w.HasReset = resetDuration(h.Get("X-Ratelimit-Reset-" + kind))
		return w
	}
	anthropic := func(kind string) RateWindow {
		var w RateWindow
		w.Limit, _ = rateValue(h.Get("Anthropic-Ratelimit-" + kind + "-Limit"))
		w.Remaining, w.HasRemaining = rateValue(h.Get("Anthropic-Ratelimit-" + kind + "-Remaining"))
		w.Reset, w.HasReset = resetTime(h.Get("Anthropic-Ratelimit-"+kind+"-Reset"), now)
		return w
	}
	rl.Requests, rl.Tokens = openai("Requests"), openai("Tokens")
	if !rl.Requests.known() {
		rl.Requests = anthropic("Requests")
	}
	if !rl.Tokens.known() {
		rl.Tokens = anthropic("Tokens")
	}
	rl.InputTokens, rl.OutputTokens = anthropic("Input-Tokens"), anthropic("Output-Tokens")
	ok = rl.Requests.known() || rl.Tokens.known() || rl.InputTokens.known() || rl.OutputTokens.known()
	return rl, ok
}

// rateValue parses a non-negative decimal count of at most maxRateValue.
func rateValue(v string) (int64, bool) {
	v = strings.TrimSpace(v)
	if v == "" || len(v) > 20 {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > maxRateValue {
		return 0, false
	}
	return n, true
}

// resetDuration parses OpenAI's reset values: a Go-style duration ("1s", "6m0s",
// "20ms", "1h2m3.5s") or a bare number of seconds ("0.5").
func resetDuration(v string) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" || len(v) > 32 {
		return 0, false
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		f, ferr := strconv.ParseFloat(v, 64)
		if ferr != nil || f != f || f < 0 || f > maxRateReset.Seconds() {
			return 0, false
		}
		d = time.Duration(f * float64(time.Second))
	}
	if d < 0 || d > maxRateReset {
		return 0, false
	}
	return d, true
}

// resetTime parses Anthropic's reset values, RFC 3339 times, as the duration from now
// (0 for a time already past).
func resetTime(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" || len(v) > 64 {
		return 0, false
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return 0, false
	}
	d := t.Sub(now)
	if d > maxRateReset {
		return 0, false
	}
	return max(d, 0), true
}

// RateLimitOf is ParseRateLimit as a pointer for Response.RateLimit, Chunk.RateLimit
// and APIError.RateLimit: nil when h carries no rate-limit header.
func RateLimitOf(h http.Header, now time.Time) *RateLimit {
	rl, ok := ParseRateLimit(h, now)
	if !ok {
		return nil
	}
	return &rl
}
