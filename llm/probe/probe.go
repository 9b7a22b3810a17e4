// Package probe answers one question about a model provider: does it honour
// Idempotency-Key? It is the curl check of docs/providers.md ("Verifying a provider") as
// a library (and `onceflow probe` as a command): send one key twice with a deliberately
// non-deterministic prompt (temperature 1, "Say one random word.") to an
// OpenAI-compatible Chat Completions endpoint, and compare the two responses.
//
// Servers ignore headers they do not understand, so an unsupported key fails silently:
// the request succeeds, the header is dropped, and retry logic goes on believing it is
// protected. The probe verifies positively instead of by absence of failure:
//
//   - the same response id and the same text: honoured (the second was a replay);
//   - two different ids: ignored (two generations, both billed; deduplication is now
//     yours: see ledger, or put onceflow gateway in front);
//   - anything else (a call failed, an answer without an id, the same id with other
//     text): inconclusive, with the reason.
package probe

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/internal/chatwire"
)

// Verdict is the probe's answer.
type Verdict string

// The verdicts.
const (
	Honoured     Verdict = "honoured"
	Ignored      Verdict = "ignored"
	Inconclusive Verdict = "inconclusive"
)

// Defaults of Config's fields.
const (
	DefaultPrompt  = "Say one random word."
	DefaultTimeout = 30 * time.Second
	// maxBody bounds the answer read from the provider.
	maxBody = 4 << 20
	// provider names the endpoints' wire format in errors: llm/openai's Provider (the
	// probe reads answers without that adapter and its SDK).
	provider = "openai"
)

// Config says what to probe.
type Config struct {
	// BaseURL is the API root, /v1 included (https://api.openai.com/v1). Required.
	BaseURL string
	// Model is the model to ask. Required.
	Model string
	// APIKey is sent as a bearer token when set. Never logged or printed.
	APIKey string
	// Key is the Idempotency-Key to send twice. Default: "probe-" and a random UUID.
	Key string
	// Prompt is the non-deterministic question. Default: "Say one random word."
	Prompt string
	// Timeout bounds each of the two requests. Default: 30s.
	Timeout time.Duration
	// HTTPClient sends the requests. Default: a client with no overall timeout (each
	// request's context carries Timeout).
	HTTPClient *http.Client
}

// Answer is what one of the two requests got.
type Answer struct {
	// Status is the HTTP status; 0 when no answer arrived.
	Status int `json:"status"`
	// ID is the response id (chatcmpl-...).
	ID string `json:"id"`
	// Content is the text of the first choice.
	Content string `json:"content"`
	// Replayed reports an Idempotent-Replayed: true header.
	Replayed bool `json:"replayed"`
	// Error describes a failed request; empty on success.
	Error string `json:"error,omitempty"`
}

// Result is the probe's finding.
type Result struct {
	Verdict Verdict `json:"verdict"`
	// Reason explains the verdict in one sentence.
	Reason  string `json:"reason"`
	Key     string `json:"key"`
	BaseURL string `json:"base_url"`
	Model   string `json:"model"`
	First   Answer `json:"first"`
	Second  Answer `json:"second"`
}

// Run sends cfg.Key twice, one request after the other, and returns the verdict. Its
// error is reserved for an unusable Config (missing or invalid base URL or model); a
// provider that fails gives an Inconclusive Result, not an error. Run is safe for
// concurrent use.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	u, err := url.Parse(cfg.BaseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, errors.New("probe: base URL must be an http or https URL")
	}
	if cfg.Model == "" {
		return nil, errors.New("probe: model is required")
	}
	if cfg.Key == "" {
		cfg.Key = "probe-" + uuid.NewString()
	}
	if cfg.Prompt == "" {
		cfg.Prompt = DefaultPrompt
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{}
	}
	body, _ := json.Marshal(map[string]any{
		"model":       cfg.Model,
		"temperature": 1,
		"messages":    []map[string]string{{"role": "user", "content": cfg.Prompt}},
	})
	r := &Result{Key: cfg.Key, BaseURL: u.Redacted(), Model: cfg.Model}
	r.First = ask(ctx, cfg, body)
	r.Second = ask(ctx, cfg, body)
	r.Verdict, r.Reason = judge(r.First, r.Second)
	return r, nil
}

// ask sends one request and reads its answer.
func ask(ctx context.Context, cfg Config, body []byte) Answer {
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(cfg.BaseURL, "/")+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		return Answer{Error: err.Error()}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", cfg.Key)
	if cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+cfg.APIKey)
	}
	resp, err := cfg.HTTPClient.Do(req)
	if err != nil {
		return Answer{Error: "request failed: " + redact(err.Error(), cfg.APIKey)}
	}
	defer resp.Body.Close()
	a := Answer{Status: resp.StatusCode, Replayed: strings.EqualFold(resp.Header.Get("Idempotent-Replayed"), "true")}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		a.Error = "reading the answer failed: " + err.Error()
		return a
	}
	if resp.StatusCode >= 300 {
		a.Error = llm.NewAPIError(provider, resp.StatusCode, resp.Header, raw, time.Now(), nil).Error()
		return a
	}
	c, err := chatwire.Decode(raw)
	if err != nil {
		a.Error = "the answer is not a chat completion: " + err.Error()
		return a
	}
	a.ID, a.Content = c.ID, c.Content
	return a
}

// judge compares the two answers.
func judge(first, second Answer) (Verdict, string) {
	switch {
	case first.Error != "":
		return Inconclusive, "the first request failed: " + first.Error
	case second.Error != "":
		return Inconclusive, "the second request failed: " + second.Error
	case first.ID == "" || second.ID == "":
		return Inconclusive, "an answer carried no response id to compare"
	case first.ID == second.ID && first.Content == second.Content:
		return Honoured, "the second request replayed the first response: same id, same text"
	case first.ID != second.ID && first.Content == second.Content:
		return Ignored, "two response ids: two generations (the text happened to match); the key is ignored and both were billed"
	case first.ID != second.ID:
		return Ignored, "two response ids and two texts: two generations; the key is ignored and both were billed"
	}
	return Inconclusive, "the same response id with different text: not a replay the probe understands"
}

// redact removes a secret from a message (an error that echoes a URL with a key).
func redact(msg, secret string) string {
	if secret == "" {
		return msg
	}
	return strings.ReplaceAll(msg, secret, "[redacted]")
}

// String renders r for people: the verdict, the reason and both answers.
func (r *Result) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s\n", r.Verdict, r.Reason)
	fmt.Fprintf(&b, "  endpoint  %s (model %s)\n", r.BaseURL, r.Model)
	fmt.Fprintf(&b, "  key       %s\n", r.Key)
	for _, a := range []struct {
		name string
		Answer
	}{{"first", r.First}, {"second", r.Second}} {
		if a.Error != "" {
			fmt.Fprintf(&b, "  %-9s failed: %s\n", a.name, a.Error)
			continue
		}
		replayed := ""
		if a.Replayed {
			replayed = "  (Idempotent-Replayed: true)"
		}
		fmt.Fprintf(&b, "  %-9s id %s  %q%s\n", a.name, a.ID, truncate(a.Content, 80), replayed)
	}
	return b.String()
}

// truncate cuts s to n runes.
func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n]) + "..."
}
