package summaries_test

import (
	"context"
	"encoding/json"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// Messages already in the stream when the service is upgraded were written in the wire
// format of the releases before job kinds (version 1: no kind field). The summaries
// queue's DefaultKind routes them to the summary worker: each is summarised, committed
// with its one email intent, and the email sent once, as a new message would be.
func TestV1MessagesInTheStreamAreStillProcessed(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}

	// The old producer's entries, field by field as the releases before kinds XADDed
	// them (v, job_id, tenant, payload, enqueued_at, traceparent), with no job index.
	ids := []string{"6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c0001", "6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c0002"}
	for i, id := range ids {
		payload, _ := json.Marshal(summaries.Request{Text: "Report " + strconv.Itoa(i) + ": revenue grew.", Notify: "ops@example.com"})
		err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), Values: []any{
			"v", "1", "job_id", id, "tenant", "acme", "payload", string(payload),
			"enqueued_at", strconv.FormatInt(time.Now().UnixMilli(), 10), "traceparent", "",
		}}).Err()
		if err != nil {
			t.Fatal(err)
		}
	}
	// And one through today's queue.Enqueue of a message without a kind, which writes
	// version 1 with its job index.
	third := "6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c0003"
	payload, _ := json.Marshal(summaries.Request{Text: "Report 2: churn fell.", Notify: "ops@example.com"})
	if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: third, Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, third)
	if fields, _ := rdb.XRange(ctx, keys.Stream(), "-", "+").Result(); len(fields) != 3 || fields[0].Values["kind"] != nil || fields[2].Values["kind"] != nil {
		t.Fatalf("stream %v: want 3 entries without a kind field", fields)
	}

	var mu sync.Mutex
	sent := map[string]int{}
	model := fake.New()
	c, err := onceflow.NewClient(onceflow.Config{
		Redis: rdb, DB: pool, Prefix: prefix, Model: model, Provider: "fake", Logger: testenv.Logger(t),
		Relay: outbox.Config{PollInterval: 20 * time.Millisecond},
		Senders: map[string]outbox.Sender{summaries.TopicSummaryReady: outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
			mu.Lock()
			sent[m.DedupeKey]++
			mu.Unlock()
			return nil
		})},
		Workflows: []onceflow.Workflow{summaries.Workflow(summaries.Options{Tenant: bearerTenant, Logger: testenv.Logger(t)})},
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	testenv.WaitFor(t, 20*time.Second, "three emails", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(sent) == 3
	})
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if n := count(t, pool, `SELECT count(*) FROM summaries WHERE job_id = $1 AND tenant = 'acme'`, id); n != 1 {
			t.Errorf("job %s: %d summaries, want 1", id, n)
		}
		if n := count(t, pool, `SELECT count(*) FROM job_completions WHERE job_id = $1 AND kind = $2`, id, summaries.JobKind); n != 1 {
			t.Errorf("job %s: %d completion records of kind %s, want 1", id, n, summaries.JobKind)
		}
		if n := count(t, pool, `SELECT count(*) FROM outbox WHERE dedupe_key = $1`, summaries.DedupeKey(id)); n != 1 {
			t.Errorf("job %s: %d outbox rows, want 1", id, n)
		}
		if sent[summaries.DedupeKey(id)] != 1 {
			t.Errorf("job %s: %d emails, want 1", id, sent[summaries.DedupeKey(id)])
		}
	}
	if model.Calls() != 3 {
		t.Errorf("%d model calls, want 3", model.Calls())
	}
	st, err := queue.ReadStats(ctx, rdb, keys, queue.DefaultGroup)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 0 || st.Dead != 0 {
		t.Fatalf("queue after the run: %d pending, %d dead-lettered, want none", st.Pending, st.Dead)
	}
}
