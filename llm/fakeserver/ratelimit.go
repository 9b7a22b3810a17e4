package fakeserver

import (
	"encoding/json"
	"math"
	"net/http"
	"strings"
	"sync"
	"time"
)

// maxRateModels bounds the models whose buckets a server keeps: past it, buckets that
// have refilled (and so say nothing a fresh one would not) are forgotten.
const maxRateModels = 4096

// rateLimits are the provider rate limits a Server enforces (Config.RPM and
// Config.TPM), the way OpenAI enforces them: per model, a request bucket and a token
// bucket, each holding at most one minute of its limit, starting full and refilling
// continuously at limit/60 a second. A request costs one request and, at arrival, its
// estimate in tokens (llm.EstimateTokens: prompt plus max_tokens or
// llm.DefaultOutputTokens), capped at the token limit so that a request larger than
// the limit passes when the bucket is full; the answer's usage corrects the token
// charge when the answer is complete. A request that either bucket cannot pay is
// refused and takes nothing. This is the accounting of package limiter, so a fleet
// under that limiter sees next to no 429s. Safe for concurrent use.
type rateLimits struct {
	rpm, tpm int64 // 0: that limit is off
	now      func() time.Time

	mu     sync.Mutex
	models map[string]*modelBuckets
}

// modelBuckets are one model's buckets.
type modelBuckets struct {
	req, tok bucket
}

// bucket is a continuously refilling token bucket: level at time at.
type bucket struct {
	level float64
	at    time.Time
}

// refill brings b to now for a bucket of limit per minute.
func (b *bucket) refill(now time.Time, limit float64) {
	if dt := now.Sub(b.at); dt > 0 {
		b.level = min(limit, b.level+dt.Seconds()*limit/60)
		b.at = now
	}
}

// untilFull is how long b takes to be full again, at limit per minute.
func (b *bucket) untilFull(limit float64) time.Duration {
	if b.level >= limit {
		return 0
	}
	return time.Duration(float64(time.Minute) * (limit - b.level) / limit)
}

