package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/sse"
	"github.com/onceflow/onceflow/retry"
)

// Admission (Config.Limiter): every POST to a model endpoint, keyed or not, is admitted
// by the fleet's limiter (limiter) before it goes upstream, so that a gateway
// fronting a whole organisation's SDK clients keeps them under the provider's limits,
// and shares one pause with every onceflow process when the provider answers 429. A
// replay or a join is never admitted: it makes no upstream call.

// modelEndpoint reports whether a request path names a model call: OpenAI's Chat
// Completions, (legacy) Completions and Responses, Anthropic's Messages. Only these are
// recorded, admitted by the limiter and given derived keys; every other path is passed
// through untouched.
func modelEndpoint(path string) bool {
	switch strings.TrimPrefix(path, "/v1") {
	case "/chat/completions", "/completions", "/responses", "/messages":
		return true
	}
	return false
}

// tenantOf is the limiter's tenant of a request: a digest of the first value of the
// header its upstream authenticates it with, so that shares, caps and budgets are by
// caller: Config.TenantHeader when set, else x-api-key on Anthropic's /v1/messages and
// Authorization on OpenAI's paths (api-key, Azure OpenAI's, when there is no
// Authorization); without that header, the first credential header the request carries
// (Authorization, x-api-key, api-key, then Config.CredentialHeaders). Not the credential
// scope, which counts every credential header: a caller could add a header the upstream
// ignores and be a new tenant at every call. Without any credential, nobody's ("").
func (g *Gateway) tenantOf(r *http.Request) string {
	name := g.cfg.TenantHeader
	if name == "" {
		switch {
		case strings.TrimPrefix(r.URL.Path, "/v1") == "/messages":
			name = "X-Api-Key"
		case len(r.Header.Values("Authorization")) == 0 && len(r.Header.Values("Api-Key")) > 0:
			name = "Api-Key"
		default:
			name = "Authorization"
		}
	}
	v := r.Header.Values(name)
	if len(v) == 0 {
		// Without it, the first credential header it carries names the caller, so
		// that sending the credential in another header does not escape the caps.
		for _, n := range append(slices.Clone(builtinCredentialHeaders), g.cfg.CredentialHeaders...) {
			if v = r.Header.Values(n); len(v) > 0 {
				name = http.CanonicalHeaderKey(n)
				break
			}
		}
		if len(v) == 0 {
			return ""
		}
	}
	sum := sha256.Sum256([]byte("onceflow.gateway.tenant.v1\n" + name + "\n" + v[0]))
	return "cred-" + hex.EncodeToString(sum[:8])
}

// limitCall is the limiter's Call of a request body: its model, the body's length / 4
// as the prompt's estimate (the JSON syntax makes it an overestimate) and its output
// limit (max_tokens, max_completion_tokens, max_output_tokens) or
// llm.DefaultOutputTokens.
func limitCall(tenant, key string, body []byte) limiter.Call {
	var b struct {
		Model               string `json:"model"`
		MaxTokens           int    `json:"max_tokens"`
		MaxCompletionTokens int    `json:"max_completion_tokens"`
		MaxOutputTokens     int    `json:"max_output_tokens"`
	}
	_ = json.Unmarshal(body, &b) // a body that is not JSON: the upstream says so
	out := max(b.MaxTokens, b.MaxCompletionTokens, b.MaxOutputTokens)
	if out <= 0 {
		out = llm.DefaultOutputTokens
	}
	return limiter.Call{Model: modelOf(body), Tenant: tenant, Work: key, InputTokens: len(body)/4 + 1, OutputTokens: out}
}

