package cli_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// Reminder is a kind on the default queue, as docs/first-workflow.md's Reply is.
type Reminder struct {
	Text string `json:"text"`
}

func (Reminder) Kind() string { return "attack2.reminder" }

// A program that hosts a workflow like docs/first-workflow.md's (its kind on the
// default queue, no Workflow.Queues) with cli: `work` works the default queue, but
// none of the ONCEFLOW_* queue settings reach it (cli fills in only the workflows' declared
// Queues), so ONCEFLOW_CLAIM_IDLE, ONCEFLOW_MAX_DELIVERIES, ONCEFLOW_WORKER_CONCURRENCY,
// ONCEFLOW_SHUTDOWN_TIMEOUT and ONCEFLOW_DLQ_RETENTION are silently ignored and the
// queue package's defaults apply. Here a failing job with ONCEFLOW_CLAIM_IDLE=300ms and
// ONCEFLOW_MAX_DELIVERIES=1 should be dead-lettered within a second or two; it waits
// for the default ClaimIdle, two minutes.
func TestWorkSettingsReachTheDefaultQueue(t *testing.T) {
	_, prefix := testenv.Redis(t)
	vars := map[string]string{
		"ONCEFLOW_REDIS_URL":      testenv.RedisURL(t),
		"ONCEFLOW_DATABASE_URL":   testenv.EmptySchema(t),
		"ONCEFLOW_PREFIX":         prefix,
		"ONCEFLOW_HTTP_ADDR":      fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)),
		"ONCEFLOW_LOG_FORMAT":     "text",
		"ONCEFLOW_CLAIM_IDLE":     "300ms",
		"ONCEFLOW_MAX_DELIVERIES": "1",
	}
	getenv := func(k string) string { return vars[k] }
	var runs atomic.Int64
	app := cli.App{Name: "reminders", Workflows: func(cli.Host) ([]onceflow.Workflow, error) {
		return []onceflow.Workflow{{Name: "reminders", Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Reminder](func(context.Context, *onceflow.Job[Reminder]) error {
				runs.Add(1)
				return errors.New("the reminder service is broken")
			}))
		}}}, nil
	}}
	var errs bytes.Buffer
	if err := cli.Run(context.Background(), app, []string{"migrate"}, &bytes.Buffer{}, &errs, getenv); err != nil {
		t.Fatalf("migrate: %v %s", err, errs.String())
	}
	rdb, err := onceflow.NewRedis(vars["ONCEFLOW_REDIS_URL"])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(context.Background(), Reminder{Text: "x"}, nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cli.Run(ctx, app, []string{"work"}, &bytes.Buffer{}, &bytes.Buffer{}, getenv) }()
	t.Cleanup(func() { cancel(); <-done })
	keys := queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}
	deadline := time.Now().Add(20 * time.Second)
	for rdb.XLen(context.Background(), keys.Dead()).Val() == 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if n := rdb.XLen(context.Background(), keys.Dead()).Val(); n != 1 {
		t.Fatalf("after 20s with ONCEFLOW_CLAIM_IDLE=300ms and ONCEFLOW_MAX_DELIVERIES=1: %d dead letters, %d runs; want the failing job dead-lettered", n, runs.Load())
	}
}
