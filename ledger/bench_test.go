package ledger_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// BenchmarkLedger measures what the ledger adds to one model call: the in-flight insert
// before it and the success record after it, against the same call without the ledger,
// in one run. 64 callers at once (SetParallelism 32 on 2 cores), each call a new piece
// of work (a new row). Metrics: calls/s and PostgreSQL round trips per call
// (roundtrip.Counter; each of the ledger's is a commit).
//
//	go test -run '^$' -bench BenchmarkLedger -benchtime 20000x -count 3 ./ledger/
//
// Variants: model in-process (llm/fake: a zero-cost model, so the figure is the
// ledger's own cost) or over loopback HTTP (the OpenAI adapter against fake-llm), each
// bare, through the ledger, and through the ledger with RelaxedInsert.
func BenchmarkLedger(b *testing.B) {
	_, dsn := testenv.Postgres(b)
	var rt roundtrip.Counter
	pool, err := connect.Postgres(context.Background(), dsn, &rt)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	srv, _ := fakeserver.New(fakeserver.Config{Logger: slog.New(slog.DiscardHandler)})
	hs := httptest.NewServer(srv)
	b.Cleanup(hs.Close)
	models := map[string]llm.Client{
		"inproc": fake.New(),
		"http":   openai.New(openai.Config{BaseURL: hs.URL + "/v1", APIKey: "sk-bench"}),
	}
	var run atomic.Int64
	for _, model := range []string{"inproc", "http"} {
		for _, mode := range []string{"bare", "ledger", "ledger-relaxed"} {
			b.Run(model+"/"+mode, func(b *testing.B) {
				client := models[model]
				if mode != "bare" {
					l, err := ledger.New(pool, ledger.Config{RelaxedInsert: mode == "ledger-relaxed", Logger: slog.New(slog.DiscardHandler)})
					if err != nil {
						b.Fatal(err)
					}
					client = l.Wrap("openai", client)
				}
				prefix := fmt.Sprintf("bench-%d-%d", time.Now().UnixNano(), run.Add(1))
				var n atomic.Int64
				ctx := context.Background()
				rt.Reset()
				b.SetParallelism(32)
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						i := n.Add(1)
						req := &llm.Request{Model: "gpt-4.1-mini", IdempotencyKey: fmt.Sprintf("%s-%d", prefix, i),
							Messages: []llm.Message{{Role: llm.RoleUser, Content: fmt.Sprintf("Summarise for the account team:\n\nreport %d", i)}}}
						if _, err := client.Complete(ctx, req); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.StopTimer()
				calls := float64(b.N)
				b.ReportMetric(calls/b.Elapsed().Seconds(), "calls/s")
				b.ReportMetric(float64(rt.Postgres())/calls, "pg-rt/call")
			})
		}
	}
}
