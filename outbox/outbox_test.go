package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
)

func TestPermanentAndRetryAfterAreFoundThroughWrapping(t *testing.T) {
	base := errors.New("bad request")
	p := fmt.Errorf("send: %w", Permanent(base))
	if !IsPermanent(p) || !errors.Is(p, ErrPermanent) || !errors.Is(p, base) || p.Error() != "send: bad request" {
		t.Fatalf("Permanent wrapped: %v", p)
	}
	if IsPermanent(base) || Permanent(nil) != nil {
		t.Fatal("plain error permanent, or Permanent(nil) not nil")
	}
	ra := fmt.Errorf("send: %w", RetryAfter(base, 3*time.Second))
	if d, ok := RetryAfterOf(ra); !ok || d != 3*time.Second || !errors.Is(ra, base) {
		t.Fatalf("RetryAfterOf = %v %v", d, ok)
	}
	if _, ok := RetryAfterOf(base); ok {
		t.Fatal("RetryAfterOf found a delay in a plain error")
	}
	if RetryAfter(base, 0) != base || RetryAfter(nil, time.Second) != nil {
		t.Fatal("RetryAfter with no delay or no error must return err unchanged")
	}
}

func TestClassOf(t *testing.T) {
	ctx := context.Background()
	expired, cancel := context.WithTimeout(ctx, -time.Second)
	defer cancel()
	for _, c := range []struct {
		ctx  context.Context
		err  error
		want string
	}{
		{ctx, Permanent(errors.New("400")), classPermanent},
		{ctx, fmt.Errorf("post: %w", context.DeadlineExceeded), classTimeout},
		{expired, errors.New("anything after the deadline"), classTimeout},
		{ctx, errors.New("503"), classRetryable},
		{ctx, fmt.Errorf("enqueue: %w", Unavailable(errors.New("connection refused"))), classUnavailable},
		{expired, Unavailable(context.DeadlineExceeded), classUnavailable},
		{ctx, Permanent(Unavailable(errors.New("both"))), classPermanent},
	} {
		if got := classOf(c.ctx, c.err); got != c.want {
			t.Errorf("classOf(%v) = %s, want %s", c.err, got, c.want)
		}
	}
}

func TestLogSenderRedactsSecretLookingFields(t *testing.T) {
	var buf bytes.Buffer
	s := LogSender{Logger: slog.New(slog.NewJSONHandler(&buf, nil))}
	err := s.Send(context.Background(), Message{ID: 7, Topic: "email.summary_ready", DedupeKey: "summary_ready:j1",
		Payload: json.RawMessage(`{"to":"a@example.com","api_key":"sk-live-123","nested":{"Password":"hunter2","ok":1},"list":[{"token":"t0k"}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, secret := range []string{"sk-live-123", "hunter2", "t0k"} {
		if strings.Contains(out, secret) {
			t.Errorf("log line leaks %q: %s", secret, out)
		}
	}
	for _, keep := range []string{"summary_ready:j1", "a@example.com", `\"ok\":1`, "email.summary_ready"} {
		if !strings.Contains(out, keep) {
			t.Errorf("log line lacks %q: %s", keep, out)
		}
	}
	buf.Reset()
	_ = s.Send(context.Background(), Message{Payload: json.RawMessage(`not json`)})
	if !strings.Contains(buf.String(), "unparseable payload") {
		t.Errorf("bad payload logged as %s", buf.String())
	}
}

// One permanent marker: whoever marked the error (retry, queue or outbox), the relay
// sees it as permanent.
func TestPermanentIsRetryPermanent(t *testing.T) {
	base := errors.New("HTTP 400")
	for _, err := range []error{Permanent(base), retry.Permanent(base)} {
		if !IsPermanent(err) || !errors.Is(err, ErrPermanent) || !retry.IsPermanent(err) || !errors.Is(err, base) {
			t.Fatalf("%v is not permanent everywhere", err)
		}
	}
	if d, ok := RetryAfterOf(retry.RetryAfter(2*time.Second, base)); !ok || d != 2*time.Second {
		t.Fatalf("RetryAfterOf(retry.RetryAfter) = %v %v", d, ok)
	}
}

// The delay of a send that met an outage grows with the outage's age, between the
// backoff's base and cap, per topic, and starts again once a send of the topic
// succeeded.
func TestOutageDelayGrowsWithTheOutage(t *testing.T) {
	const base, most = time.Second, time.Minute
	var o outages
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	upper := func(topic string, at time.Duration) time.Duration {
		var worst time.Duration
		for range 2000 {
			d := o.delay(topic, start.Add(at), base, most)
			if d < 0 {
				t.Fatalf("negative delay %v", d)
			}
			worst = max(worst, d)
		}
		return worst
	}
	for _, c := range []struct {
		at, lo, hi time.Duration
	}{
		{0, base / 2, base}, // the first failure: up to base
		{10 * time.Second, 5 * time.Second, 10 * time.Second},
		{30 * time.Second, 15 * time.Second, 30 * time.Second},
		{time.Hour, most / 2, most}, // capped
	} {
		if got := upper("a", c.at); got < c.lo || got > c.hi {
			t.Errorf("%v into the outage: longest delay %v, want in [%v, %v]", c.at, got, c.lo, c.hi)
		}
	}
	if got := upper("b", time.Hour); got > base {
		t.Errorf("another topic's first failure: delay up to %v, want at most base %v", got, base)
	}
	o.over("a")
	if got := upper("a", 2*time.Hour); got > base {
		t.Errorf("after a success: delay up to %v, want the outage to start again at base %v", got, base)
	}
}