// admit asks the limiter for a permit. When it is refused, it returns the answer to
// give instead (429 with Retry-After and retry-after-ms for a wait, 400 for a call no
// wait admits, 503 when Redis is unreachable). It returns neither when no limiter is
// configured or the request is not a model call.
func (g *Gateway) admit(ctx context.Context, r *http.Request, key string, body []byte) (*limiter.Permit, *answer) {
	if g.cfg.Limiter == nil || r.Method != http.MethodPost || !modelEndpoint(r.URL.Path) {
		return nil, nil
	}
	p, err := g.cfg.Limiter.Acquire(ctx, limitCall(g.tenantOf(r), key, body))
	if err == nil {
		return p, nil
	}
	w := &answerWriter{a: answer{header: http.Header{}}}
	var we *retry.WaitError
	switch {
	case errors.As(err, &we):
		g.requests.WithLabelValues(resultLimited).Inc()
		retryAfter(w, we.Delay)
		writeError(w, http.StatusTooManyRequests, "rate_limit_error", "rate_limit_exceeded", "onceflow gateway: "+we.Reason+"; retry after retry-after-ms")
	case errors.Is(err, limiter.ErrTooLarge):
		g.requests.WithLabelValues(resultBadRequest).Inc()
		writeError(w, http.StatusBadRequest, "invalid_request_error", "request_too_large_for_limits", err.Error())
	case ctx.Err() != nil:
		g.requests.WithLabelValues(resultUnavailable).Inc()
		retryAfter(w, g.cfg.RetryAfter)
		writeError(w, http.StatusServiceUnavailable, "server_error", "gateway_closing", "the gateway stopped waiting for admission; retry")
	default:
		g.requests.WithLabelValues(resultUnavailable).Inc()
		g.log.ErrorContext(ctx, "gateway: limiter unavailable", "err", err)
		retryAfter(w, time.Second)
		writeError(w, http.StatusServiceUnavailable, "server_error", "limiter_unavailable", "the gateway's rate limiter is unavailable; retry later")
	}
	return nil, &w.a
}

// answerWriter captures an answer (writeError's) instead of sending it.
type answerWriter struct{ a answer }

func (w *answerWriter) Header() http.Header { return w.a.header }
func (w *answerWriter) WriteHeader(status int) {
	if w.a.status == 0 {
		w.a.status = status
	}
}
func (w *answerWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	w.a.body = append(w.a.body, p...)
	return len(p), nil
}

// write sends a to w.
func (a *answer) write(w http.ResponseWriter) {
	for k, vs := range a.header {
		w.Header()[k] = vs
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(a.body)))
	w.WriteHeader(a.status)
	// #nosec G705 -- an upstream's error answer passed on unchanged, with its own Content-Type, or the gateway's own JSON error.
	_, _ = w.Write(a.body)
}

// settleSent ends a permit of a call that went upstream and got resp (nil with err for
// a call that got no answer); usage is the answer's, when it said.
func settleSent(p *limiter.Permit, resp *http.Response, usage *llm.Usage, err error) {
	if p == nil {
		return
	}
	now := time.Now()
	switch {
	case resp == nil:
		p.Done(limiter.Result{Sent: true, Ambiguous: err != nil && ledger.IsAmbiguous(err), Err: err})
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		p.Done(limiter.Result{Sent: true, RateLimit: llm.RateLimitOf(resp.Header, now),
			Err: llm.NewAPIError(Provider, resp.StatusCode, resp.Header, nil, now, nil)})
	default:
		res := limiter.Result{Sent: true, Usage: usage, RateLimit: llm.RateLimitOf(resp.Header, now), Err: err}
		res.Ambiguous = err != nil
		p.Done(res)
	}
}

