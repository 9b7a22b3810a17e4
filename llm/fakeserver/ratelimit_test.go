package fakeserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/anthropic"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/retry"
)

// testClock is a clock tests move by hand.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newTestClock() *testClock {
	return &testClock{t: time.Date(2025, 3, 14, 9, 26, 53, 0, time.UTC)}
}

func (c *testClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// startLimited serves a server with cfg's limits on the clock c (nil: the real clock).
func startLimited(t *testing.T, cfg Config, c *testClock) (*Server, string) {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if s.limits == nil {
		t.Fatal("no limits configured")
	}
	if c != nil {
		s.limits.now = c.now
	}
	ts := httptest.NewServer(s)
	t.Cleanup(func() { s.Close(); ts.Close() })
	return s, ts.URL
}

const (
	rlSystem = "be brief"
	rlUser   = "Summarise for the account team:\n\nThe March invoice was charged twice and the customer wants a refund by Friday."
)

// rlBody is an OpenAI request of rlSystem and rlUser for model, with extra fields.
func rlBody(model, extra string) string {
	u, _ := json.Marshal(rlUser)
	return fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":%s}]%s}`, model, rlSystem, u, extra)
}

// rlEstimate is what the limiter charges for rlBody with max_tokens maxTokens (0: none).
func rlEstimate(maxTokens int) int {
	return llm.EstimateTokens(&llm.Request{MaxTokens: maxTokens, Messages: []llm.Message{
		{Role: llm.RoleSystem, Content: rlSystem}, {Role: llm.RoleUser, Content: rlUser}}})
}

func rlPost(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp, b
}

// usageOf returns the usage (prompt plus completion) of an OpenAI completion.
func usageOf(t *testing.T, b []byte) int {
	t.Helper()
	var c struct {
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &c); err != nil || c.Usage.PromptTokens+c.Usage.CompletionTokens == 0 {
		t.Fatalf("no usage in %s: %v", b, err)
	}
	return c.Usage.PromptTokens + c.Usage.CompletionTokens
}

// settled waits until s has finished every answer (and so settled its charges): a
// client reads a stream's last byte before the handler corrects the bucket.
func settled(t *testing.T, s *Server) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().InFlight != 0 {
		if time.Now().After(deadline) {
			t.Fatal("answers still in flight")
		}
		time.Sleep(time.Millisecond)
	}
}

// untilFull is the reset the headers must say for a bucket of limit at level.
func untilFull(limit, level float64) time.Duration {
	return time.Duration(float64(time.Minute) * (limit - level) / limit).Round(time.Millisecond)
}

// wantWindow checks one window of rl against limit and the bucket's level.
func wantWindow(t *testing.T, what string, w llm.RateWindow, limit int64, level float64) {
	t.Helper()
	remaining := max(0, int64(math.Floor(level)))
	if w.Limit != limit || !w.HasRemaining || w.Remaining != remaining || !w.HasReset || w.Reset != untilFull(float64(limit), level) {
		t.Fatalf("%s window %+v, want limit %d remaining %d reset %v", what, w, limit, remaining, untilFull(float64(limit), level))
	}
}

