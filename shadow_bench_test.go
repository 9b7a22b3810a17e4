package onceflow_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// BenchmarkShadows runs b.N production jobs of one model step (a model that answers in
// 20 ms) and one commit, at concurrency 16, with the step shadowed on a candidate at
// rate 0 (off), 0.1 and 1: production's goodput (jobs/s, counted when the production
// commit lands, the shadows still running beside it), its latency from enqueue to
// commit (p50, p99), and the PostgreSQL statements per production job. The shadows run
// on the shadow queue of the same process, as they would on the same fleet.
// docs/BENCHMARKS.md has the figures.
func BenchmarkShadows(b *testing.B) {
	for _, rate := range []float64{0, 0.1, 1} {
		b.Run(fmt.Sprintf("rate=%v", rate), func(b *testing.B) { benchModelStep(b, rate, nil, benchStep{}) })
	}
}

// BenchmarkLedgerRequests runs the jobs of BenchmarkShadows (no shadow) with a request of
// about 2 KB, as a document to summarise is, with the ledger storing each request (for
// onceflow eval: ledger.Config.KeepRequests) and not (the default).
func BenchmarkLedgerRequests(b *testing.B) {
	for _, keep := range []bool{false, true} {
		b.Run(fmt.Sprintf("keep=%v", keep), func(b *testing.B) { benchModelStep(b, 0, nil, benchStep{text: 2048, keepRequests: keep}) })
	}
}

// benchStep varies benchModelStep's jobs: the size of the request's text (0: a few
// bytes) and whether the ledger stores requests.
type benchStep struct {
	text         int
	keepRequests bool
}

// BenchmarkGates runs the jobs of BenchmarkShadows (no shadow) without a gate and
// behind a gate their answers pass (a JSON Schema; a judge, a model call of its own):
// the gate's cost per job.
func BenchmarkGates(b *testing.B) {
	b.Run("gate=none", func(b *testing.B) { benchModelStep(b, 0, nil, benchStep{}) })
	b.Run("gate=schema", func(b *testing.B) {
		benchModelStep(b, 0, []onceflow.Gate{{Step: "summary", Schema: json.RawMessage(`{"type":"object","required":["summary"]}`)}}, benchStep{})
	})
	b.Run("gate=judge", func(b *testing.B) {
		benchModelStep(b, 0, []onceflow.Gate{{Step: "summary", Judge: &onceflow.Judge{Model: "judge", Criteria: "Faithful."}}}, benchStep{})
	})
}

// slowModel answers every request after latency with a JSON object.
type slowModel struct {
	modelsByName
	latency time.Duration
}

func (m *slowModel) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(m.latency):
	}
	content := `{"summary":"shipped"}`
	if req.Model == "judge" {
		content = `{"score":1,"reason":"faithful"}`
	}
	return &llm.Response{Model: req.Model, Content: content, FinishReason: llm.FinishStop, Usage: llm.Usage{InputTokens: 50, OutputTokens: 10}}, nil
}

func benchModelStep(b *testing.B, rate float64, gates []onceflow.Gate, opt benchStep) {
	b.StopTimer()
	rdb, prefix := testenv.Redis(b)
	db, _, tracer := tracedPool(b)
	defer db.Close()
	var (
		done      atomic.Int64
		all       = make(chan struct{})
		mu        sync.Mutex
		latencies []time.Duration
	)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, j *onceflow.Job[shadowedTicket]) error {
		st, err := j.Complete(ctx, "summary", &llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: j.Args.Text}}})
		if err != nil {
			return err
		}
		err = j.Commit(ctx, func(c *onceflow.Commit) error { c.Result(json.RawMessage(st.Response.Content)); return nil })
		if err == nil {
			mu.Lock()
			latencies = append(latencies, time.Since(j.EnqueuedAt))
			mu.Unlock()
			if done.Add(1) == int64(b.N) {
				close(all)
			}
		}
		return err
	}))
	var shadows []onceflow.Shadow
	if rate > 0 {
		shadows = []onceflow.Shadow{{Step: "summary", Model: "candidate", Rate: rate}}
	}
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: ws, Model: &slowModel{latency: 20 * time.Millisecond},
		NoLimits: true, Shadows: shadows, Gates: gates, Ledger: ledger.Config{KeepRequests: opt.keepRequests}, Logger: slog.New(slog.DiscardHandler), QueueDefaults: onceflow.QueueConfig{Concurrency: 16}})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(ctx) }()
	statements := tracer.n.Load()
	b.StartTimer()
	start := time.Now()
	for i := range b.N {
		text := fmt.Sprint("ticket ", i)
		if opt.text > len(text) {
			text += strings.Repeat(" lorem ipsum", (opt.text-len(text))/12)
		}
		if _, err := c.Enqueue(context.Background(), shadowedTicket{Text: text}, nil); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-all:
	case <-time.After(10 * time.Minute):
		b.Fatalf("%d of %d jobs done in 10 minutes", done.Load(), b.N)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	statements = tracer.n.Load() - statements
	cancel()
	<-stopped
	mu.Lock()
	slices.Sort(latencies)
	p50, p99 := latencies[len(latencies)/2], latencies[len(latencies)*99/100]
	mu.Unlock()
	n := float64(b.N)
	b.ReportMetric(n/elapsed.Seconds(), "jobs/s")
	b.ReportMetric(float64(p50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(p99.Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(statements)/n, "statements/job")
}
