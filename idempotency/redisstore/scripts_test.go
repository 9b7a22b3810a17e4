package redisstore

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv/scriptcheck"
	"github.com/onceflow/onceflow/queue"
)

// TestScriptsRunWithTheKeysTheirHeadersName runs every script of the store (complete,
// release, and the accept composed with Accept's write and with each of the queue's
// steps) on a client whose script calls are recorded as Redis receives them, and checks
// that every .lua file of the store ran, each call with the number of keys and args its
// header names (for a composed accept: its own and its step function's).
func TestScriptsRunWithTheKeysTheirHeadersName(t *testing.T) {
	t.Parallel()
	s, _ := newTestStore(t, Config{ResultTTL: time.Hour})
	rec := scriptcheck.Record(s.rdb)
	ctx := context.Background()
	scope := func(key string) idempotency.Scope {
		return idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/x", Key: key + "-0123456789abcdef"}
	}

	lock, _, err := s.Claim(ctx, scope("complete"), testFP, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, lock, accepted(), time.Hour); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	lock, _, err = s.Claim(ctx, scope("release"), testFP, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, lock); err != nil {
		t.Fatalf("Release: %v", err)
	}

	f := &acceptFixture{s: s, stream: s.cfg.Prefix + ":{summaries}:stream", index: s.cfg.Prefix + ":{summaries}:job:11111111-2222-5333-8444-555555555555"}
	if _, _, err := s.Accept(ctx, scope("accept"), testFP, accepted(), f.enqueue(body1)); err != nil {
		t.Fatalf("Accept: %v", err)
	}
	keys := queue.Keys{Prefix: s.cfg.Prefix, Queue: "summaries"}
	m := queue.Message{JobID: "11111111-2222-5333-8444-666666666666", Tenant: "acme", Payload: []byte(`{"n":1}`)}
	now, err := queue.EnqueueStep(keys, m)
	if err != nil {
		t.Fatal(err)
	}
	m.JobID = "11111111-2222-5333-8444-777777777777"
	later, err := queue.EnqueueAtStep(keys, m, time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	for name, step := range map[string]Step{"enqueue": now, "enqueue_at": later} {
		if _, replayed, err := s.AcceptStep(ctx, scope(name), testFP, accepted(), step); err != nil || replayed {
			t.Fatalf("AcceptStep with the queue's %s = (%v, %v), want accepted", name, replayed, err)
		}
	}
	rec.Check(t, scripts)
}