// The buckets' arithmetic: full at first, continuous refill, a refusal takes nothing,
// settle corrects the token charge within [-limit, limit], cancel gives it all back,
// and a request larger than the token limit is charged the limit.
func TestRateBucketArithmetic(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	l := newRateLimits(60, 1000)
	l.now = c.now
	level := func(model string) (float64, float64) {
		st := l.state(model, true)
		l.mu.Lock()
		defer l.mu.Unlock()
		m := l.models[model]
		if m == nil {
			return float64(st.requests.remaining), float64(st.tokens.remaining)
		}
		return m.req.level, m.tok.level
	}
	if r, tok := level("m"); r != 60 || tok != 1000 {
		t.Fatalf("fresh buckets %v %v, want full", r, tok)
	}
	a, rej := l.admit("m", 400)
	if rej != nil {
		t.Fatalf("refused a full bucket: %+v", rej)
	}
	if r, tok := level("m"); r != 59 || tok != 600 {
		t.Fatalf("after one request %v %v, want 59 600", r, tok)
	}
	a.settle(100) // used 100 of the 400 charged
	a.settle(0)   // a second settle does nothing
	if _, tok := level("m"); tok != 900 {
		t.Fatalf("after settle %v, want 900", tok)
	}
	if _, rej := l.admit("m", 901); rej == nil || rej.kind != "tokens" || rej.requested != 901 || rej.used != 100 || rej.wait != 60*time.Millisecond {
		t.Fatalf("901 tokens of 900: %+v, want a tokens refusal waiting 60ms", rej)
	}
	if r, tok := level("m"); r != 59 || tok != 900 {
		t.Fatalf("a refusal took something: %v %v", r, tok)
	}
	c.add(3 * time.Second) // 3 requests and 50 tokens back
	if r, tok := level("m"); r != 60 || tok != 950 {
		t.Fatalf("after 3s %v %v, want 60 (capped) 950", r, tok)
	}
	b, _ := l.admit("m", 5000) // larger than the limit: charged the limit, so it passes only when full
	if b != nil {
		t.Fatal("an oversize request passed a bucket that is not full")
	}
	c.add(3 * time.Second)
	b, rej = l.admit("m", 5000)
	if rej != nil || b.tokens != 1000 {
		t.Fatalf("oversize on a full bucket: %+v %+v, want charged 1000", b, rej)
	}
	b.settle(2500) // used more than the whole limit: the bucket goes below zero, not below -limit
	if _, tok := level("m"); tok != -1000 {
		t.Fatalf("after an overrun %v, want -1000", tok)
	}
	if st := l.state("m", true); st.tokens.remaining != 0 || st.tokens.reset != 2*time.Minute {
		t.Fatalf("state of an overdrawn bucket %+v, want remaining 0 and 2m to full", *st.tokens)
	}
	c.add(2 * time.Minute)
	x, _ := l.admit("m", 10)
	x.cancel()
	if r, tok := level("m"); r != 60 || tok != 1000 {
		t.Fatalf("after cancel %v %v, want full", r, tok)
	}
	// Models do not share buckets.
	for range 60 {
		if _, rej := l.admit("a", 1); rej != nil {
			t.Fatalf("model a refused early: %+v", rej)
		}
	}
	if _, rej := l.admit("a", 1); rej == nil || rej.kind != "requests" || rej.wait != time.Second || rej.used != 60 {
		t.Fatalf("61st request: %+v, want a requests refusal waiting 1s", rej)
	}
	if _, rej := l.admit("b", 1); rej != nil {
		t.Fatalf("model b refused because of model a: %+v", rej)
	}
}

