package cli

import (
	"testing"
	"time"

	"github.com/onceflow/onceflow/config"
)

// The Client's QueueDefaults are the ONCEFLOW_* queue settings, ONCEFLOW_DLQ_RETENTION
// among them (0 there keeps dead letters for ever: negative in QueueConfig); a queue's
// own settings win over them (onceflow's TestQueueDefaultsFillOnlyZeroSettings).
func TestWorkflowQueuesTakeTheSettings(t *testing.T) {
	for _, tc := range []struct {
		retention, want time.Duration
	}{{0, -1}, {72 * time.Hour, 72 * time.Hour}} {
		cfg := config.Defaults()
		cfg.DLQRetention, cfg.WorkerConcurrency = tc.retention, 17
		d := queueDefaults(cfg)
		if d.DeadLetterRetention != tc.want || d.Concurrency != 17 || d.ClaimIdle != cfg.ClaimIdle ||
			d.MaxDeliveries != cfg.MaxDeliveries || d.ShutdownTimeout != cfg.ShutdownTimeout || d.StatsInterval != cfg.StatsInterval {
			t.Errorf("ONCEFLOW_DLQ_RETENTION=%v: queue defaults %+v, want retention %v, concurrency 17 and the settings", tc.retention, d, tc.want)
		}
	}
	e := &env{}
	if wfs, err := e.workflows(e.host(config.Defaults(), nil, nil)); wfs != nil || err != nil {
		t.Errorf("App.Workflows nil: %v %v, want none", wfs, err)
	}
}
