package onceflowtest

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// Sink is a webhook receiver in-process, standing in for the system an effect goes to
// (a payments API, a mailer): it records every POST with its Idempotency-Key and body
// and answers 200. A delivery is recorded when its request arrives, before the answer,
// the way a provider applies an effect and then the response is lost. Its methods are
// safe for concurrent use.
type Sink struct {
	// URL is where it listens (http://127.0.0.1:port).
	URL string

	s *webhooksink.Sink
}

// Delivery is one POST a Sink recorded.
type Delivery struct {
	// Key is its Idempotency-Key header ("" when it had none).
	Key string
	// Body is its body (JSON; a body that was not is recorded as a JSON string).
	Body json.RawMessage
	// At is when it arrived.
	At time.Time
}

// NewSink starts a Sink, closed at cleanup.
func NewSink(t testing.TB) *Sink {
	t.Helper()
	s := webhooksink.New(webhooksink.Options{})
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return &Sink{URL: srv.URL, s: s}
}

// Sender returns a webhook sender (package outbox/webhook) that POSTs to the sink with
// body (nil: webhook.Envelope; webhook.PayloadOnly posts the payload alone), for
// onceflow.Config.Senders.
func (s *Sink) Sender(t testing.TB, body func(outbox.Message) ([]byte, error)) outbox.Sender {
	t.Helper()
	sender, err := webhook.New(webhook.Config{URL: s.URL, Body: body})
	if err != nil {
		t.Fatal(err)
	}
	return sender
}

// Count returns how many POSTs carried Idempotency-Key key.
func (s *Sink) Count(key string) int { return s.s.Count(key) }

// Total returns how many POSTs were recorded.
func (s *Sink) Total() int { return s.s.Stats().Deliveries }

// Keys returns the distinct keys recorded, sorted: the effects a receiver that honours
// Idempotency-Key applied.
func (s *Sink) Keys() []string { return s.s.Keys() }

// Deliveries returns every recorded POST, in arrival order.
func (s *Sink) Deliveries() []Delivery {
	var out []Delivery
	for _, d := range s.s.Deliveries() {
		out = append(out, Delivery{Key: d.Key, Body: d.Body, At: d.At})
	}
	return out
}

// SetLatency delays the answers to come by d (the deliveries are still recorded on
// arrival): with a long d, a sender is stuck after its effect arrived, for a test to
// kill it there. Zero answers at once again.
func (s *Sink) SetLatency(d time.Duration) { s.s.SetLatency(d) }

// SetAnswer makes the sink answer like an API that honours Idempotency-Key: the first
// POST of each key is answered with the body answer returns (given the key and the
// POST's body), and every later POST of that key with the same body again, marked
// Idempotent-Replayed: true. Deliveries are recorded as before, so Count still sees the
// duplicates the sink absorbed.
func (s *Sink) SetAnswer(answer func(key string, body []byte) []byte) { s.s.SetAnswer(answer) }

// FailNext answers the next n POSTs 503 without recording them.
func (s *Sink) FailNext(n int) { s.s.FailNext(n) }

// RequireOncePerKey fails the test unless the sink received exactly want distinct
// keys, each exactly once, and no POST without a key.
func (s *Sink) RequireOncePerKey(t testing.TB, want int) {
	t.Helper()
	st := s.s.Stats()
	if st.DistinctKeys != want || st.Deliveries != want || st.MissingKey != 0 {
		t.Fatalf("sink received %d POSTs with %d distinct keys (%d without a key, duplicates %v); want %d, each once",
			st.Deliveries, st.DistinctKeys, st.MissingKey, st.Duplicates, want)
	}
}
