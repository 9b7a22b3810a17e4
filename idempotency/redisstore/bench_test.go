package redisstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/loadgen"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/queue"
)

// BenchmarkIdempotency measures accepted POSTs per second over a real loopback HTTP
// server and a private real Redis, all variants in one run, at appendfsync always and
// everysec:
//
//	bare      a net/http handler answering 202 (no Redis)
//	generic   the two-round-trip middleware around that handler
//	accept    the single-round-trip path behind a summaries-like route (auth, key
//	          parsing, strict body validation, UUIDv5 job id, metrics, Accept)
//	prototype the same single Lua call with no validation, auth or metrics: the ceiling
//
// Every request has a fresh key, so every request is accepted (no replays). Each variant
// runs ONCEFLOW_BENCH_ROUNDS times (default 3) for ONCEFLOW_BENCH_DURATION (default
// 3s) with ONCEFLOW_BENCH_CONCURRENCY workers (default 64), rounds interleaved; the
// median round is reported. Run it with
//
//	go test -run '^$' -bench Idempotency -benchtime 1x ./idempotency/redisstore/
func BenchmarkIdempotency(b *testing.B) {
	dur := envDuration(b, "ONCEFLOW_BENCH_DURATION", 3*time.Second)
	rounds := envInt(b, "ONCEFLOW_BENCH_ROUNDS", 3)
	conc := envInt(b, "ONCEFLOW_BENCH_CONCURRENCY", 64)

	srv := testenv.PrivateRedis(b)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv) + "?pool_size=" + strconv.Itoa(conc))
	if err != nil {
		b.Fatal(err)
	}
	defer rdb.Close()
	var rt roundtrip.Counter
	rdb.AddHook(&rt)
	ctx := context.Background()
	// Keep AOF rewrites out of the measurements; the benchmark rewrites between runs.
	if err := rdb.ConfigSet(ctx, "auto-aof-rewrite-percentage", "0").Err(); err != nil {
		b.Fatal(err)
	}

	const prefix = "bench"
	store, err := New(rdb, Config{Prefix: prefix, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	route, err := newAcceptRoute(store)
	if err != nil {
		b.Fatal(err)
	}
	route.timeout = idempotency.DefaultStoreTimeout
	mw, err := idempotency.New(idempotency.Config{Store: store, Tenant: bearerTenant, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /bare", http.HandlerFunc(bareHandler))
	mux.Handle("POST /generic", mw.Wrap(http.HandlerFunc(bareHandler)))
	mux.Handle("POST /accept", route)
	mux.Handle("POST /prototype", prototype(rdb, prefix))
	hs := httptest.NewServer(mux)
	defer hs.Close()

	variants := []string{"bare", "generic", "accept", "prototype"}
	for _, fsync := range []string{"always", "everysec"} {
		b.Run("appendfsync="+fsync, func(b *testing.B) {
			if err := rdb.ConfigSet(ctx, "appendfsync", fsync).Err(); err != nil {
				b.Fatal(err)
			}
			res := map[string][]measurement{}
			for round := range rounds {
				// Rotate the order so no variant always runs first (or last).
				for i := range variants {
					v := variants[(i+round)%len(variants)]
					resetRedis(b, rdb)
					tag := fmt.Sprintf("%s-%s-%d", fsync, v, round)
					// Warm up: connections, script cache, allocator.
					if _, err := runLoad(hs.URL+"/"+v, tag+"w", conc, dur/6); err != nil {
						b.Fatal(err)
					}
					rt.Reset()
					r, err := runLoad(hs.URL+"/"+v, tag, conc, dur)
					if err != nil {
						b.Fatal(err)
					}
					res[v] = append(res[v], measurement{r: r, rtPerReq: float64(rt.Redis()) / float64(r.Requests)})
				}
			}
			med := map[string]measurement{}
			for _, v := range variants {
				ms := res[v]
				slices.SortFunc(ms, func(a, b measurement) int { return int(a.r.RPS() - b.r.RPS()) })
				med[v] = ms[len(ms)/2]
				b.ReportMetric(med[v].r.RPS(), v+"_req/s")
			}
			acceptVsProto := med["accept"].r.RPS() / med["prototype"].r.RPS()
			genericVsBare := med["generic"].r.RPS() / med["bare"].r.RPS()
			b.ReportMetric(acceptVsProto, "accept/prototype")
			b.ReportMetric(genericVsBare, "generic/bare")
			fmt.Printf("\nappendfsync %s, %d workers, %d rounds of %v (median round):\n\n", fsync, conc, rounds, dur)
			fmt.Printf("| variant | req/s | p50 | p99 | Redis round trips/req | failures |\n|---|---:|---:|---:|---:|---:|\n")
			for _, v := range variants {
				m := med[v]
				fmt.Printf("| %s | %.0f | %v | %v | %.2f | %d |\n", v, m.r.RPS(),
					m.r.Latency.Quantile(0.5).Round(10*time.Microsecond), m.r.Latency.Quantile(0.99).Round(10*time.Microsecond), m.rtPerReq, m.r.Failures)
			}
			fmt.Printf("\naccept / prototype = %.2f (target >= 0.80); generic / bare = %.2f (target >= 0.20); accept / bare = %.2f; generic / accept = %.2f\n",
				acceptVsProto, genericVsBare, med["accept"].r.RPS()/med["bare"].r.RPS(), med["generic"].r.RPS()/med["accept"].r.RPS())
		})
	}
}

type measurement struct {
	r        *loadgen.Result
	rtPerReq float64
}

const benchBody = `{"text":"Quarterly revenue rose 12% on strong renewals; churn fell to 3.1%. The team asks for two more support engineers before the March launch.","notify":"ops@example.com"}`

func runLoad(url, tag string, conc int, dur time.Duration) (*loadgen.Result, error) {
	r, err := loadgen.Run(context.Background(), loadgen.Config{
		Concurrency: conc, Duration: dur,
		NewRequest: func(worker, seq int) (*http.Request, error) {
			req, err := http.NewRequest("POST", url, strings.NewReader(benchBody))
			if err != nil {
				return nil, err
			}
			req.Header.Set("Authorization", "Bearer key-acme-0123456789")
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", tag+"-"+strconv.Itoa(worker)+"-"+strconv.Itoa(seq)+"-bench-key")
			return req, nil
		},
		Check: func(resp *http.Response, body []byte) error {
			if resp.StatusCode != http.StatusAccepted || resp.Header.Get(idempotency.HeaderReplayed) != "" {
				return fmt.Errorf("status %d replayed %q: %s", resp.StatusCode, resp.Header.Get(idempotency.HeaderReplayed), body)
			}
			return nil
		},
	})
	if err == nil && r.Failures > 0 {
		err = fmt.Errorf("%s: %d of %d requests failed, first: %s", url, r.Failures, r.Requests, r.FirstFailure)
	}
	return r, err
}

// bareHandler is the baseline: read the body, answer 202 with a job-like body.
func bareHandler(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/v1/summaries/11111111-2222-5333-8444-555555555555")
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write([]byte(`{"job_id":"11111111-2222-5333-8444-555555555555","status":"queued"}`))
}

// prototype makes the accept path's single Lua call with nothing around it: no auth,
// no key validation, no body validation, no metrics.
func prototype(rdb redis.UniversalClient, prefix string) http.Handler {
	stream := prefix + ":{summaries}:stream"
	done, _ := encodeDone("x", &idempotency.Response{Status: 202, Body: []byte(`{"status":"queued"}`)})
	// The accept composed with the queue's enqueue, as AcceptStep runs it for the route.
	sc := acceptScript.With(queue.StepFunctions()[0])
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fpSum := sha256.Sum256(body)
		fp := hex.EncodeToString(fpSum[:])
		keySum := sha256.Sum256([]byte(r.Header.Get("Idempotency-Key")))
		id := hex.EncodeToString(keySum[:16])
		err := sc.Run(r.Context(), rdb,
			[]string{prefix + ":{summaries}:idem:" + hex.EncodeToString(keySum[:]), stream, prefix + ":{summaries}:dead", prefix + ":{summaries}:job:" + id},
			fp, done, 86400000, "acme",
			"v", "1", "job_id", id, "tenant", "acme", "payload", body, "enqueued_at", "0", "traceparent", "").Err()
		if err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write([]byte(`{"status":"queued"}`))
	})
}

// resetRedis empties the benchmark's private Redis and shrinks its AOF, so every run
// starts from the same state.
func resetRedis(b *testing.B, rdb *redis.Client) {
	b.Helper()
	ctx := context.Background()
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	if err := rdb.BgRewriteAOF(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		info, err := rdb.Info(ctx, "persistence").Result()
		if err != nil {
			b.Fatal(err)
		}
		if strings.Contains(info, "aof_rewrite_in_progress:0") && strings.Contains(info, "aof_rewrite_scheduled:0") {
			return
		}
		if time.Now().After(deadline) {
			b.Fatal("AOF rewrite did not finish within a minute")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func envDuration(b *testing.B, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		b.Fatalf("invalid %s=%q", name, v)
	}
	return d
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("invalid %s=%q", name, v)
	}
	return n
}
