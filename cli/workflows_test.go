package cli

import (
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
)

// A workflow's zero queue settings take the ONCEFLOW_* ones, ONCEFLOW_DLQ_RETENTION
// among them (0 there keeps dead letters for ever: negative in QueueConfig); its own
// settings win.
func TestWorkflowQueuesTakeTheSettings(t *testing.T) {
	e := &env{app: App{Workflows: func(Host) ([]onceflow.Workflow, error) {
		return []onceflow.Workflow{{Name: "w", Queues: map[string]onceflow.QueueConfig{
			"zero": {}, "own": {Concurrency: 3, DeadLetterRetention: time.Hour},
		}}}, nil
	}}}
	for _, tc := range []struct {
		retention, want time.Duration
	}{{0, -1}, {72 * time.Hour, 72 * time.Hour}} {
		cfg := config.Defaults()
		cfg.DLQRetention, cfg.WorkerConcurrency = tc.retention, 17
		wfs, err := e.workflows(e.host(cfg, nil, nil))
		if err != nil {
			t.Fatal(err)
		}
		zero, own := wfs[0].Queues["zero"], wfs[0].Queues["own"]
		if zero.DeadLetterRetention != tc.want || zero.Concurrency != 17 || zero.ClaimIdle != cfg.ClaimIdle {
			t.Errorf("ONCEFLOW_DLQ_RETENTION=%v: zero queue %+v, want retention %v, concurrency 17", tc.retention, zero, tc.want)
		}
		if own.DeadLetterRetention != time.Hour || own.Concurrency != 3 {
			t.Errorf("the workflow's own settings lost: %+v", own)
		}
	}
	if wfs, err := (&env{}).workflows(e.host(config.Defaults(), nil, nil)); wfs != nil || err != nil {
		t.Errorf("App.Workflows nil: %v %v, want none", wfs, err)
	}
}
