package outbox_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// Relay throughput against a zero-latency webhook sink, beside two baselines measured
// in the same run (docs/BENCHMARKS.md, "Outbox relay"):
//
//	relay:       rows/s a relay drains: claim, POST each row, one settle per batch
//	relay-x2:    two relays side by side on the same outbox
//	direct:      the same number of webhook POSTs at the same concurrency, no database
//	claimsettle: the relay's claim and settle statements alone, no sends
//
// Run: go test -run '^$' -bench BenchmarkRelay -benchtime 20000x ./outbox/
func BenchmarkRelay(b *testing.B) {
	const batch, concurrency = 100, 16
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	for _, relays := range []int{1, 2} {
		name := "relay"
		if relays > 1 {
			name = "relay-x" + strconv.Itoa(relays)
		}
		b.Run(name, func(b *testing.B) {
			pool, _ := testenv.Postgres(b)
			seedBench(b, pool, b.N)
			sender, sink := benchSink(b)
			store := &countingStore{Store: pgoutbox.New(pool), want: int64(b.N), done: make(chan struct{})}
			ctx, cancel := context.WithCancel(context.Background())
			var rs []*outbox.Relay
			for range relays {
				r, err := outbox.NewRelay(store, sender, outbox.Config{BatchSize: batch, Concurrency: concurrency,
					PollInterval: time.Millisecond, Logger: quiet})
				if err != nil {
					b.Fatal(err)
				}
				rs = append(rs, r)
			}
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for _, r := range rs {
				wg.Go(func() { _ = r.Run(ctx) })
			}
			select {
			case <-store.done:
			case <-time.After(5 * time.Minute):
				b.Fatal("relay did not drain the outbox")
			}
			elapsed := time.Since(start)
			b.StopTimer()
			cancel()
			wg.Wait()
			if st := sink.Stats(); st.DistinctKeys != b.N || len(st.Duplicates) != 0 {
				b.Fatalf("sink %d keys, %d duplicated, want %d once each", st.DistinctKeys, len(st.Duplicates), b.N)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "rows/s")
		})
	}

	b.Run("direct", func(b *testing.B) {
		sender, sink := benchSink(b)
		m := outbox.Message{Topic: "email.summary_ready", Payload: json.RawMessage(`{"job_id":1,"to":"u@example.com"}`)}
		var next atomic.Int64
		var wg sync.WaitGroup
		b.ResetTimer()
		start := time.Now()
		for range concurrency {
			wg.Go(func() {
				for i := next.Add(1); i <= int64(b.N); i = next.Add(1) {
					msg := m
					msg.ID, msg.DedupeKey = i, "summary_ready:"+strconv.FormatInt(i, 10)
					if err := sender.Send(context.Background(), msg); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		elapsed := time.Since(start)
		b.StopTimer()
		if sink.Stats().Deliveries != b.N {
			b.Fatalf("%d deliveries, want %d", sink.Stats().Deliveries, b.N)
		}
		b.ReportMetric(float64(b.N)/elapsed.Seconds(), "rows/s")
	})

	b.Run("claimsettle", func(b *testing.B) {
		pool, _ := testenv.Postgres(b)
		seedBench(b, pool, b.N)
		store := pgoutbox.New(pool)
		ctx := context.Background()
		b.ResetTimer()
		start := time.Now()
		done := 0
		for done < b.N {
			msgs, err := store.Claim(ctx, "bench", batch, time.Minute)
			if err != nil || len(msgs) == 0 {
				b.Fatalf("claim: %d rows, %v", len(msgs), err)
			}
			ids := make([]int64, len(msgs))
			for i, m := range msgs {
				ids[i] = m.ID
			}
			s, err := store.Settle(ctx, "bench", outbox.Settlement{Sent: ids})
			if err != nil || len(s.Sent) != len(ids) {
				b.Fatalf("settle: %v", err)
			}
			done += len(ids)
		}
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "rows/s")
	})
}

// benchSink returns a webhook sender pointed at a zero-latency sink.
func benchSink(b *testing.B) (*webhook.Sender, *webhooksink.Sink) {
	b.Helper()
	sink := webhooksink.New(webhooksink.Options{})
	srv := httptest.NewServer(sink)
	b.Cleanup(srv.Close)
	sender, err := webhook.New(webhook.Config{URL: srv.URL})
	if err != nil {
		b.Fatal(err)
	}
	return sender, sink
}

func seedBench(b *testing.B, pool *pgxpool.Pool, n int) {
	b.Helper()
	if _, err := pool.Exec(context.Background(), `INSERT INTO outbox (topic, dedupe_key, payload)
		SELECT 'email.summary_ready', 'summary_ready:' || g, jsonb_build_object('job_id', g, 'to', 'u' || g || '@example.com')
		FROM generate_series(1, $1::int) g`, n); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(context.Background(), `VACUUM ANALYZE outbox`); err != nil {
		b.Fatal(err)
	}
}

// countingStore closes done once want rows were marked sent.
type countingStore struct {
	outbox.Store
	want int64
	sent atomic.Int64
	once sync.Once
	done chan struct{}
}

func (s *countingStore) Settle(ctx context.Context, relay string, st outbox.Settlement) (outbox.Settled, error) {
	got, err := s.Store.Settle(ctx, relay, st)
	if s.sent.Add(int64(len(got.Sent))) >= s.want {
		s.once.Do(func() { close(s.done) })
	}
	return got, err
}