// An exhausted request bucket answers OpenAI's 429: rate_limit_exceeded of type
// requests, Retry-After and retry-after-ms until a request fits, and the headers; it
// takes nothing and counts in /stats.
func TestRateLimitRefusesWithHeadersWhenExhausted(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	s, url := startLimited(t, Config{RPM: 3}, c)
	for i := range 3 {
		if resp, b := rlPost(t, url+"/v1/chat/completions", rlBody("gpt-4.1-mini", "")); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	c.add(5 * time.Second)
	resp, b := rlPost(t, url+"/v1/chat/completions", rlBody("gpt-4.1-mini", ""))
	eb, ok := llm.ParseErrorBody(b)
	if resp.StatusCode != 429 || !ok || eb.Type != "requests" || eb.Code != "rate_limit_exceeded" || !strings.Contains(eb.Message, "Limit 3") {
		t.Fatalf("4th request: %d %s", resp.StatusCode, b)
	}
	if retry.IsQuota(eb.Type, eb.Code) {
		t.Fatalf("the 429 reads as a quota stop: %s", b)
	}
	// 3 per minute is one every 20s; 5s have passed, so a request fits in 15s.
	if got := resp.Header.Get("Retry-After"); got != "15" {
		t.Fatalf("Retry-After %q, want 15", got)
	}
	if got := resp.Header.Get("Retry-After-Ms"); got != "15000" {
		t.Fatalf("retry-after-ms %q, want 15000", got)
	}
	rl, ok := llm.ParseRateLimit(resp.Header, c.now())
	if !ok {
		t.Fatalf("no rate-limit headers: %v", resp.Header)
	}
	wantWindow(t, "requests", rl.Requests, 3, 0.25)
	if rl.Tokens.Limit != 0 || resp.Header.Get("X-Ratelimit-Limit-Tokens") != "" {
		t.Fatalf("token headers without --tpm: %v", resp.Header)
	}
	if st := s.Stats(); st.RateLimited != 1 || st.ByStatus["429"] != 1 || st.ByStatus["200"] != 3 || st.Requests != 4 {
		t.Fatalf("stats %+v", st)
	}
	c.add(15 * time.Second)
	if resp, b := rlPost(t, url+"/v1/chat/completions", rlBody("gpt-4.1-mini", "")); resp.StatusCode != 200 {
		t.Fatalf("after the Retry-After: %d %s", resp.StatusCode, b)
	}
}

// Every answer of a model endpoint of a limited server carries the headers, and
// llm.ParseRateLimit reads back exactly what the buckets hold: plain answers, streams,
// injected faults, bad requests, and Anthropic's endpoint with Anthropic's headers.
func TestRateLimitHeadersOnEveryAnswer(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	const rpm, tpm = 100, 20000
	s, url := startLimited(t, Config{RPM: rpm, TPM: tpm}, c)
	chat := url + "/v1/chat/completions"
	reqs, toks := float64(rpm), float64(tpm)
	check := func(what string, resp *http.Response) {
		t.Helper()
		rl, ok := llm.ParseRateLimit(resp.Header, c.now())
		if !ok {
			t.Fatalf("%s: no rate-limit headers: %v", what, resp.Header)
		}
		wantWindow(t, what+" requests", rl.Requests, rpm, reqs)
		wantWindow(t, what+" tokens", rl.Tokens, tpm, toks)
	}

	resp, b := rlPost(t, chat, rlBody("gpt-4.1-mini", `,"max_tokens":300`))
	usage := usageOf(t, b)
	reqs, toks = reqs-1, toks-float64(usage) // a plain answer is corrected before its headers
	check("plain 200", resp)

	c.add(1234 * time.Millisecond)
	reqs, toks = min(rpm, reqs+1.234*rpm/60), min(tpm, toks+1.234*tpm/60)
	resp, err := http.Post(chat, "application/json", strings.NewReader(rlBody("gpt-4.1-mini", `,"max_tokens":300,"stream":true`)))
	if err != nil {
		t.Fatal(err)
	}
	reqs, toks = reqs-1, toks-float64(rlEstimate(300)) // a stream's headers come before its correction
	check("stream", resp)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	settled(t, s)
	toks += float64(rlEstimate(300) - usage) // the same prompt, the same usage

	s.Script(Fault{Kind: Fault503})
	resp, _ = rlPost(t, chat, rlBody("gpt-4.1-mini", `,"max_tokens":300`))
	if resp.StatusCode != 503 {
		t.Fatalf("scripted 503: %d", resp.StatusCode)
	}
	reqs-- // an error answer costs its request, no tokens
	check("503", resp)

	s.Script(Fault{Kind: Fault429})
	resp, _ = rlPost(t, chat, rlBody("gpt-4.1-mini", `,"max_tokens":300`))
	if resp.StatusCode != 429 {
		t.Fatalf("scripted 429: %d", resp.StatusCode)
	}
	check("injected 429", resp) // takes nothing; its own made-up headers are replaced

	resp, _ = rlPost(t, chat, rlBody("gpt-4.1-mini", `,"temperature":5`))
	if resp.StatusCode != 400 {
		t.Fatalf("bad temperature: %d", resp.StatusCode)
	}
	check("400", resp) // refused before admission: nothing taken

	resp, _ = rlPost(t, chat, `{"model":`)
	rl, ok := llm.ParseRateLimit(resp.Header, c.now())
	if resp.StatusCode != 400 || !ok || rl.Requests.Limit != rpm || rl.Tokens.Limit != tpm || rl.Requests.HasRemaining || rl.Tokens.HasReset {
		t.Fatalf("unreadable request: %d %+v, want the limits only", resp.StatusCode, rl)
	}

	// Another model has its own, full buckets.
	resp, b = rlPost(t, chat, rlBody("gpt-4.1", `,"max_tokens":300`))
	rl, _ = llm.ParseRateLimit(resp.Header, c.now())
	if rl.Requests.Remaining != rpm-1 || rl.Tokens.Remaining != int64(tpm-usageOf(t, b)) {
		t.Fatalf("gpt-4.1 shares gpt-4.1-mini's buckets: %+v", rl)
	}

	// Anthropic's endpoint: the same buckets, Anthropic's headers (resets as times).
	c.add(250 * time.Millisecond)
	reqs, toks = min(rpm, reqs+0.25*rpm/60), min(tpm, toks+0.25*tpm/60)
	u, _ := json.Marshal(rlUser)
	resp, b = rlPost(t, url+"/v1/messages", fmt.Sprintf(`{"model":"gpt-4.1-mini","max_tokens":300,"system":%q,"messages":[{"role":"user","content":%s}]}`, rlSystem, u))
	if resp.StatusCode != 200 || resp.Header.Get("X-Ratelimit-Limit-Requests") != "" {
		t.Fatalf("messages: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	var msg struct {
		Usage struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &msg); err != nil || msg.Usage.InputTokens == 0 || msg.Usage.OutputTokens == 0 {
		t.Fatalf("no usage in %s: %v", b, err)
	}
	reqs, toks = reqs-1, toks-float64(msg.Usage.InputTokens+msg.Usage.OutputTokens)
	rl, ok = llm.ParseRateLimit(resp.Header, c.now())
	if !ok || rl.Requests.Limit != rpm || rl.Requests.Remaining != int64(reqs) || rl.Tokens.Limit != tpm || rl.Tokens.Remaining != int64(toks) {
		t.Fatalf("anthropic headers %+v (%v), want %v requests and %v tokens left", rl, resp.Header, reqs, toks)
	}
	// An RFC 3339 reset has whole seconds, rounded up: within a second of the truth.
	for _, w := range []struct {
		got   llm.RateWindow
		limit float64
		level float64
	}{{rl.Requests, rpm, reqs}, {rl.Tokens, tpm, toks}} {
		want := untilFull(w.limit, w.level)
		if !w.got.HasReset || w.got.Reset < want || w.got.Reset >= want+time.Second {
			t.Fatalf("anthropic reset %v, want %v rounded up to a second", w.got.Reset, want)
		}
	}
}

// The bucket refills continuously: Retry-After shrinks as time passes, and a request
// passes exactly when the bucket holds one.
func TestRateLimitRefillsOverTime(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	_, url := startLimited(t, Config{RPM: 4}, c) // one request every 15s
	chat := url + "/v1/chat/completions"
	for range 4 {
		if resp, b := rlPost(t, chat, rlBody("m", "")); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	for _, step := range []struct {
		advance  time.Duration
		status   int
		ra, raMs string
	}{
		{0, 429, "15", "15000"},
		{7500 * time.Millisecond, 429, "8", "7500"},
		{7499 * time.Millisecond, 429, "1", "1"},
		{time.Millisecond, 200, "", ""},
		{0, 429, "15", "15000"},
	} {
		c.add(step.advance)
		resp, b := rlPost(t, chat, rlBody("m", ""))
		if resp.StatusCode != step.status || resp.Header.Get("Retry-After") != step.ra || resp.Header.Get("Retry-After-Ms") != step.raMs {
			t.Fatalf("after %v more: %d Retry-After %q retry-after-ms %q, want %d %q %q: %s", step.advance, resp.StatusCode,
				resp.Header.Get("Retry-After"), resp.Header.Get("Retry-After-Ms"), step.status, step.ra, step.raMs, b)
		}
		if step.status == 200 && resp.Header.Get("X-Ratelimit-Reset-Requests") != "1m0s" {
			t.Fatalf("reset after taking the only request: %q, want 1m0s", resp.Header.Get("X-Ratelimit-Reset-Requests"))
		}
	}
}

// The token bucket is charged the estimate on arrival and corrected to the usage when
// the answer is complete: at once for a plain answer, at the end for a stream; a
// stream dropped halfway keeps its charge.
func TestRateLimitCorrectsTokensFromUsage(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	const tpm = 50000
	s, url := startLimited(t, Config{TPM: tpm}, c)
	chat := url + "/v1/chat/completions"
	remaining := func(resp *http.Response) int {
		t.Helper()
		n, err := strconv.Atoi(resp.Header.Get("X-Ratelimit-Remaining-Tokens"))
		if err != nil || resp.Header.Get("X-Ratelimit-Limit-Requests") != "" {
			t.Fatalf("headers %v: want token headers only", resp.Header)
		}
		return n
	}
	est := rlEstimate(500)
	resp, b := rlPost(t, chat, rlBody("m", `,"max_tokens":500`))
	usage := usageOf(t, b)
	if usage >= est {
		t.Fatalf("usage %d not below the estimate %d: the test cannot tell a correction", usage, est)
	}
	if got := remaining(resp); got != tpm-usage {
		t.Fatalf("after a plain answer %d left, want %d (corrected to the usage)", got, tpm-usage)
	}

	stream := rlBody("m", `,"max_tokens":500,"stream":true,"stream_options":{"include_usage":true}`)
	resp, err := http.Post(chat, "application/json", strings.NewReader(stream))
	if err != nil {
		t.Fatal(err)
	}
	if got := remaining(resp); got != tpm-usage-est {
		t.Fatalf("at a stream's start %d left, want %d (charged the estimate)", got, tpm-usage-est)
	}
	sb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	settled(t, s)
	if !strings.Contains(string(sb), fmt.Sprintf(`"total_tokens":%d`, usage)) {
		t.Fatalf("the stream's usage is not %d: %s", usage, sb)
	}

	s.Script(Fault{Kind: FaultDrop})
	if resp, err := http.Post(chat, "application/json", strings.NewReader(stream)); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	settled(t, s)
	// An injected 429 takes nothing, and its own request headers give way to the
	// configured limits' (tokens only).
	s.Script(Fault{Kind: Fault429})
	resp, _ = rlPost(t, chat, rlBody("m", `,"max_tokens":500`))
	if want := tpm - 2*usage - est; resp.StatusCode != 429 || remaining(resp) != want {
		t.Fatalf("injected 429: %d, %d left, want %d", resp.StatusCode, remaining(resp), want)
	}
	resp, _ = rlPost(t, chat, rlBody("m", `,"max_tokens":500`))
	// two corrected answers, one dropped stream at its estimate, and this one.
	if want := tpm - 3*usage - est; remaining(resp) != want {
		t.Fatalf("after a complete and a dropped stream %d left, want %d", remaining(resp), want)
	}
}

// A request whose estimate exceeds the token limit is charged the limit: it passes on
// a full bucket, and the next one waits for the bucket to be full again.
func TestRateLimitCapsOversizeRequest(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	const tpm = 600
	_, url := startLimited(t, Config{TPM: tpm}, c)
	chat := url + "/v1/chat/completions"
	if rlEstimate(4000) <= tpm {
		t.Fatal("the request is not larger than the limit")
	}
	resp, b := rlPost(t, chat, rlBody("m", `,"max_tokens":4000`))
	if resp.StatusCode != 200 {
		t.Fatalf("oversize request on a full bucket: %d %s", resp.StatusCode, b)
	}
	usage := usageOf(t, b)
	if got := resp.Header.Get("X-Ratelimit-Remaining-Tokens"); got != strconv.Itoa(tpm-usage) {
		t.Fatalf("remaining %s, want %d", got, tpm-usage)
	}
	resp, b = rlPost(t, chat, rlBody("m", `,"max_tokens":4000`))
	eb, _ := llm.ParseErrorBody(b)
	wantMs := int(math.Ceil(float64(usage) * 60000 / tpm))
	if resp.StatusCode != 429 || eb.Type != "tokens" || eb.Code != "rate_limit_exceeded" || !strings.Contains(eb.Message, fmt.Sprintf("Requested %d", tpm)) ||
		resp.Header.Get("Retry-After-Ms") != strconv.Itoa(wantMs) {
		t.Fatalf("second oversize request: %d retry-after-ms %q (want %d) %s", resp.StatusCode, resp.Header.Get("Retry-After-Ms"), wantMs, b)
	}
	c.add(time.Duration(wantMs) * time.Millisecond)
	if resp, b := rlPost(t, chat, rlBody("m", `,"max_tokens":4000`)); resp.StatusCode != 200 {
		t.Fatalf("after the wait: %d %s", resp.StatusCode, b)
	}
}

// Under a burst of concurrent requests the server admits exactly what the bucket
// holds, never more.
func TestRateLimitConcurrentBurst(t *testing.T) {
	t.Parallel()
	c := newTestClock()
	const rpm, n = 25, 120
	s, url := startLimited(t, Config{RPM: rpm, TPM: 10_000_000}, c)
	var mu sync.Mutex
	statuses := map[int]int{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(rlBody("burst", "")))
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			mu.Lock()
			statuses[resp.StatusCode]++
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	if statuses[200] != rpm || statuses[429] != n-rpm {
		t.Fatalf("statuses %v, want %d admitted and %d refused", statuses, rpm, n-rpm)
	}
	if st := s.Stats(); st.RateLimited != n-rpm {
		t.Fatalf("rate_limited %d, want %d", st.RateLimited, n-rpm)
	}
}

// Through the real adapters the limiter's 429 is an *llm.APIError with its
// Retry-After and rate limits, classified as rate limited (retryable), not a quota.
func TestRateLimit429ThroughAdapters(t *testing.T) {
	t.Parallel()
	for name, mk := range map[string]func(url string) llm.Client{
		"openai":    func(url string) llm.Client { return openai.New(openai.Config{BaseURL: url + "/v1", APIKey: "k"}) },
		"anthropic": func(url string) llm.Client { return anthropic.New(anthropic.Config{BaseURL: url, APIKey: "k"}) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, url := startLimited(t, Config{RPM: 1}, nil)
			cl := mk(url)
			req := &llm.Request{Model: "gpt-4.1-mini", MaxTokens: 100, Messages: []llm.Message{{Role: llm.RoleUser, Content: rlUser}}}
			resp, err := cl.Complete(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			if rl := resp.RateLimit; rl == nil || rl.Requests.Limit != 1 || !rl.Requests.HasRemaining || rl.Requests.Remaining != 0 || rl.Tokens.Limit != 0 {
				t.Fatalf("the answer's rate limits %+v", resp.RateLimit)
			}
			_, err = cl.Complete(context.Background(), req)
			var api *llm.APIError
			if !errors.As(err, &api) {
				t.Fatalf("second call: %v, want an *llm.APIError", err)
			}
			if api.StatusCode != 429 || !api.RetryAfterSet || api.RetryAfterDelay < 58*time.Second || api.RetryAfterDelay > 60*time.Second {
				t.Fatalf("%v: status %d Retry-After %v (set %v), want 429 and about 60s", api, api.StatusCode, api.RetryAfterDelay, api.RetryAfterSet)
			}
			if rl := api.RateLimit; rl == nil || rl.Requests.Limit != 1 || !rl.Requests.HasRemaining || rl.Requests.Remaining != 0 || !rl.Requests.HasReset || rl.Requests.Reset <= 0 {
				t.Fatalf("the 429's rate limits %+v", api.RateLimit)
			}
			if v := retry.Classify(err); v.Class != retry.ClassRateLimited || !v.Retryable {
				t.Fatalf("classified %+v, want rate_limited and retryable", v)
			}
		})
	}
}

func TestRateLimitConfigValidate(t *testing.T) {
	t.Parallel()
	for _, cfg := range []Config{{RPM: -1}, {TPM: -1}} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
	s, err := New(Config{})
	if err != nil || s.limits != nil {
		t.Fatalf("no limits configured, but limits %+v (%v)", s.limits, err)
	}
	// Without limits no rate-limit header is sent.
	ts := httptest.NewServer(s)
	defer ts.Close()
	resp, _ := rlPost(t, ts.URL+"/v1/chat/completions", rlBody("m", ""))
	if _, ok := llm.ParseRateLimit(resp.Header, time.Now()); ok || resp.StatusCode != 200 {
		t.Fatalf("unlimited server: %d %v", resp.StatusCode, resp.Header)
	}
}
