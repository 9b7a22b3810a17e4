package cli_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
)

// Ask is a job kind whose worker calls the model once.
type Ask struct {
	Q string `json:"q"`
}

func (Ask) Kind() string { return "test.ask" }

func (Ask) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "asks"} }

// A hosted workflow's model calls are counted once each on /metrics: the Client counts
// them (llmmetrics inside the ledger), and the command adds no second count.
func TestHostedModelCallsAreCountedOnce(t *testing.T) {
	getenv, _ := hostEnv(t)
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	env := func(k string) string {
		if k == "ONCEFLOW_METRICS_ADDR" {
			return metricsAddr
		}
		return getenv(k)
	}
	answered := make(chan string, 4)
	app := cli.App{Name: "asksd", Workflows: func(cli.Host) ([]onceflow.Workflow, error) {
		return []onceflow.Workflow{{
			Name:   "asks",
			Queues: map[string]onceflow.QueueConfig{"asks": {}},
			Workers: func(ws *onceflow.Workers) error {
				return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Ask](func(ctx context.Context, j *onceflow.Job[Ask]) error {
					step, err := j.Complete(ctx, "answer", &llm.Request{Messages: []llm.Message{{Role: "user", Content: j.Args.Q}}})
					if err != nil {
						return err
					}
					answered <- step.Response.Content
					return nil
				}))
			},
		}}, nil
	}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errs testenv.SyncBuffer
	if err := cli.Run(ctx, app, []string{"migrate"}, &out, &errs, env); err != nil {
		t.Fatalf("migrate: %v %s", err, errs.String())
	}
	done := make(chan error, 1)
	go func() { done <- cli.Run(ctx, app, []string{"work"}, &out, &errs, env) }()
	rdb, _ := testenv.Redis(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: env("ONCEFLOW_PREFIX"), Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, Ask{Q: "why?"}, &onceflow.EnqueueOpts{Key: "ask-1"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-answered:
	case err := <-done:
		t.Fatalf("work stopped: %v\n%s", err, errs.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("no answer\n%s", errs.String())
	}
	var calls float64
	testenv.WaitFor(t, 10*time.Second, "the call on /metrics", func() bool {
		resp, err := http.Get("http://" + metricsAddr + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		calls = 0
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "onceflow_llm_calls_total{") {
				var v float64
				if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
					calls += v
				}
			}
		}
		return calls > 0
	})
	if calls != 1 {
		t.Errorf("onceflow_llm_calls_total sums to %v after one model call, want 1", calls)
	}
	cancel()
	<-done
}
