package onceflow

import (
	"context"
	"errors"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// sendEnqueue marks a Redis outage Unavailable for the relay, once, and leaves a
// permanent verdict as it is.
func TestSendEnqueueMarksRedisOutagesUnavailable(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	c, err := NewClient(Config{Redis: rdb, Prefix: "t", Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	row := func(key string) outbox.Message {
		return outbox.Message{Topic: TopicEnqueue, DedupeKey: "enqueue:j", Payload: []byte(
			`{"queue":"default","key":"` + key + `","job_id":"00000000-0000-4000-8000-000000000001","kind":"k","args":"{}","enqueued_at":1}`)}
	}
	ctx := context.Background()
	srv.Stop()
	for _, key := range []string{"", "key-1"} {
		err := c.sendEnqueue(ctx, row(key))
		if !errors.Is(err, outbox.ErrUnavailable) || retry.IsPermanent(err) {
			t.Errorf("key %q, Redis stopped: %v, want Unavailable", key, err)
		}
		var once interface{ Unwrap() error }
		if errors.As(err, &once) && errors.Is(once.Unwrap(), outbox.ErrUnavailable) {
			t.Errorf("key %q: %v marked Unavailable twice", key, err)
		}
	}
	if err := c.sendEnqueue(ctx, outbox.Message{Topic: TopicEnqueue, Payload: []byte(`not json`)}); !retry.IsPermanent(err) || errors.Is(err, outbox.ErrUnavailable) {
		t.Errorf("undecodable row with Redis stopped: %v, want permanent only", err)
	}
}
