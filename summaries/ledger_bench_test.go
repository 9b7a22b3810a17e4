package summaries_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// lgWrites counts the PostgreSQL statements that write (each is one commit in the
// handler, which uses no explicit transactions), beside roundtrip.Counter's round trips.
type lgWrites struct {
	roundtrip.Counter
	writes atomic.Int64
}

func (w *lgWrites) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	sql := strings.ToUpper(d.SQL)
	if strings.Contains(sql, "INSERT ") || strings.Contains(sql, "UPDATE ") || strings.Contains(sql, "DELETE ") {
		w.writes.Add(1)
	}
	return w.Counter.TraceQueryStart(ctx, c, d)
}

// BenchmarkWorkerLedger measures what the llm_calls ledger costs a summaries worker,
// end to end from the stream to the committed summary and outbox row: b.N jobs are
// enqueued, then one queue.Worker (ONCEFLOW_WORKER_CONCURRENCY 64) runs the summaries
// handler until every job's summary is committed, with a zero-latency in-process model
// (llm/fake), against the dev Redis and PostgreSQL (synchronous_commit on). Modes, in
// one run: without the ledger, with it, with it and RelaxedInsert. Metrics: jobs/s and,
// per job, PostgreSQL round trips, PostgreSQL commits, Redis round trips.
//
//	go test -run '^$' -bench BenchmarkWorkerLedger -benchtime 5000x -count 3 ./summaries/
//
// ONCEFLOW_BENCH_CONCURRENCY overrides the worker concurrency (default 64).
func BenchmarkWorkerLedger(b *testing.B) {
	concurrency := 64
	if v, err := strconv.Atoi(os.Getenv("ONCEFLOW_BENCH_CONCURRENCY")); err == nil && v > 0 {
		concurrency = v
	}
	for _, mode := range []string{"no-ledger", "ledger", "ledger-relaxed"} {
		b.Run(mode, func(b *testing.B) {
			rdb, prefix := testenv.Redis(b)
			watch, dsn := testenv.Postgres(b) // the benchmark's own polls, not counted
			var pgc lgWrites
			pool, err := connect.Postgres(context.Background(), dsn, &pgc)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(pool.Close)
			var rc roundtrip.Counter
			rdb.AddHook(&rc)
			quiet := slog.New(slog.DiscardHandler)
			cfg := handlerConfig{Model: "gpt-4.1-mini", Provider: "fake", Logger: quiet}
			if mode != "no-ledger" {
				cfg.LedgerConfig = ledger.Config{RelaxedInsert: mode == "ledger-relaxed"}
				cfg.Ledger, err = ledger.New(pool, cfg.LedgerConfig)
				if err != nil {
					b.Fatal(err)
				}
			}
			h := newHandler(b, pool, fake.New(), cfg)
			keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
			ctx := context.Background()
			for i := range b.N {
				payload, _ := json.Marshal(summaries.Request{Text: fmt.Sprintf("Report %d: revenue grew in every region.", i), Notify: "ops@example.com"})
				m := queue.Message{JobID: fmt.Sprintf("00000000-0000-4000-8000-%012x", i), Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}
				if _, err := queue.Enqueue(ctx, rdb, keys, m); err != nil {
					b.Fatal(err)
				}
			}
			w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Handler: h, Concurrency: concurrency, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			pgc.Reset()
			pgc.writes.Store(0)
			rc.Reset()
			b.ResetTimer()
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- w.Run(runCtx) }()
			for {
				var n int
				if err := watch.QueryRow(ctx, `SELECT count(*) FROM summaries`).Scan(&n); err != nil {
					b.Fatal(err)
				}
				if n == b.N {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			b.StopTimer()
			elapsed := b.Elapsed()
			stop()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			jobs := float64(b.N)
			b.ReportMetric(jobs/elapsed.Seconds(), "jobs/s")
			b.ReportMetric(float64(pgc.Postgres())/jobs, "pg-rt/job")
			b.ReportMetric(float64(pgc.writes.Load())/jobs, "pg-commits/job")
			b.ReportMetric(float64(rc.Redis())/jobs, "redis-rt/job")
		})
	}
}
