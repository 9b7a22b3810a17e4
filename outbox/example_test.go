package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// memStore is a tiny in-memory outbox.Store, enough to show the Relay's API; production
// code uses pgoutbox.Store.
type memStore struct {
	mu   sync.Mutex
	rows []outbox.Message
	sent map[int64]bool
	dead map[int64]string
}

func (s *memStore) Claim(_ context.Context, _ string, limit int, _ time.Duration) ([]outbox.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []outbox.Message
	for _, m := range s.rows {
		if !s.sent[m.ID] && s.dead[m.ID] == "" && len(out) < limit {
			out = append(out, m)
		}
	}
	return out, nil
}

func (s *memStore) Settle(_ context.Context, _ string, st outbox.Settlement) (outbox.Settled, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range st.Sent {
		s.sent[id] = true
	}
	var exhausted []int64
	for _, f := range st.Failed {
		s.dead[f.ID] = f.Error
		exhausted = append(exhausted, f.ID)
	}
	return outbox.Settled{Sent: st.Sent, Exhausted: exhausted, Released: st.Released}, nil
}

func (s *memStore) PurgeSent(context.Context, time.Duration, int) (int64, error) { return 0, nil }

func ExampleRelay() {
	store := &memStore{sent: map[int64]bool{}, dead: map[int64]string{}, rows: []outbox.Message{
		{ID: 1, Topic: "email.summary_ready", DedupeKey: "summary_ready:job-1", Payload: json.RawMessage(`{"to":"a@example.com"}`)},
		{ID: 2, Topic: "email.summary_ready", DedupeKey: "summary_ready:job-2", Payload: json.RawMessage(`{"to":"not an address"}`)},
	}}
	// A sender passes the dedupe key to the provider as its idempotency key, and marks
	// failures that retrying cannot fix as permanent.
	sender := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		var p struct{ To string }
		if err := json.Unmarshal(m.Payload, &p); err != nil || p.To == "not an address" {
			return retry.Permanent(errors.New("invalid recipient"))
		}
		fmt.Printf("deliver %s with Idempotency-Key %s\n", m.Topic, m.DedupeKey)
		return nil
	})
	relay, err := outbox.NewRelay(store, sender, outbox.Config{
		Name:        "example",
		Concurrency: 1,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		panic(err)
	}
	// Run(ctx) loops until ctx is cancelled; Pass handles one batch.
	res, err := relay.Pass(context.Background())
	fmt.Printf("claimed %d, sent %d, exhausted %d, err %v\n", res.Claimed, res.Sent, res.Exhausted, err)
	// Output:
	// deliver email.summary_ready with Idempotency-Key summary_ready:job-1
	// claimed 2, sent 1, exhausted 1, err <nil>
}

func ExamplePermanent() {
	err := fmt.Errorf("send: %w", retry.Permanent(errors.New("550 no such user")))
	fmt.Println(retry.IsPermanent(err), errors.Is(err, retry.ErrPermanent))
	// Output: true true
}

// A sender per topic or prefix; the exact topic wins, else the longest prefix. Given to
// a Relay, the Router makes it claim only these topics.
func ExampleNewRouter() {
	say := func(name string) outbox.Sender {
		return outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
			fmt.Println(name, "sends", m.Topic)
			return nil
		})
	}
	router, err := outbox.NewRouter(map[string]outbox.Sender{
		"payments.refund": say("payments API"),
		"email.*":         say("mailer"),
		"email.receipt.":  say("receipt service"),
	})
	if err != nil {
		panic(err)
	}
	for _, topic := range []string{"payments.refund", "email.reply", "email.receipt.sent", "sms.alert"} {
		if err := router.Send(context.Background(), outbox.Message{Topic: topic}); err != nil {
			fmt.Println(err, errors.Is(err, outbox.ErrNoSender))
		}
	}
	fmt.Printf("%+v\n", router.Topics())
	// Output:
	// payments API sends payments.refund
	// mailer sends email.reply
	// receipt service sends email.receipt.sent
	// outbox router: topic "sms.alert": no sender for the topic true
	// {Topics:[payments.refund] Prefixes:[email.receipt. email.]}
}
