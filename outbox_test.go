package onceflow_test

import (
	"context"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// keyRecorder is a Sender that records the dedupe keys it sent.
type keyRecorder struct {
	mu   sync.Mutex
	keys []string
}

func (r *keyRecorder) Send(_ context.Context, m outbox.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.keys = append(r.keys, m.DedupeKey)
	return nil
}

func (r *keyRecorder) sent() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.keys)
}

// Run's relay sends each topic with its sender: the refund to a payments webhook that
// receives the payload alone with the dedupe key as Idempotency-Key, the email to the
// email sender; a topic without a sender in this process waits, never attempted nor
// exhausted.
func TestSendersRouteEffectsByTopic(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	sink := webhooksink.New(webhooksink.Options{})
	srv := httptest.NewServer(sink)
	t.Cleanup(srv.Close)
	payments, err := webhook.New(webhook.Config{URL: srv.URL, Body: webhook.PayloadOnly})
	if err != nil {
		t.Fatal(err)
	}
	email := &keyRecorder{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[refundArgs](func(ctx context.Context, j *onceflow.Job[refundArgs]) error {
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("payments.refund", "refund:"+j.ID, j.Args)
			c.Emit("email.reply", "reply:"+j.ID, map[string]string{"to": "customer@example.com"})
			c.Emit("sms.alert", "sms:"+j.ID, map[string]string{"to": "+15550100"})
			return nil
		})
	}))
	c := e.client(onceflow.Config{Workers: ws, Senders: map[string]outbox.Sender{"payments.refund": payments, "email.*": email},
		Relay: outbox.Config{PollInterval: 20 * time.Millisecond, MaxAttempts: 1}})
	res, err := c.Enqueue(context.Background(), refundArgs{OrderID: "o-7", AmountCents: 1250}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 20*time.Second, "the refund and the email sent", func() bool {
		return sink.Count("refund:"+res.JobID) == 1 && len(email.sent()) == 1
	})
	ds := sink.Deliveries()
	if len(ds) != 1 || string(ds[0].Body) != `{"order_id": "o-7", "amount_cents": 1250}` {
		t.Fatalf("payments received %+v, want the payload alone", ds)
	}
	if got := email.sent(); got[0] != "reply:"+res.JobID {
		t.Fatalf("email sender sent %q", got)
	}
	time.Sleep(200 * time.Millisecond) // ten more relay polls
	if n := e.count(`SELECT count(*) FROM outbox WHERE dedupe_key = $1 AND sent_at IS NULL AND exhausted_at IS NULL
		AND attempts = 0 AND claimed_by IS NULL`, "sms:"+res.JobID); n != 1 {
		t.Fatal("the sms effect, which has no sender here, was claimed or attempted")
	}
}

func TestNewClientChecksSenders(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	s := &keyRecorder{}
	for name, cfg := range map[string]onceflow.Config{
		"no DB":            {Redis: e.rdb, Senders: map[string]outbox.Sender{"email.": s}},
		"reserved topic":   {Redis: e.rdb, DB: e.pool, Senders: map[string]outbox.Sender{"onceflow.enqueue": s}},
		"same prefix":      {Redis: e.rdb, DB: e.pool, Senders: map[string]outbox.Sender{"email.": s, "email.*": s}},
		"nil sender":       {Redis: e.rdb, DB: e.pool, Senders: map[string]outbox.Sender{"email.": nil}},
		"negative relay":   {Redis: e.rdb, DB: e.pool, Relay: outbox.Config{Lease: -time.Second}},
		"misplaced a star": {Redis: e.rdb, DB: e.pool, Senders: map[string]outbox.Sender{"email*.x": s}},
	} {
		if _, err := onceflow.NewClient(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		} else if !strings.Contains(err.Error(), "Config.") {
			t.Errorf("%s: %v does not name the field", name, err)
		}
	}
	c, err := onceflow.NewClient(onceflow.Config{Redis: e.rdb})
	if err != nil || c.Inspector().Sender() != nil {
		t.Fatalf("without DB: %v, sender %v", err, c.Inspector().Sender())
	}
}

// The relay Run runs exports its metrics on Config.Registerer: one effect sent counts
// one in onceflow_outbox_sent_total.
func TestRelayMetricsOnTheRegisterer(t *testing.T) {
	t.Parallel()
	e := newDBEnv(t)
	reg := prometheus.NewRegistry()
	rec := &keyRecorder{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[emailArgs](func(ctx context.Context, j *onceflow.Job[emailArgs]) error {
		return j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email.reply", "reply:"+j.ID, j.Args)
			return nil
		})
	}))
	c := e.client(onceflow.Config{Workers: ws, Registerer: reg, Senders: map[string]outbox.Sender{"email.": rec},
		Queues: map[string]onceflow.QueueConfig{"mail": {}},
		Relay:  outbox.Config{PollInterval: 20 * time.Millisecond}})
	if _, err := c.Enqueue(context.Background(), emailArgs{To: "a@example.com"}, nil); err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	testenv.WaitFor(t, 10*time.Second, "the email sent and counted", func() bool {
		return len(rec.sent()) == 1 && metricValue(t, reg, "onceflow_outbox_sent_total", nil) == 1
	})
}
