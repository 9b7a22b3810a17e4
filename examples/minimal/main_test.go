package main

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/onceflowtest"
)

// The program, run twice on the same stores: the first run sends the welcome once; the
// second's enqueue with the same key is a replay, so nothing more is written or sent.
func TestWelcomeIsSentOnceAcrossRuns(t *testing.T) {
	t.Parallel()
	bin := onceflowtest.Build(t, ".")
	_, prefix := onceflowtest.Redis(t)
	db, dsn := onceflowtest.Postgres(t)
	env := []string{"ONCEFLOW_REDIS_URL=" + onceflowtest.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix}

	first := onceflowtest.Start(t, bin, env)
	onceflowtest.WaitFor(t, 20*time.Second, "the welcome", func() bool { return strings.Contains(first.Stdout(), "send email.welcome") })
	first.Signal(syscall.SIGTERM)
	if code := first.Wait(20 * time.Second); code != 0 {
		t.Fatalf("first run exited %d", code)
	}

	second := onceflowtest.Start(t, bin, env)
	onceflowtest.WaitFor(t, 20*time.Second, "the second enqueue", func() bool { return strings.Contains(second.Stdout(), "replayed=true") })
	time.Sleep(time.Second) // four relay polls: time to send anything there were to send
	second.Signal(syscall.SIGTERM)
	if code := second.Wait(20 * time.Second); code != 0 {
		t.Fatalf("second run exited %d", code)
	}
	if n := strings.Count(first.Stdout()+second.Stdout(), "send email.welcome"); n != 1 {
		t.Fatalf("%d welcomes sent, want 1:\n%s%s", n, first.Stdout(), second.Stdout())
	}
	if rows, sent, done := onceflowtest.OutboxRows(t, db, "email.welcome"), onceflowtest.SentOutboxRows(t, db, ""), onceflowtest.Completions(t, db, "welcome"); rows != 1 || sent != 1 || done != 1 {
		t.Fatalf("%d outbox rows, %d sent, %d completions; want 1, 1, 1", rows, sent, done)
	}
}
