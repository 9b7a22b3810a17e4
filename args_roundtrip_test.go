package onceflow_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// reminderArgs has a time.Duration, as River users' args often do (a delay, a timeout).
type reminderArgs struct {
	To    string        `json:"to"`
	After time.Duration `json:"after"`
}

func (reminderArgs) Kind() string { return "test.reminder" }

// Any arguments Enqueue accepts reach their Worker: Enqueue encodes with the JSON
// semantics the worker decodes with (encoding/json/v2's), so what the worker would
// refuse (a time.Duration has no default representation there) Enqueue refuses at
// once, never accepting a job that can only be dead-lettered. (It failed before: Enqueue
// encoded with encoding/json v1 and the job was dead-lettered as undecodable.)
func TestArgsWithADurationRoundTripOrAreRefused(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var got atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[reminderArgs](func(_ context.Context, j *onceflow.Job[reminderArgs]) error {
		got.Store(int64(j.Args.After))
		return nil
	}))
	c := newClient(t, rdb, prefix, ws, nil)
	ctx := context.Background()
	_, err := c.Enqueue(ctx, reminderArgs{To: "ann@example.com", After: 90 * time.Second}, nil)
	if err != nil {
		t.Logf("Enqueue refused the arguments: %v", err) // acceptable: refused up front
		return
	}
	runClient(t, c)
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	testenv.WaitFor(t, 10*time.Second, "the job run or dead-lettered", func() bool {
		n, _ := rdb.XLen(ctx, keys.Dead()).Result()
		return got.Load() != 0 || n > 0
	})
	if got.Load() != int64(90*time.Second) {
		dead, _, _ := queue.ListDead(ctx, rdb, keys, "", 1)
		reason := ""
		if len(dead) > 0 {
			reason = dead[0].Reason
		}
		t.Errorf("a job Enqueue accepted never reached its worker: dead-lettered with %q", reason)
	}
}

// digestArgs has a fixed-size byte array (a hash, a key), which encoding/json encodes as
// an array of numbers and json v2 expects as a base64 string.
type digestArgs struct {
	Sum [4]byte `json:"sum"`
}

func (digestArgs) Kind() string { return "test.digest" }

// Expected: as TestArgsWithADurationRoundTripOrAreRefused, for a [N]byte field. Today the
// job is dead-lettered with "sum: must be an array" (it is one).
func TestArgsWithAByteArrayRoundTripOrAreRefused(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var got atomic.Int64
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[digestArgs](func(_ context.Context, j *onceflow.Job[digestArgs]) error {
		got.Store(int64(j.Args.Sum[3]))
		return nil
	}))
	c := newClient(t, rdb, prefix, ws, nil)
	ctx := context.Background()
	if _, err := c.Enqueue(ctx, digestArgs{Sum: [4]byte{1, 2, 3, 4}}, nil); err != nil {
		t.Logf("Enqueue refused the arguments: %v", err)
		return
	}
	runClient(t, c)
	keys := c.Inspector().QueueKeys(onceflow.DefaultQueue)
	testenv.WaitFor(t, 10*time.Second, "the job run or dead-lettered", func() bool {
		n, _ := rdb.XLen(ctx, keys.Dead()).Result()
		return got.Load() != 0 || n > 0
	})
	if got.Load() != 4 {
		dead, _, _ := queue.ListDead(ctx, rdb, keys, "", 1)
		reason := ""
		if len(dead) > 0 {
			reason = dead[0].Reason
		}
		t.Errorf("a job Enqueue accepted never reached its worker: dead-lettered with %q", reason)
	}
}
