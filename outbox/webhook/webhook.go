// Package webhook is an outbox.Sender that POSTs each message to a URL, as docs/outbox.md
// describes: JSON {"topic", "dedupe_key", "payload"} with the dedupe key as
// the Idempotency-Key header, so a receiver that honours the header applies a
// redelivered row once. Config.Body changes the body's shape: PayloadOnly posts just the
// payload, for a receiver (a payments API) that expects its own document.
//
// Outcomes: 2xx is sent. 408, 409, 429, 5xx, timeouts and connection errors are
// retried later with backoff, after the Retry-After the receiver sent when there is one.
// Any other status is permanent: the row is exhausted without more tries.
package webhook

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

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// DefaultTimeout bounds one send unless Config.Timeout says otherwise.
const DefaultTimeout = 10 * time.Second

// Config configures a Sender.
type Config struct {
	// URL receives the POSTs (http or https). Required.
	URL string
	// Timeout bounds one send, response included. Default: 10s.
	Timeout time.Duration
	// Client sends the requests. Default: a client of its own on a clone of
	// http.DefaultTransport that keeps 64 idle connections to the receiver (net/http
	// keeps 2, and the relay sends a batch concurrently), following no redirects (a
	// redirected POST would lose its body).
	Client *http.Client
	// Body returns the JSON body POSTed for a message; an error from it is permanent
	// (the row is exhausted), since the same message encodes the same way next time.
	// The headers stay the same whatever the body: Content-Type application/json,
	// Idempotency-Key the dedupe key, Traceparent when the row has one. Default:
	// Envelope, {"topic", "dedupe_key", "payload"}; PayloadOnly posts the payload alone.
	Body func(outbox.Message) ([]byte, error)
}

// Sender POSTs outbox messages to a webhook. It is safe for concurrent use.
type Sender struct {
	url     string
	timeout time.Duration
	client  *http.Client
	body    func(outbox.Message) ([]byte, error)
}

var _ outbox.Sender = (*Sender)(nil)

// New returns a Sender for cfg, or an error when the URL is missing or not http(s).
func New(cfg Config) (*Sender, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, errors.New("webhook sender: URL must be an http or https URL")
	}
	if cfg.Timeout < 0 {
		return nil, errors.New("webhook sender: Timeout must not be negative")
	}
	s := &Sender{url: cfg.URL, timeout: cfg.Timeout, client: cfg.Client, body: cfg.Body}
	if s.body == nil {
		s.body = Envelope
	}
	if s.timeout == 0 {
		s.timeout = DefaultTimeout
	}
	if s.client == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 64
		s.client = &http.Client{Transport: t, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	return s, nil
}

// StatusError is a non-2xx answer. It is wrapped with outbox.Permanent when the status
// is not worth retrying, and carries the receiver's Retry-After when there was one.
type StatusError struct {
	Status int
	// Wait is the parsed Retry-After header, zero when absent or invalid.
	Wait time.Duration
	// Body is the start of the response body, for the row's last_error.
	Body string
}

func (e *StatusError) Error() string {
	msg := fmt.Sprintf("webhook answered %d %s", e.Status, http.StatusText(e.Status))
	if e.Body != "" {
		msg += ": " + e.Body
	}
	return msg
}

// RetryAfter returns the receiver's Retry-After, when it sent one; the relay uses it as
// the delay. It implements retry.RetryAfterer.
func (e *StatusError) RetryAfter() (time.Duration, bool) { return e.Wait, e.Wait > 0 }

// envelope is the JSON document Envelope returns.
type envelope struct {
	Topic     string          `json:"topic"`
	DedupeKey string          `json:"dedupe_key"`
	Payload   json.RawMessage `json:"payload"`
}

// Envelope is the default Config.Body: {"topic", "dedupe_key", "payload"}, the payload
// as stored (null when empty).
func Envelope(m outbox.Message) ([]byte, error) {
	return json.Marshal(envelope{Topic: m.Topic, DedupeKey: m.DedupeKey, Payload: payloadOf(m)})
}

// PayloadOnly is a Config.Body that posts the message's payload alone (null when
// empty), for a receiver that expects its own document: the dedupe key still travels as
// the Idempotency-Key header, so the receiver can still apply a repeated send once.
func PayloadOnly(m outbox.Message) ([]byte, error) { return payloadOf(m), nil }

func payloadOf(m outbox.Message) json.RawMessage {
	if len(m.Payload) == 0 {
		return json.RawMessage("null")
	}
	return m.Payload
}

// Send POSTs m's body (Config.Body) with Idempotency-Key m.DedupeKey (and traceparent
// when the row has one) and classifies the answer: nil for 2xx, a permanent error for statuses retrying
// cannot fix, any other error for failures a later attempt may fix. It returns when ctx
// is done or Timeout has passed.
func (s *Sender) Send(ctx context.Context, m outbox.Message) error {
	if strings.ContainsFunc(m.DedupeKey, func(r rune) bool { return r < ' ' && r != '\t' || r == 0x7f }) {
		return retry.Permanent(errors.New("dedupe key holds control characters: it cannot be an Idempotency-Key header"))
	}
	b, err := s.body(m)
	if err != nil {
		return retry.Permanent(fmt.Errorf("encode webhook body: %w", err))
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url, bytes.NewReader(b))
	if err != nil {
		return retry.Permanent(fmt.Errorf("build webhook request: %w", err))
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", m.DedupeKey)
	if m.Traceparent != "" {
		req.Header.Set("Traceparent", m.Traceparent)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		// Timeouts and connection errors: the receiver may or may not have the message;
		// the same key goes out again later. The URL may hold a token: keep it out.
		return fmt.Errorf("webhook post: %w", stripURL(err))
	}
	defer resp.Body.Close()
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // let the connection be reused
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil
	}
	wait, _ := retry.RetryAfterFromHeader(resp.Header, time.Now())
	serr := &StatusError{Status: resp.StatusCode, Body: strings.TrimSpace(string(snippet)), Wait: wait}
	// One classification for the whole project: 408, 409, 429 and 5xx are worth another
	// attempt, any other status is permanent (retry.ClassifyStatus).
	if !retry.ClassifyStatus(resp.StatusCode).Retryable {
		return retry.Permanent(serr)
	}
	return serr
}

// stripURL removes the request URL from a *url.Error, which would otherwise print it.
func stripURL(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return fmt.Errorf("%s: %w", ue.Op, ue.Err)
	}
	return err
}
