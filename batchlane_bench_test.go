package onceflow_test

import (
	"context"
	"fmt"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// BenchmarkBatchLane runs b.N jobs whose one model step takes the batch lane, through
// fake-llm's OpenAI Batch API over HTTP (batches of at most 1000, a batch delay of 2s),
// and reports the batches, the requests submitted more than once (0), the time from the
// first enqueue to the last job done against the fake's delay, and the synchronous
// calls (0), and what the answers cost against the same answers in the synchronous lane
// (the price tables' batch discount, as the ledger's rows record it). (That a waiting job holds no worker slot is a test's:
// TestBatchLaneAnswersEachStepOnceWithoutHoldingAWorker.)
func BenchmarkBatchLane(b *testing.B) {
	b.StopTimer()
	const delay = 2 * time.Second
	fake, err := fakeserver.New(fakeserver.Config{BatchDelay: delay, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	defer fake.Close()
	srv := httptest.NewServer(fake)
	defer srv.Close()
	model := openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "bench"})
	rdb, prefix := testenv.Redis(b)
	db, _, _ := tracedPool(b)
	defer db.Close()
	var done atomic.Int64
	all := make(chan struct{})
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, j *onceflow.Job[shadowedTicket]) error {
		st, err := j.Complete(ctx, "summary", &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: j.Args.Text}}},
			onceflow.InBatch(time.Hour))
		if err != nil {
			return err
		}
		err = j.Commit(ctx, func(c *onceflow.Commit) error { c.Result(st.Response.Content); return nil })
		if err == nil && done.Add(1) == int64(b.N) {
			close(all)
		}
		return err
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: ws, Model: model, Provider: "openai", NoLimits: true,
		Batch:  onceflow.BatchConfig{API: model.Batches(), MaxItems: 1000, MaxAge: 500 * time.Millisecond, PollInterval: 200 * time.Millisecond},
		Logger: slog.New(slog.DiscardHandler), QueueDefaults: onceflow.QueueConfig{Concurrency: 64}})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(ctx) }()
	b.StartTimer()
	start := time.Now()
	for i := range b.N {
		if _, err := c.Enqueue(context.Background(), shadowedTicket{Text: fmt.Sprint("ticket ", i)}, nil); err != nil {
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
	cancel()
	<-stopped
	st := fake.Stats()
	dups := 0
	for _, n := range st.BatchByCustomID {
		if n > 1 {
			dups++
		}
	}
	n := float64(b.N)
	b.ReportMetric(n/elapsed.Seconds(), "jobs/s")
	b.ReportMetric(elapsed.Seconds()/delay.Seconds(), "elapsed/delay")
	b.ReportMetric(float64(st.BatchesCreated["openai"]), "batches")
	b.ReportMetric(float64(dups), "duplicates")
	b.ReportMetric(float64(st.ByEndpoint["chat_completions"]), "sync-calls")
	// The cost: the ledger's answers priced as the cost views price them (batch rows at
	// the batch price), against the same tokens at the synchronous price.
	var paid, syncPrice float64
	rows, err := c.Inspector().Ledger().List(context.Background(), ledger.ListOptions{State: ledger.StateSucceeded, Limit: b.N + 1000})
	if err != nil {
		b.Fatal(err)
	}
	for _, r := range rows {
		name := r.Model
		if strings.HasSuffix(r.Provider, ledger.BatchSuffix) {
			name = limiter.BatchModel(r.Model)
		}
		usd, _ := (*limiter.Limiter)(nil).CostUSD(name, r.InputTokens, r.OutputTokens)
		full, _ := (*limiter.Limiter)(nil).CostUSD(r.Model, r.InputTokens, r.OutputTokens)
		paid, syncPrice = paid+usd, syncPrice+full
	}
	if len(rows) != b.N || syncPrice == 0 {
		b.Fatalf("%d answers in the ledger for %d jobs, priced %v synchronously", len(rows), b.N, syncPrice)
	}
	b.ReportMetric(paid/n*1e6, "µUSD/job")
	b.ReportMetric(paid/syncPrice, "cost/sync-lane")
}
