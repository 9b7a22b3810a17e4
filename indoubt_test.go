package onceflow_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

// An operator resolves a tool call in doubt while Redis is down: the resolution is
// recorded in PostgreSQL but the job cannot be put back. Once Redis is back, retrying
// the resolution (what the error invites) must put the job back so it finishes; it must
// not answer "not in doubt" and leave the job dead-lettered for good.
func TestResolveInDoubtRetriedAfterARedisOutagePutsTheJobBack(t *testing.T) {
	t.Parallel()
	srv, rdb := privateRedisClient(t)
	var sent atomic.Int64
	e := newStepEnvOn(t, rdb, onceflowtestModel("send_email", `{"to":"a@example.com"}`), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		st, err := j.Complete(ctx, "plan", prompt(j.Args.Order))
		if err != nil {
			return err
		}
		_, err = j.ToolAtMostOnce(ctx, j.ToolCalls(st)[0], func(ctx context.Context, key string) (string, error) {
			if sent.Add(1) == 1 {
				return "", fmt.Errorf("SMTP: timeout after DATA: %w", onceflow.ErrInDoubt)
			}
			return "sent", nil
		})
		return err
	})
	id := e.enqueue("R-1")
	runTolerant(t, e.client)
	st := e.waitStatus(id, onceflow.StatusInDoubt)
	key := st.InDoubt[0].Key
	in := e.client.Inspector()

	srv.Stop()
	err := in.ResolveInDoubt(context.Background(), "", id, key, onceflow.Resolution{Happened: true, Result: "sent by hand"})
	t.Logf("resolution during the outage: %v", err)
	if err == nil {
		t.Fatal("resolution during a Redis outage reported success")
	}
	srv.Start()

	err = in.ResolveInDoubt(context.Background(), "", id, key, onceflow.Resolution{Happened: true, Result: "sent by hand"})
	t.Logf("the same resolution retried after the outage: %v", err)
	var got *onceflow.JobState
	t.Cleanup(func() {
		if t.Failed() && got != nil {
			list, _ := in.InDoubt(context.Background(), 10)
			t.Logf("the job stays %s (error %q); jobs in doubt listed: %d", got.Status, got.Error, len(list))
		}
	})
	testenv.WaitFor(t, 15*time.Second, "the resolved job to finish", func() bool {
		var err error
		got, err = e.client.JobState(context.Background(), "", id)
		return err == nil && got.Status == onceflow.StatusDone
	})
}
