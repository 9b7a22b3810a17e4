package onceflow_test

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/queue"
)

// Run with (docs/BENCHMARKS.md, "Partitions on a Redis Cluster"):
//
//	go test -run '^$' -bench BenchmarkPartitions -benchtime 20000x -count 1 .
//
// BenchmarkPartitions measures, in one run, the keyed accept (Client.Enqueue with a
// Key: the one-script accept, 64 goroutines) and then the workers (Client.Run, no-op
// handlers, Concurrency 64) draining what was accepted, on a single Redis node with
// 1 partition (the baseline), 3 and 6 (one node holds them all), and on a local
// 3-primary Redis Cluster with 1, 3 and 6 partitions. Every node is a private
// redis-server with AOF and appendfsync always, on this machine. It reports jobs per second of each phase and the Redis CPU seconds they
// cost (INFO CPU of every node, before and after): on 2 cores the client and the
// nodes share the CPU, so jobs per Redis CPU-second tells what more cores would give:
// jobs per CPU-second of the busiest node is the rate at which that node would fill a
// core of its own (the model in docs/BENCHMARKS.md).
// It also reports the Redis round trips per job of each phase (a pipeline to one node is
// one; a cluster client's pipeline over several nodes is one per node: on a cluster the
// counter is on every node's client).
func BenchmarkPartitions(b *testing.B) {
	single := testenv.PrivateRedis(b)
	cluster := testenv.PrivateRedisCluster(b, 3, 0)
	for _, tc := range []struct {
		name  string
		parts int
	}{{"single", 1}, {"single-3", 3}, {"single-6", 6}, {"cluster-1", 1}, {"cluster-3", 3}, {"cluster-6", 6}} {
		b.Run(tc.name, func(b *testing.B) {
			var rdb redis.UniversalClient
			var nodes []string
			var err error
			if strings.HasPrefix(tc.name, "single") {
				rdb, err = onceflow.NewRedis(testenv.RedisURLOf(single))
				nodes = []string{strings.TrimSuffix(strings.TrimPrefix(testenv.RedisURLOf(single), "redis://"), "/0")}
			} else {
				rdb, err = onceflow.NewRedisCluster("redis://" + cluster.Addrs()[0])
				nodes = cluster.Addrs()
			}
			if err != nil {
				b.Fatal(err)
			}
			defer rdb.Close()
			benchPartitions(b, rdb, nodes, tc.parts)
		})
	}
}

// benchPartitions accepts b.N keyed jobs into a queue of parts partitions, then drains
// them with a Client's workers, and reports both rates and their Redis CPU.
func benchPartitions(b *testing.B, rdb redis.UniversalClient, nodes []string, parts int) {
	b.StopTimer()
	var handled atomic.Int64
	all := make(chan struct{})
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[sortArgs](func(context.Context, *onceflow.Job[sortArgs]) error {
		if handled.Add(1) == int64(b.N) {
			close(all)
		}
		return nil
	}))
	prefix := testenv.Prefix(b)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: ws, Logger: slog.New(slog.DiscardHandler),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {Partitions: parts, Concurrency: 64}}})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportMetric(float64(busiestNodePartitions(b, rdb, queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue}, parts)), "partitions-on-busiest-node")
	trips := &roundtrip.Counter{}
	countRoundTrips(b, rdb, trips)
	cpu0 := redisCPU(b, nodes)
	began := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					return
				}
				key := "k-" + strconv.FormatInt(i, 10)
				if _, err := c.Enqueue(ctx, sortArgs{Strings: []string{key}}, &onceflow.EnqueueOpts{Tenant: "acme", Key: key}); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	acceptTime := time.Since(began)
	acceptTrips := trips.Redis()
	trips.Reset()
	cpu1 := redisCPU(b, nodes)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	began = time.Now()
	go func() { done <- c.Run(runCtx) }()
	select {
	case <-all:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%d of %d jobs handled", handled.Load(), b.N)
	}
	workTime := time.Since(began)
	workTrips := trips.Redis()
	cpu2 := redisCPU(b, nodes)
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	n := float64(b.N)
	b.ReportMetric(n/acceptTime.Seconds(), "accepts/s")
	b.ReportMetric(n/total(cpu1, cpu0), "accepts/redis-cpu-s")
	b.ReportMetric(n/busiest(cpu1, cpu0), "accepts/busiest-cpu-s")
	b.ReportMetric(n/workTime.Seconds(), "jobs/s")
	b.ReportMetric(n/total(cpu2, cpu1), "jobs/redis-cpu-s")
	b.ReportMetric(n/busiest(cpu2, cpu1), "jobs/busiest-cpu-s")
	b.ReportMetric(float64(acceptTrips)/n, "accept-rt/job")
	b.ReportMetric(float64(workTrips)/n, "work-rt/job")
}

// countRoundTrips adds trips to rdb: to the client itself, or to every node's client of a
// Redis Cluster (the cluster client's own hook sees a pipeline over several nodes as
// one), each once.
func countRoundTrips(b *testing.B, rdb redis.UniversalClient, trips *roundtrip.Counter) {
	b.Helper()
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		rdb.AddHook(trips)
		return
	}
	var seen sync.Map
	add := func(n *redis.Client) {
		if _, dup := seen.LoadOrStore(n, true); !dup {
			n.AddHook(trips)
		}
	}
	cc.OnNewNode(add)
	err := cc.ForEachShard(context.Background(), func(_ context.Context, n *redis.Client) error {
		add(n)
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

// busiestNodePartitions returns the most partitions of keys' queue of parts one node
// holds: parts on a single Redis, and on a cluster as its slot map spreads them (the
// prefix, new every run, decides the spread).
func busiestNodePartitions(b *testing.B, rdb redis.UniversalClient, keys queue.Keys, parts int) int {
	b.Helper()
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return parts
	}
	per := map[string]int{}
	for _, k := range keys.Partitions(parts) {
		node, err := cc.MasterForKey(context.Background(), k.Stream())
		if err != nil {
			b.Fatal(err)
		}
		per[node.Options().Addr]++
	}
	m := 0
	for _, n := range per {
		m = max(m, n)
	}
	return m
}

// total returns the CPU seconds all nodes used between two redisCPU readings.
func total(after, before []float64) float64 {
	t := 0.0
	for i := range after {
		t += after[i] - before[i]
	}
	return t
}

// busiest returns the CPU seconds of the node that used the most between two redisCPU
// readings.
func busiest(after, before []float64) float64 {
	m := 0.0
	for i := range after {
		m = max(m, after[i]-before[i])
	}
	return m
}

// redisCPU returns the CPU seconds (user and system) each Redis server at addrs has
// used.
func redisCPU(b *testing.B, addrs []string) []float64 {
	b.Helper()
	out := make([]float64, len(addrs))
	for i, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a, MaxRetries: -1})
		info, err := c.Info(context.Background(), "cpu").Result()
		_ = c.Close()
		if err != nil {
			b.Fatal(err)
		}
		for line := range strings.SplitSeq(info, "\n") {
			k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
			if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					b.Fatalf("INFO cpu %s: %v", line, err)
				}
				out[i] += f
			}
		}
	}
	return out
}