// usageOf reads the token usage an answer body or a stream event reports: OpenAI's
// usage {prompt_tokens, completion_tokens}, Responses' and Anthropic's {input_tokens,
// output_tokens}, at the top level, in "response" (response.completed) or in "message"
// (Anthropic's message_start). nil when it says none.
func usageOf(data []byte) *llm.Usage {
	type usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		InputTokens      int `json:"input_tokens"`
		OutputTokens     int `json:"output_tokens"`
	}
	var d struct {
		Usage    *usage `json:"usage"`
		Response *struct {
			Usage *usage `json:"usage"`
		} `json:"response"`
		Message *struct {
			Usage *usage `json:"usage"`
		} `json:"message"`
	}
	if json.Unmarshal(data, &d) != nil {
		return nil
	}
	u := d.Usage
	switch {
	case u != nil:
	case d.Response != nil && d.Response.Usage != nil:
		u = d.Response.Usage
	case d.Message != nil && d.Message.Usage != nil:
		u = d.Message.Usage
	default:
		return nil
	}
	in, out := max(u.PromptTokens, u.InputTokens), max(u.CompletionTokens, u.OutputTokens)
	if in <= 0 && out <= 0 {
		return nil
	}
	return &llm.Usage{InputTokens: in, OutputTokens: out}
}

// streamUsage gathers the usage a stream's events report: the largest input and output
// counts seen (Anthropic reports input at message_start and the running output in
// message_delta; OpenAI reports both in one final chunk when asked to).
type streamUsage struct{ in, out int }

func (s *streamUsage) add(ev sse.Event) {
	if !strings.Contains(ev.Data, "tokens") {
		return
	}
	if u := usageOf([]byte(ev.Data)); u != nil {
		s.in, s.out = max(s.in, u.InputTokens), max(s.out, u.OutputTokens)
	}
}

func (s *streamUsage) usage() *llm.Usage {
	if s.in <= 0 && s.out <= 0 {
		return nil
	}
	return &llm.Usage{InputTokens: s.in, OutputTokens: s.out}
}

// errLimiterNotSent is the cause recorded on a ledger row whose call the limiter put
// off: nothing went upstream.
var errLimiterNotSent = errors.New("onceflow gateway: put off by the rate limiter, not sent")

// passThrough forwards a request without a key, unrecorded, within Config.Timeout; a
// model call is admitted
// by the limiter first, and settled with the answer's status and headers (its usage is
// not read: the call is charged its estimate).
func (g *Gateway) passThrough(w http.ResponseWriter, r *http.Request) {
	g.requests.WithLabelValues(resultPassthrough).Inc()
	ctx, cancel := context.WithTimeout(r.Context(), g.cfg.Timeout)
	defer cancel()
	if g.cfg.Limiter == nil || r.Method != http.MethodPost || !modelEndpoint(r.URL.Path) {
		g.proxy.ServeHTTP(w, r.WithContext(ctx))
		return
	}
	// The estimate needs the body: read it (bounded by MaxBodyBytes) and send it on.
	body, err := io.ReadAll(r.Body)
	if err != nil {
		g.bodyError(w, err)
		return
	}
	p, refused := g.admit(ctx, r, "", body)
	if refused != nil {
		refused.write(w)
		return
	}
	sw := &statusWriter{StatusWriter: httpapi.StatusWriter{ResponseWriter: w}}
	defer func() {
		if sw.Status == 0 { // no answer: the proxy's ErrorHandler did not run either (a panic)
			p.Done(limiter.Result{Sent: true, Ambiguous: true})
		}
	}()
	r2 := r.WithContext(context.WithValue(ctx, permitKey{}, sw))
	r2.Body = io.NopCloser(bytes.NewReader(body))
	r2.ContentLength = int64(len(body))
	g.proxy.ServeHTTP(sw, r2)
	sw.settle(p)
}

type permitKey struct{}

// statusWriter notes the status and the upstream's headers of a passed-through answer,
// and whether the proxy itself answered for want of one (proxyFailed).
type statusWriter struct {
	httpapi.StatusWriter
	proxyFailed error
}

func (s *statusWriter) settle(p *limiter.Permit) {
	if s.proxyFailed != nil {
		settleSent(p, nil, nil, s.proxyFailed)
		return
	}
	settleSent(p, &http.Response{StatusCode: s.Status, Header: s.Header()}, nil, nil)
}
