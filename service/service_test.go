package service_test

import (
	"net/http"
	"reflect"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/service"
	"github.com/onceflow/onceflow/summaries"
)

// The settings reach the summaries workflow: its queue's settings, its sender, its
// routes' statuses; a sender's bad settings are Workflows' error.
func TestWorkflowTakesTheSettings(t *testing.T) {
	cfg := config.Defaults()
	cfg.WorkerConcurrency, cfg.ClaimIdle, cfg.MaxDeliveries = 7, 3*time.Second, 9
	cfg.ShutdownTimeout, cfg.StatsInterval = 11*time.Second, 13*time.Second
	sender := outbox.LogSender{}
	declared := map[string][]int{}
	h := cli.Host{
		Config: cfg, Tenant: func(*http.Request) (string, error) { return "acme", nil },
		Unauthorized:  http.NotFoundHandler(),
		Sender:        func() (outbox.Sender, error) { return sender, nil },
		RouteStatuses: func(p string, codes ...int) { declared[p] = append(declared[p], codes...) },
	}
	wfs, err := service.Workflows(h)
	if err != nil || len(wfs) != 1 || wfs[0].Name != summaries.Name {
		t.Fatalf("Workflows: %v %v, want the summaries workflow alone", wfs, err)
	}
	want := onceflow.QueueConfig{Concurrency: 7, ClaimIdle: 3 * time.Second, MaxDeliveries: 9,
		ShutdownTimeout: 11 * time.Second, StatsInterval: 13 * time.Second, DefaultKind: summaries.JobKind}
	if got := wfs[0].Queues[summaries.QueueName]; !reflect.DeepEqual(got, want) {
		t.Errorf("queue %+v, want %+v", got, want)
	}
	if wfs[0].Senders[summaries.TopicSummaryReady] != sender || len(wfs[0].Senders) != 1 {
		t.Errorf("senders %v, want ONCEFLOW_SENDER's for %s only", wfs[0].Senders, summaries.TopicSummaryReady)
	}
	if len(declared["POST /v1/summaries"]) == 0 || len(declared["GET /v1/summaries/{job_id}"]) == 0 {
		t.Errorf("declared statuses %v, want both routes'", declared)
	}
	h.Sender = func() (outbox.Sender, error) { return nil, &config.Error{Name: "ONCEFLOW_WEBHOOK_URL"} }
	if _, err := service.Workflows(h); err == nil {
		t.Error("Workflows with a bad sender: no error")
	}
}
