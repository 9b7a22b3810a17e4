package outbox_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// topicRecorder is a Sender that records the dedupe keys it sent.
type topicRecorder struct {
	mu   sync.Mutex
	keys []string
}

func (r *topicRecorder) Send(_ context.Context, m outbox.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.keys = append(r.keys, m.DedupeKey)
	return nil
}

func (r *topicRecorder) sent() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(slices.Values(r.keys))
}

func TestRouterPicksTheExactTopicElseTheLongestPrefix(t *testing.T) {
	t.Parallel()
	named := func(name string) outbox.Sender {
		return outbox.SenderFunc(func(context.Context, outbox.Message) error { return errors.New(name) })
	}
	r, err := outbox.NewRouter(map[string]outbox.Sender{
		"payments.refund": named("refund"),
		"payments.":       named("payments"),
		"email.*":         named("email"),
		"email.receipt.":  named("receipts"),
		"pay*":            named("pay"),
	})
	if err != nil {
		t.Fatal(err)
	}
	for topic, want := range map[string]string{
		"payments.refund":      "refund",
		"payments.refund.late": "payments",
		"payments.charge":      "payments",
		"payout":               "pay",
		"email.reply":          "email",
		"email.receipt.sent":   "receipts",
		"email":                "",
		"sms.reply":            "",
	} {
		err := r.Send(context.Background(), outbox.Message{Topic: topic})
		switch {
		case want == "" && !errors.Is(err, outbox.ErrNoSender):
			t.Errorf("%s: %v, want ErrNoSender", topic, err)
		case want == "" && retry.IsPermanent(err):
			t.Errorf("%s: no sender is permanent; another process may send it", topic)
		case want != "" && (err == nil || err.Error() != want):
			t.Errorf("%s: sent by %v, want %s", topic, err, want)
		}
	}
	got := r.Topics()
	if !slices.Equal(got.Topics, []string{"payments.refund"}) ||
		!slices.Equal(got.Prefixes, []string{"email.receipt.", "payments.", "email.", "pay"}) || got.All() {
		t.Fatalf("topics %+v", got)
	}
	all, err := outbox.NewRouter(map[string]outbox.Sender{"*": named("all"), "email.": named("email")})
	if err != nil || !all.Topics().All() {
		t.Fatalf("a \"*\" router: %v %+v, want every topic", err, all)
	}
	if err := all.Send(context.Background(), outbox.Message{Topic: "anything"}); err == nil || err.Error() != "all" {
		t.Fatalf("catch-all: %v", err)
	}
}

func TestNewRouterRejectsAmbiguousOrEmptyKeys(t *testing.T) {
	t.Parallel()
	s := outbox.SenderFunc(func(context.Context, outbox.Message) error { return nil })
	for name, senders := range map[string]map[string]outbox.Sender{
		"nil sender":  {"email.": nil},
		"empty key":   {"": s},
		"inner star":  {"email.*.sent": s},
		"same prefix": {"email.": s, "email.*": s},
	} {
		if _, err := outbox.NewRouter(senders); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestValidTopicAcceptsOnlyShortPrintableASCIIWithoutWildcards(t *testing.T) {
	t.Parallel()
	for topic, want := range map[string]bool{
		"payments.refund": true, "email.reply_sent": true, "a": true, "x:y-z/1": true,
		"": false, "has space": false, "email.*": false, "tab\t": false, "é": false,
		string(make([]byte, outbox.MaxTopicLen+1)): false,
	} {
		if got := outbox.ValidTopic(topic); got != want {
			t.Errorf("ValidTopic(%q) = %v", topic, got)
		}
	}
}

// Two senders, and a topic this process has no sender for: the relay sends each routed
// row to its sender and never claims the other row, which stays unsent, unattempted
// and not exhausted for a process that sends it.
func TestRelayClaimsOnlyTheTopicsItHasSendersFor(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 0, webhooksink.Options{})
	e.exec(t, `INSERT INTO outbox (topic, dedupe_key, payload) VALUES
		('payments.refund', 'refund:1', '{}'), ('email.reply', 'reply:1', '{}'),
		('email.receipt', 'receipt:1', '{}'), ('sms.reply', 'sms:1', '{}')`)
	payments, email := &topicRecorder{}, &topicRecorder{}
	router, err := outbox.NewRouter(map[string]outbox.Sender{"payments.refund": payments, "email.*": email})
	if err != nil {
		t.Fatal(err)
	}
	relay := e.relayWith(t, e.store, router, outbox.Config{Name: "routed", MaxAttempts: 1})
	ctx := ctxT(t)
	for range 3 {
		if _, err := relay.Pass(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := payments.sent(); !slices.Equal(got, []string{"refund:1"}) {
		t.Errorf("payments sender sent %q", got)
	}
	if got := email.sent(); !slices.Equal(got, []string{"receipt:1", "reply:1"}) {
		t.Errorf("email sender sent %q", got)
	}
	if n := e.count(t, `dedupe_key = 'sms:1' AND sent_at IS NULL AND exhausted_at IS NULL AND attempts = 0 AND claimed_by IS NULL`); n != 1 {
		t.Fatal("the row without a sender was touched")
	}
	if n := e.count(t, `sent_at IS NOT NULL`); n != 3 {
		t.Fatalf("%d rows sent, want 3", n)
	}

	// Another process, with a sender for it, sends it.
	sms := &topicRecorder{}
	other := e.relayWith(t, e.store, outbox.SenderFunc(sms.Send), outbox.Config{Name: "other"})
	if res, err := other.Pass(ctx); err != nil || res.Sent != 1 || !slices.Equal(sms.sent(), []string{"sms:1"}) {
		t.Fatalf("the other relay: %+v %v, sent %q", res, err, sms.sent())
	}
}

// A router's topic filter needs a store that can apply it.
func TestRelayWithARouterNeedsATopicStore(t *testing.T) {
	t.Parallel()
	router, err := outbox.NewRouter(map[string]outbox.Sender{"email.": &topicRecorder{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.NewRelay(&memStore{}, router, outbox.Config{}); err == nil {
		t.Fatal("a store that cannot claim by topic was accepted with a router")
	}
	all, _ := outbox.NewRouter(map[string]outbox.Sender{"*": &topicRecorder{}})
	if _, err := outbox.NewRelay(&memStore{}, all, outbox.Config{}); err != nil {
		t.Fatalf("a catch-all router needs no filter: %v", err)
	}
}

// An empty claim set costs nothing: a router with no senders claims no row.
func TestClaimTopicsOfNoTopicClaimsNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2, webhooksink.Options{})
	msgs, err := e.store.ClaimTopics(ctxT(t), "r", outbox.TopicSet{}, 10, time.Minute)
	if err != nil || len(msgs) != 0 {
		t.Fatalf("claimed %d rows, %v", len(msgs), err)
	}
	msgs, err = e.store.ClaimTopics(ctxT(t), "r", outbox.TopicSet{Prefixes: []string{"email.summary"}}, 10, time.Minute)
	if err != nil || len(msgs) != 2 {
		t.Fatalf("prefix claim: %d rows, %v", len(msgs), err)
	}
}
