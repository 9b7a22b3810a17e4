package queue

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// setup returns a client of the shared test Redis and keys under a prefix of the test's
// own (deleted at cleanup): with ONCEFLOW_TEST_REDIS_CLUSTER set (`make test-cluster`),
// a cluster client of that Redis Cluster, so the package's tests are its conformance
// suite on a cluster too.
func setup(t testing.TB) (redis.UniversalClient, Keys) {
	t.Helper()
	rdb, prefix := testenv.QueueRedis(t)
	return rdb, Keys{Prefix: prefix, Queue: "summaries"}
}

// jobID returns a canonical UUID for job i.
func jobID(i int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012x", i) }

// message returns a valid message for job i with the given payload (nil: {"n": i}).
func message(i int, payload any) Message {
	if payload == nil {
		payload = map[string]int{"n": i}
	}
	b, _ := json.Marshal(payload)
	return Message{JobID: jobID(i), Tenant: "acme", Payload: b, EnqueuedAt: time.UnixMilli(1_700_000_000_000 + int64(i))}
}

func enqueue(t *testing.T, rdb redis.UniversalClient, keys Keys, msgs ...Message) []string {
	t.Helper()
	ids := make([]string, 0, len(msgs))
	for _, m := range msgs {
		id, err := Enqueue(context.Background(), rdb, keys, m)
		if err != nil {
			t.Fatalf("enqueue %s: %v", m.JobID, err)
		}
		ids = append(ids, id)
	}
	return ids
}

// running is a Worker started in the background by start.
type running struct {
	*Worker
	cancel context.CancelFunc
	done   chan struct{} // closed when Run returned
	err    error         // Run's result, set before done closes
}

// stop cancels the worker and waits for Run to return.
func (r *running) stop(t testing.TB) {
	t.Helper()
	r.cancel()
	select {
	case <-r.done:
		if r.err != nil {
			t.Errorf("Run: %v", r.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("worker %s did not stop", r.Consumer())
	}
}

// start runs a worker for cfg, with test-friendly defaults for unset fields; it is
// stopped at cleanup.
func start(t testing.TB, cfg WorkerConfig) *running {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	if cfg.Block == 0 {
		cfg.Block = 50 * time.Millisecond
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 5 * time.Second
	}
	if cfg.RetryBase == 0 { // tests wait for retries: keep them short unless a test sets them
		cfg.RetryBase = 10 * time.Millisecond
		cfg.RetryMax = max(cfg.RetryMax, 100*time.Millisecond)
	}
	w, err := NewWorker(cfg)
	if err != nil {
		t.Fatalf("NewWorker: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{Worker: w, cancel: cancel, done: make(chan struct{})}
	go func() { r.err = w.Run(ctx); close(r.done) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// pendingIDs returns the ids pending in group, to any consumer.
func pendingIDs(t *testing.T, rdb redis.UniversalClient, keys Keys, group string) []string {
	t.Helper()
	res, err := rdb.XPendingExt(context.Background(), &redis.XPendingExtArgs{
		Stream: keys.Stream(), Group: group, Start: "-", End: "+", Count: 100_000,
	}).Result()
	if err != nil {
		t.Fatalf("xpending: %v", err)
	}
	ids := make([]string, 0, len(res))
	for _, p := range res {
		ids = append(ids, p.ID)
	}
	return ids
}

func deadLetters(t *testing.T, rdb redis.UniversalClient, keys Keys) []DeadLetter {
	t.Helper()
	out, _, err := ListDead(context.Background(), rdb, keys, "", 10_000)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// counter counts calls by key; safe for concurrent use.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) inc(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[k]++
	return c.n[k]
}

func (c *counter) get(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

// metricValue returns the value of the counter, gauge or histogram sample count named
// name whose labels include all of want, summed over matching series.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, want ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !hasLabels(m, want) {
				continue
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			case m.Histogram != nil:
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return sum
}

func hasLabels(m *dto.Metric, want []string) bool {
	for i := 0; i+1 < len(want); i += 2 {
		found := false
		for _, l := range m.GetLabel() {
			if l.GetName() == want[i] && l.GetValue() == want[i+1] {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// cmdCounter is a go-redis hook counting commands by name.
type cmdCounter struct{ c counter }

func (h *cmdCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *cmdCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.c.inc(strings.ToLower(cmd.Name()))
		return next(ctx, cmd)
	}
}
func (h *cmdCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.c.inc(strings.ToLower(cmd.Name()))
		}
		return next(ctx, cmds)
	}
}

func readArgs(keys Keys, consumer string, n int64) *redis.XReadGroupArgs {
	return &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: consumer, Streams: []string{keys.Stream(), ">"}, Count: n}
}

func claimArgs(keys Keys, consumer string, ids ...string) *redis.XClaimArgs {
	return &redis.XClaimArgs{Stream: keys.Stream(), Group: DefaultGroup, Consumer: consumer, Messages: ids}
}

func pendingArgs(keys Keys) *redis.XPendingExtArgs {
	return &redis.XPendingExtArgs{Stream: keys.Stream(), Group: DefaultGroup, Start: "-", End: "+", Count: 1000}
}

// privateRedis starts a Redis server of the test's own (one the test may stop, kill and
// restart) and returns it with a client of it, closed at cleanup.
func privateRedis(t testing.TB) (*testenv.Server, *redis.Client) {
	t.Helper()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	return srv, rdb
}

// refusesInvalidKeys checks that call refuses keys that Validate refuses (an empty queue
// name, and one holding the brace that closes the hash tag) with Validate's error,
// before it reaches Redis: call gets a client of no server, whose connection error
// would show that it tried.
func refusesInvalidKeys(t *testing.T, call func(rdb redis.UniversalClient, keys Keys) error) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	for _, keys := range []Keys{{Prefix: "onceflow", Queue: ""}, {Prefix: "onceflow", Queue: "a}b"}, {Prefix: "", Queue: "summaries"}} {
		want := keys.Validate()
		if err := call(rdb, keys); err == nil || !strings.Contains(err.Error(), want.Error()) {
			t.Errorf("keys %+v: %v, want %q", keys, err, want)
		}
	}
}
