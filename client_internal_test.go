package onceflow

import (
	"testing"
	"time"
)

// Config.QueueDefaults fill a queue's zero settings only: its own win, and what
// QueueDefaults do not cover (DefaultKind, Gate) is left alone.
func TestQueueDefaultsFillOnlyZeroSettings(t *testing.T) {
	t.Parallel()
	d := QueueConfig{Concurrency: 17, ClaimIdle: time.Minute, MaxDeliveries: 9, ShutdownTimeout: time.Second,
		StatsInterval: 3 * time.Second, DeadLetterRetention: time.Hour, DefaultKind: "not.copied"}
	if got := (QueueConfig{}).withDefaults(d); got != (QueueConfig{Concurrency: 17, ClaimIdle: time.Minute, MaxDeliveries: 9,
		ShutdownTimeout: time.Second, StatsInterval: 3 * time.Second, DeadLetterRetention: time.Hour, Partitions: 1}) {
		t.Errorf("a zero queue: %+v", got)
	}
	own := QueueConfig{Concurrency: 3, DeadLetterRetention: -1, DefaultKind: "summary"}
	got := own.withDefaults(d)
	if got.Concurrency != 3 || got.DeadLetterRetention != -1 || got.DefaultKind != "summary" || got.ClaimIdle != time.Minute {
		t.Errorf("a queue with its own settings: %+v", got)
	}
}