// waitFor is how long b takes to hold need, at limit per minute, in whole milliseconds
// rounded up (0 when it holds need now).
func (b *bucket) waitFor(need, limit float64) time.Duration {
	if b.level >= need {
		return 0
	}
	// The small epsilon keeps float noise (1000.0000000002 ms, or a level of
	// 0.9999999999 that is a whole request) from adding a millisecond.
	ms := math.Ceil((need-b.level)*60000/limit - 1e-6)
	if ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

// newRateLimits returns the limits of rpm requests and tpm tokens per minute, or nil
// when both are 0.
func newRateLimits(rpm, tpm int) *rateLimits {
	if rpm <= 0 && tpm <= 0 {
		return nil
	}
	return &rateLimits{rpm: int64(max(rpm, 0)), tpm: int64(max(tpm, 0)), now: time.Now, models: map[string]*modelBuckets{}}
}

// buckets returns model's buckets brought to now, creating full ones; l.mu must be held.
func (l *rateLimits) buckets(model string, now time.Time) *modelBuckets {
	m := l.models[model]
	if m == nil {
		if len(l.models) >= maxRateModels {
			l.forgetFull(now)
		}
		m = &modelBuckets{req: bucket{float64(l.rpm), now}, tok: bucket{float64(l.tpm), now}}
		l.models[model] = m
		return m
	}
	m.req.refill(now, float64(l.rpm))
	m.tok.refill(now, float64(l.tpm))
	return m
}

// forgetFull drops the buckets that have refilled; l.mu must be held.
func (l *rateLimits) forgetFull(now time.Time) {
	for name, m := range l.models {
		m.req.refill(now, float64(l.rpm))
		m.tok.refill(now, float64(l.tpm))
		if m.req.level >= float64(l.rpm) && m.tok.level >= float64(l.tpm) {
			delete(l.models, name)
		}
	}
}

// rejection says why a request was refused.
type rejection struct {
	// kind is the exhausted limit: "requests" or "tokens" (OpenAI's error type).
	kind string
	// limit is its size per minute, used what is taken of it now, requested what the
	// request needed of it.
	limit, used, requested int64
	// wait is how long until the bucket holds what the request needs.
	wait time.Duration
}

// admission is the charge of one admitted request, which settle corrects once the
// answer is complete. A nil *admission (no limits) does nothing. Its methods are
// called by the one handler that owns it.
type admission struct {
	l      *rateLimits
	model  string
	tokens float64 // charged to the token bucket
	ended  bool
}

// admit charges model's buckets one request and tokens (capped at the token limit),
// or, when either cannot pay, takes nothing and says why (the limit with the longer
// wait).
func (l *rateLimits) admit(model string, tokens int) (*admission, *rejection) {
	now := l.now()
	need := min(float64(max(tokens, 0)), float64(l.tpm))
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.buckets(model, now)
	var rej *rejection
	if l.rpm > 0 {
		if w := m.req.waitFor(1, float64(l.rpm)); w > 0 {
			rej = &rejection{kind: "requests", limit: l.rpm, used: used(m.req, l.rpm), requested: 1, wait: w}
		}
	}
	if l.tpm > 0 {
		if w := m.tok.waitFor(need, float64(l.tpm)); w > 0 && (rej == nil || w > rej.wait) {
			rej = &rejection{kind: "tokens", limit: l.tpm, used: used(m.tok, l.tpm), requested: int64(math.Ceil(need)), wait: w}
		}
	}
	if rej != nil {
		return nil, rej
	}
	if l.rpm > 0 {
		m.req.level--
	}
	if l.tpm > 0 {
		m.tok.level -= need
	}
	return &admission{l: l, model: model, tokens: need}, nil
}

// used is what is taken of a bucket of limit, rounded up.
func used(b bucket, limit int64) int64 {
	return min(limit, max(0, int64(math.Ceil(float64(limit)-b.level))))
}

// settle corrects the token charge to actual, the answer's usage (0 for an error
// answer, as a provider bills none): the difference goes back to the bucket (or is
// taken from it when the answer used more than its estimate), which stays between
// minus and plus its limit. Only the first settle or cancel counts.
func (a *admission) settle(actual int) {
	if a == nil || a.ended {
		return
	}
	a.ended = true
	l := a.l
	if l.tpm <= 0 {
		return
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.buckets(a.model, now)
	limit := float64(l.tpm)
	m.tok.level = max(-limit, min(limit, m.tok.level+a.tokens-float64(max(actual, 0))))
}

// cancel gives back the whole charge, request and tokens: for a request answered with
// an (injected) 429, which takes nothing.
func (a *admission) cancel() {
	if a == nil || a.ended {
		return
	}
	a.ended = true
	l := a.l
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.buckets(a.model, now)
	if l.rpm > 0 {
		m.req.level = min(float64(l.rpm), m.req.level+1)
	}
	if l.tpm > 0 {
		m.tok.level = min(float64(l.tpm), m.tok.level+a.tokens)
	}
}

// rateWindow is what the headers of an answer say of one limit. remaining and reset
// are unknown (not sent) when negative.
type rateWindow struct {
	limit, remaining int64
	reset            time.Duration
}

// rateState is what the headers of an answer say of a model's limits; a nil window is
// a limit that is not configured.
type rateState struct {
	now              time.Time
	requests, tokens *rateWindow
}

// state returns model's limits now: what is left of each bucket (floored, never
// negative) and how long until it is full again. For an unknown model (a request
// that could not be read) only the limits are known.
func (l *rateLimits) state(model string, known bool) rateState {
	now := l.now()
	st := rateState{now: now}
	window := func(limit int64, b *bucket) *rateWindow {
		if limit <= 0 {
			return nil
		}
		w := &rateWindow{limit: limit, remaining: -1, reset: -1}
		if b != nil {
			w.remaining = max(0, int64(math.Floor(b.level)))
			w.reset = b.untilFull(float64(limit)).Round(time.Millisecond)
		}
		return w
	}
	if !known {
		st.requests, st.tokens = window(l.rpm, nil), window(l.tpm, nil)
		return st
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.models[model]
	if m == nil { // never charged: full
		m = &modelBuckets{req: bucket{float64(l.rpm), now}, tok: bucket{float64(l.tpm), now}}
	} else {
		m.req.refill(now, float64(l.rpm))
		m.tok.refill(now, float64(l.tpm))
	}
	st.requests, st.tokens = window(l.rpm, &m.req), window(l.tpm, &m.tok)
	return st
}

// clearRateHeaders removes every rate-limit header from h, so that those of a limited
// server are the only ones (an injected 429 sets its own).
func clearRateHeaders(h http.Header) {
	for k := range h {
		lk := strings.ToLower(k)
		if strings.HasPrefix(lk, "x-ratelimit-") || strings.HasPrefix(lk, "anthropic-ratelimit-") {
			delete(h, k)
		}
	}
}

// sniffModel reads the "model" of a request body that failed to parse, for the
// rate-limit headers of its 400.
func sniffModel(body []byte) (string, bool) {
	var in struct {
		Model string `json:"model"`
	}
	if json.Unmarshal(body, &in) != nil || in.Model == "" {
		return "", false
	}
	return in.Model, true
}

// retryAfterSeconds is the Retry-After of a wait: whole seconds, rounded up, at least 1.
func retryAfterSeconds(wait time.Duration) int64 {
	return max(1, int64((wait+time.Second-1)/time.Second))
}
