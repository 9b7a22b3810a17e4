package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// enqueueSpread enqueues jobs 1 to n of keys' queue of parts partitions, each to the
// partition PartitionOf its id, and returns how many went to each.
func enqueueSpread(t *testing.T, rdb redis.UniversalClient, keys Keys, parts, n int, payload func(i int) any) []int {
	t.Helper()
	per := make([]int, parts)
	for i := 1; i <= n; i++ {
		var p any
		if payload != nil {
			p = payload(i)
		}
		k := keys.InPartition(PartitionOf(jobID(i), parts))
		enqueue(t, rdb, k, message(i, p))
		per[k.Partition]++
	}
	return per
}

// readTrip is one round trip that read new entries (XREADGROUP): the node it went to,
// the streams it named and the entries it returned.
type readTrip struct {
	node    string
	streams []string
	entries int
}

// readRecorder is a go-redis hook that records every round trip reading new entries,
// and counts those that acknowledge (XACK). Add it to a node's client with node set (on
// a cluster), or to a client of one server.
type readRecorder struct {
	node string
	mu   *sync.Mutex
	rec  *[]readTrip
	acks *atomic.Int64
}

func newReadRecorder() *readRecorder {
	return &readRecorder{mu: &sync.Mutex{}, rec: new([]readTrip), acks: new(atomic.Int64)}
}

// on returns the recorder for node's client, recording into the same list.
func (h *readRecorder) on(node string) *readRecorder { c := *h; c.node = node; return &c }

func (h *readRecorder) trips() []readTrip {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(*h.rec)
}

func (h *readRecorder) reset() {
	h.mu.Lock()
	*h.rec = nil
	h.mu.Unlock()
	h.acks.Store(0)
}

func (h *readRecorder) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *readRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.record([]redis.Cmder{cmd})
		return err
	}
}

func (h *readRecorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.record(cmds)
		return err
	}
}

func (h *readRecorder) record(cmds []redis.Cmder) {
	trip := readTrip{node: h.node}
	read, acked := false, false
	for _, cmd := range cmds {
		switch cmd.Name() {
		case "xack":
			acked = true
		case "xreadgroup":
			read = true
			args := cmd.Args()
			for i, a := range args {
				if s, ok := a.(string); ok && strings.EqualFold(s, "streams") {
					names := args[i+1:]
					for _, n := range names[:len(names)/2] {
						trip.streams = append(trip.streams, fmt.Sprint(n))
					}
					break
				}
			}
			if c, ok := cmd.(*redis.XStreamSliceCmd); ok {
				for _, s := range c.Val() {
					trip.entries += len(s.Messages)
				}
			}
		}
	}
	if acked {
		h.acks.Add(1)
	}
	if read {
		h.mu.Lock()
		*h.rec = append(*h.rec, trip)
		h.mu.Unlock()
	}
}

// recordNodes adds rec to every node client of cc, each with its address.
func recordNodes(t *testing.T, cc *redis.ClusterClient, rec *readRecorder) {
	t.Helper()
	var seen sync.Map
	add := func(n *redis.Client) {
		if _, dup := seen.LoadOrStore(n, true); !dup {
			n.AddHook(rec.on(n.Options().Addr))
		}
	}
	cc.OnNewNode(add)
	if err := cc.ForEachShard(context.Background(), func(_ context.Context, n *redis.Client) error { add(n); return nil }); err != nil {
		t.Fatal(err)
	}
}

// countingHandler counts the runs of each job and each run's delivery count.
type countingHandler struct {
	mu         sync.Mutex
	runs       map[string]int
	deliveries map[string]int64
}

func newCountingHandler() *countingHandler {
	return &countingHandler{runs: map[string]int{}, deliveries: map[string]int64{}}
}

func (h *countingHandler) Handle(_ context.Context, j *Job) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.runs[j.JobID]++
	h.deliveries[j.JobID] = j.Deliveries
	return nil
}

func (h *countingHandler) jobs() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.runs)
}

// exactlyOnce fails t unless jobs 1 to n ran once each, and nothing else ran.
func (h *countingHandler) exactlyOnce(t *testing.T, n int) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.runs) != n {
		t.Errorf("%d jobs ran, want %d", len(h.runs), n)
	}
	for i := 1; i <= n; i++ {
		if r := h.runs[jobID(i)]; r != 1 {
			t.Errorf("job %d ran %d times, want once", i, r)
		}
	}
}

// settled reports whether no partition of keys' queue of parts has pending entries.
func settled(t *testing.T, rdb redis.UniversalClient, keys Keys, parts int) bool {
	t.Helper()
	st, err := ReadStatsOf(context.Background(), rdb, keys.Partitions(parts), DefaultGroup)
	return err == nil && st.Pending == 0
}

// One worker over 3 and over 6 partitions runs every job of each partition exactly once
// and acknowledges it in its own partition.
func TestAWorkerOfSeveralPartitionsRunsEveryJobOnce(t *testing.T) {
	t.Parallel()
	for _, parts := range []int{3, 6} {
		t.Run(fmt.Sprintf("%d partitions", parts), func(t *testing.T) {
			t.Parallel()
			rdb, keys := setup(t)
			const n = 300
			per := enqueueSpread(t, rdb, keys, parts, n, nil)
			for p, c := range per {
				if c == 0 {
					t.Fatalf("partition %d got no job: %v", p, per)
				}
			}
			h := newCountingHandler()
			start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Concurrency: 16, Handler: h})
			testenv.WaitFor(t, 30*time.Second, "every job run and acknowledged", func() bool {
				return h.jobs() == n && settled(t, rdb, keys, parts)
			})
			h.exactlyOnce(t, n)
			for p, k := range keys.Partitions(parts) {
				if got := rdb.XLen(context.Background(), k.Stream()).Val(); got != int64(per[p]) {
					t.Errorf("partition %d's stream has %d entries, want its %d", p, got, per[p])
				}
			}
		})
	}
}

// On a single Redis one round trip reads every partition (one XREADGROUP over their
// streams, or two when their counts differ) and one acknowledges them: draining the
// same backlog spread over 6 partitions takes about the read and acknowledgement round
// trips of one partition. A worker that read (or acknowledged) each partition in round
// trips of its own would take about 6 times as many.
func TestOneRoundTripReadsEveryPartitionOfASingleRedis(t *testing.T) {
	t.Parallel()
	const jobs = 1600
	drain := func(parts int) (reads, acks int64, trips []readTrip) {
		rdb, prefix := testenv.Redis(t)
		keys := Keys{Prefix: prefix, Queue: "trips"}
		enqueueSpread(t, rdb, keys, parts, jobs, nil)
		rec := newReadRecorder()
		rdb.AddHook(rec)
		h := newCountingHandler()
		start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Handler: h, Logger: slog.New(slog.DiscardHandler)})
		testenv.WaitFor(t, 60*time.Second, "every job run and acknowledged", func() bool {
			return h.jobs() == jobs && settled(t, rdb, keys, parts)
		})
		h.exactlyOnce(t, jobs)
		trips = rec.trips()
		return int64(len(trips)), rec.acks.Load(), trips
	}
	reads1, acks1, _ := drain(1)
	reads6, acks6, trips := drain(6)
	carried := 0
	for _, tr := range trips {
		if len(tr.streams) == 6 {
			carried += tr.entries
		}
	}
	t.Logf("1 partition: %d reads, %d acknowledgements; 6 partitions: %d reads, %d acknowledgements", reads1, acks1, reads6, acks6)
	if carried < jobs/2 {
		t.Errorf("only %d of %d entries came in reads of all 6 partitions' streams", carried, jobs)
	}
	if reads6 > 2*reads1+10 {
		t.Errorf("6 partitions took %d read round trips, one %d: want about as many", reads6, reads1)
	}
	if acks6 > 2*acks1+10 {
		t.Errorf("6 partitions took %d acknowledgement round trips, one %d: want about as many", acks6, acks1)
	}
}

// A consumer that died holding entries of several partitions loses none of them: the
// worker reclaims each partition's after ClaimIdle (its scans of the partitions a node
// holds go in one round trip) and runs every one once, as its second delivery.
func TestADeadConsumersEntriesAreReclaimedInEveryPartition(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const parts, n = 3, 30
	enqueueSpread(t, rdb, keys, parts, n, nil)
	for _, k := range keys.Partitions(parts) {
		if err := CreateGroup(ctx, rdb, k, DefaultGroup); err != nil {
			t.Fatal(err)
		}
		res, err := rdb.XReadGroup(ctx, readArgs(k, "dead", 100)).Result()
		if err != nil || len(res[0].Messages) == 0 {
			t.Fatalf("the dead consumer's read of partition %d: %v %v", k.Partition, res, err)
		}
	}
	// The consumer "dies" holding every entry.
	h := newCountingHandler()
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Handler: h,
		ClaimIdle: 300 * time.Millisecond, ClaimInterval: 20 * time.Millisecond})
	testenv.WaitFor(t, 20*time.Second, "every job reclaimed, run and acknowledged", func() bool {
		return h.jobs() == n && settled(t, rdb, keys, parts)
	})
	h.exactlyOnce(t, n)
	h.mu.Lock()
	defer h.mu.Unlock()
	for id, d := range h.deliveries {
		if d != 2 {
			t.Errorf("job %s ran as delivery %d, want 2 (the dead consumer's was the first)", id, d)
		}
	}
}

// A worker of several partitions dead-letters each failed job in its own partition: a
// permanent failure after one run, an exhausted budget after MaxDeliveries, each with
// its reason, and leaves the partitions' other jobs done.
func TestDeadLettersStayInTheirPartition(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const parts, n = 3, 30
	type args struct{ Fail string }
	fate := func(i int) string { return []string{"", "permanent", "always"}[i%3] }
	enqueueSpread(t, rdb, keys, parts, n, func(i int) any { return args{Fail: fate(i)} })
	var runs counter
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, MaxDeliveries: 2,
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			runs.inc(j.JobID)
			var a args
			_ = json.Unmarshal(j.Payload, &a)
			switch a.Fail {
			case "permanent":
				return Permanent(errors.New("refused"))
			case "always":
				return errors.New("flaky")
			}
			return nil
		})})
	testenv.WaitFor(t, 30*time.Second, "every failing job dead-lettered", func() bool {
		st, err := ReadStatsOf(ctx, rdb, keys.Partitions(parts), DefaultGroup)
		return err == nil && st.Dead == 20 && st.Pending == 0 && st.Scheduled == 0
	})
	for i := 1; i <= n; i++ {
		k := keys.InPartition(PartitionOf(jobID(i), parts))
		dead, err := FindDead(ctx, rdb, k, jobID(i))
		if err != nil {
			t.Fatal(err)
		}
		want, wantRuns := 1, map[string]int{"": 1, "permanent": 1, "always": 2}[fate(i)]
		if fate(i) == "" {
			want = 0
		}
		if len(dead) != want {
			t.Errorf("job %d (%q) has %d dead letters in its partition %d, want %d", i, fate(i), len(dead), k.Partition, want)
		}
		if r := runs.get(jobID(i)); r != wantRuns {
			t.Errorf("job %d (%q) ran %d times, want %d", i, fate(i), r, wantRuns)
		}
		if want == 1 && len(dead) == 1 {
			reason := map[string]string{"permanent": "permanent: refused", "always": "failed 2 attempts; last error: flaky"}[fate(i)]
			if dead[0].Reason != reason {
				t.Errorf("job %d's dead letter says %q, want %q", i, dead[0].Reason, reason)
			}
		}
		for _, other := range keys.Partitions(parts) {
			if other.Partition == k.Partition {
				continue
			}
			if d, _ := FindDead(ctx, rdb, other, jobID(i)); len(d) != 0 {
				t.Errorf("job %d of partition %d has a dead letter in partition %d", i, k.Partition, other.Partition)
			}
		}
	}
}

// At shutdown, the jobs a worker of several partitions still runs when ShutdownTimeout
// passes are handed back each to its own partition, at once and without spending an
// attempt; nothing stays pending in any partition.
func TestShutdownHandsBackTheJobsOfEveryPartition(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const parts, n = 3, 9
	per := enqueueSpread(t, rdb, keys, parts, n, nil)
	var started atomic.Int32
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Concurrency: n, ShutdownTimeout: 300 * time.Millisecond,
		Handler: HandlerFunc(func(ctx context.Context, j *Job) error {
			started.Add(1)
			<-ctx.Done()
			return ctx.Err()
		})})
	testenv.WaitFor(t, 10*time.Second, "every job running", func() bool { return started.Load() == n })
	w.stop(t)
	for p, k := range keys.Partitions(parts) {
		if got := pendingIDs(t, rdb, k, DefaultGroup); len(got) != 0 {
			t.Errorf("partition %d: pending after shutdown %v, want none", p, got)
		}
		res, err := rdb.XReadGroup(ctx, readArgs(k, "next", 100)).Result()
		if err != nil || len(res[0].Messages) != per[p] {
			t.Fatalf("partition %d: undelivered after shutdown %v %v, want its %d jobs handed back", p, res, err, per[p])
		}
		for _, m := range res[0].Messages {
			msg, err := ParseMessage(m.Values)
			if err != nil || msg.Attempts != 0 || PartitionOf(msg.JobID, parts) != p {
				t.Errorf("partition %d: handed back %+v %v, want one of its jobs with no attempt spent", p, msg, err)
			}
		}
	}
}

// shareReads divides a read's slots: all of them, equally when no partition was full,
// one to each partition that was not and the rest to those that were; with fewer slots
// than partitions, one each to the partitions due first, then to the full ones.
func TestShareReadsGivesTheSlotsToThePartitionsWithABacklog(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		n     int
		hot   []bool
		due   []bool
		start int
		want  []int
	}{
		{64, []bool{false}, nil, 0, []int{64}},
		{64, []bool{true}, nil, 0, []int{64}},
		{64, []bool{false, false, false}, nil, 0, []int{22, 21, 21}},
		{64, []bool{false, false, false}, nil, 2, []int{21, 21, 22}},
		{64, []bool{true, true, true, true, true, true}, nil, 0, []int{11, 11, 11, 11, 10, 10}},
		{64, []bool{true, false, false, false, false, false}, nil, 0, []int{59, 1, 1, 1, 1, 1}},
		{64, []bool{false, true, false, true, false, false}, nil, 0, []int{1, 30, 1, 30, 1, 1}},
		{2, []bool{false, false, true, false}, nil, 0, []int{1, 0, 1, 0}},
		{2, []bool{false, false, false, false}, nil, 3, []int{1, 0, 0, 1}},
		{0, []bool{true, false}, nil, 0, []int{0, 0}},
		{2, []bool{true, false, false, false}, []bool{false, false, true, false}, 0, []int{1, 0, 1, 0}},
		{1, []bool{true, false, false}, []bool{false, true, false}, 0, []int{0, 1, 0}},
		{1, []bool{true, false, false}, []bool{false, true, true}, 2, []int{0, 0, 1}},
		{64, []bool{true, false, false}, []bool{false, true, true}, 0, []int{62, 1, 1}},
	} {
		if got := shareReads(tc.n, tc.hot, tc.due, tc.start); !slices.Equal(got, tc.want) {
			t.Errorf("shareReads(%d, %v, %v, %d) = %v, want %v", tc.n, tc.hot, tc.due, tc.start, got, tc.want)
		}
	}
}

// shareReads never asks for more than the slots it is given, gives all of them, asks
// every partition for one at least when there are enough, never asks a partition that
// was full for less than one that was not (with fewer slots than partitions, when
// neither was due), and with fewer slots than partitions reads every due one before any
// that is not.
func FuzzShareReads(f *testing.F) {
	f.Add(64, uint64(0b101), uint64(0), 6, 0)
	f.Add(3, uint64(0), uint64(0b10), 5, 2)
	f.Add(1, uint64(1), uint64(0b110), 3, 0)
	f.Fuzz(func(t *testing.T, n int, bits, dueBits uint64, m, start int) {
		n, m = n%2000, max(m%MaxPartitions, 1)
		if start < 0 {
			start = -start
		}
		hot := make([]bool, m)
		due := make([]bool, m)
		for i := range hot {
			hot[i] = bits>>(i%64)&1 == 1
			due[i] = dueBits>>(i%64)&1 == 1
		}
		counts := shareReads(n, hot, due, start)
		sum := 0
		for i, c := range counts {
			sum += c
			if c < 0 || (n >= m && c < 1) {
				t.Fatalf("shareReads(%d, %v, %v, %d) = %v: partition %d asked for %d", n, hot, due, start, counts, i, c)
			}
			for j, d := range counts {
				if hot[i] && !hot[j] && c < d && (n >= m || (!due[i] && !due[j])) {
					t.Fatalf("shareReads(%d, %v, %v, %d) = %v: full partition %d asked for less than partition %d", n, hot, due, start, counts, i, j)
				}
				if n < m && due[i] && !due[j] && c < d {
					t.Fatalf("shareReads(%d, %v, %v, %d) = %v: due partition %d not read before partition %d", n, hot, due, start, counts, i, j)
				}
			}
		}
		if sum != max(n, 0) {
			t.Fatalf("shareReads(%d, %v, %v, %d) = %v: %d slots asked for, want %d", n, hot, due, start, counts, sum, max(n, 0))
		}
	})
}

// partsOfCluster returns, for each of the cluster's primaries (by address), the
// partitions of keys' queue of n partitions whose stream that node itself says it holds:
// it answers a command on the key instead of redirecting it (MOVED).
func partsOfCluster(t *testing.T, addrs []string, keys Keys, n int) map[string][]int {
	t.Helper()
	out := map[string][]int{}
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a, MaxRetries: -1})
		role, err := c.Do(context.Background(), "ROLE").Slice()
		if err != nil {
			t.Fatal(err)
		}
		if role[0] != "master" {
			_ = c.Close()
			continue
		}
		for _, k := range keys.Partitions(n) {
			err := c.Exists(context.Background(), k.Stream()).Err()
			switch {
			case err == nil:
				out[a] = append(out[a], k.Partition)
			case !strings.HasPrefix(err.Error(), "MOVED"):
				t.Fatalf("EXISTS %s on %s: %v", k.Stream(), a, err)
			}
		}
		_ = c.Close()
	}
	return out
}

// The partitions a worker reads together are those one node holds, by the cluster's own
// account: each group is named by its node, every partition is in the group of the node
// that answers for its stream, and a client that is not a cluster client reads them all
// together.
func TestGroupByNodeFollowsTheClusterSlotMap(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rdb, err := connect.RedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	keys := Keys{Prefix: testenv.Prefix(t), Queue: "groups"}
	for _, n := range []int{6, 12} {
		w, err := NewWorker(WorkerConfig{Redis: rdb, Keys: keys, Partitions: n, Handler: newCountingHandler(), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		got := map[string][]int{}
		for _, g := range groupByNode(ctx, rdb, w.parts) {
			if _, dup := got[g.key]; dup {
				t.Fatalf("%d partitions: node %s named by two groups", n, g.key)
			}
			for _, p := range g.parts {
				got[g.key] = append(got[g.key], p.keys.Partition)
			}
		}
		want := partsOfCluster(t, c.Addrs(), keys, n)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%d partitions grouped %v, want the nodes' own %v", n, got, want)
		}
	}
	single, prefix := testenv.Redis(t)
	w, err := NewWorker(WorkerConfig{Redis: single, Keys: Keys{Prefix: prefix, Queue: "groups"}, Partitions: 6, Handler: newCountingHandler()})
	if err != nil {
		t.Fatal(err)
	}
	if g := groupByNode(ctx, single, w.parts); len(g) != 1 || len(g[0].parts) != 6 {
		t.Errorf("a client of one server grouped %d partitions as %d groups, want one", 6, len(g))
	}
}

// On a Redis Cluster (3 primaries, 6 partitions, so a node holds two at least), one
// worker runs every job exactly once, reclaims a dead consumer's entries in every
// partition, and reads a node's partitions in one round trip to that node: a pipeline
// of one XREADGROUP per partition (a cluster refuses one over several slots).
func TestAWorkerOnAClusterReadsEachNodesPartitionsTogether(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	rdb, err := connect.RedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	rec := newReadRecorder()
	recordNodes(t, rdb, rec)
	keys := Keys{Prefix: testenv.Prefix(t), Queue: "nodes"}
	const parts, n, dead = 6, 1200, 60
	owners := partsOfCluster(t, c.Addrs(), keys, parts)
	enqueueSpread(t, rdb, keys, parts, n, nil)
	// A consumer dies holding the first entries of every partition.
	for _, k := range keys.Partitions(parts) {
		if err := CreateGroup(ctx, rdb, k, DefaultGroup); err != nil {
			t.Fatal(err)
		}
		if err := rdb.XReadGroup(ctx, readArgs(k, "dead", dead/parts)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	rec.reset()
	h := newCountingHandler()
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Handler: h, Logger: slog.New(slog.DiscardHandler),
		ClaimIdle: time.Second, ClaimInterval: 50 * time.Millisecond})
	testenv.WaitFor(t, 60*time.Second, "every job run and acknowledged", func() bool {
		return h.jobs() == n && settled(t, rdb, keys, parts)
	})
	h.exactlyOnce(t, n)
	reclaimed := 0
	h.mu.Lock()
	for _, d := range h.deliveries {
		if d == 2 {
			reclaimed++
		}
	}
	h.mu.Unlock()
	if reclaimed != dead {
		t.Errorf("%d jobs ran as a second delivery, want the dead consumer's %d", reclaimed, dead)
	}
	// Every read went to one node and named only partitions it holds; the entries came
	// mostly in reads naming all of them.
	carried, total := 0, 0
	for _, tr := range rec.trips() {
		mine := owners[tr.node]
		for _, s := range tr.streams {
			if !slices.ContainsFunc(mine, func(p int) bool { return keys.InPartition(p).Stream() == s }) {
				t.Fatalf("a read round trip to %s named %s, a stream it does not hold (it holds partitions %v)", tr.node, s, mine)
			}
		}
		total += tr.entries
		if len(tr.streams) == len(mine) {
			carried += tr.entries
		}
	}
	if total != n-dead || carried < total/2 {
		t.Errorf("%d of %d new entries came in reads naming every partition of their node (%v), want most of %d", carried, total, owners, n-dead)
	}
}

// When a resharding moves a partition's slot to another node, the worker reads that
// partition with its new node's partitions, one round trip to that node, within
// regroupInterval, and every job before and after the move runs once.
func TestAWorkerRegroupsItsReadsWhenASlotMovesToAnotherNode(t *testing.T) {
	// Not parallel: it shortens regroupInterval, which every running worker reads. The
	// interval is restored after the worker stopped (cleanups run last first).
	was := regroupInterval
	t.Cleanup(func() { regroupInterval = was })
	regroupInterval = 100 * time.Millisecond
	c := testenv.PrivateRedisCluster(t, 3, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	rdb, err := connect.RedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	rec := newReadRecorder()
	recordNodes(t, rdb, rec)
	keys := Keys{Prefix: testenv.Prefix(t), Queue: "moves"}
	const parts = 6
	owners := partsOfCluster(t, c.Addrs(), keys, parts)
	// Move a partition from a node holding two or more to one holding one or more.
	from, to, moved := "", "", -1
	for a, ps := range owners {
		if len(ps) >= 2 && moved < 0 {
			from, moved = a, ps[0]
		}
	}
	for a, ps := range owners {
		if a != from && len(ps) >= 1 {
			to = a
		}
	}
	if moved < 0 || to == "" {
		t.Fatalf("no partition to move between nodes: %v", owners)
	}
	var (
		mu  sync.Mutex
		ran = map[string]int{}
	)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Concurrency: 8, Logger: slog.New(slog.DiscardHandler),
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			time.Sleep(2 * time.Millisecond)
			mu.Lock()
			ran[j.JobID]++
			mu.Unlock()
			return nil
		})})
	ranAll := func(n int) func() bool {
		return func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(ran) == n && settled(t, rdb, keys, parts)
		}
	}
	enqueueSpread(t, rdb, keys, parts, 300, nil)
	testenv.WaitFor(t, 30*time.Second, "the jobs before the move run", ranAll(300))

	stream := keys.InPartition(moved).Stream()
	slot, err := rdb.ClusterKeySlot(ctx, stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.MoveSlot(ctx, int(slot), to); err != nil {
		t.Fatal(err)
	}
	rdb.ReloadState(ctx)
	testenv.WaitFor(t, 10*time.Second, "the client's slot map to say the partition moved", func() bool {
		node, err := rdb.MasterForKey(ctx, stream)
		return err == nil && node.Options().Addr == to
	})
	time.Sleep(5 * regroupInterval) // the worker's next look at the map
	rec.reset()
	const after = 2000
	for i := 301; i <= 300+after; i++ {
		k := keys.InPartition(PartitionOf(jobID(i), parts))
		enqueue(t, rdb, k, message(i, nil))
	}
	testenv.WaitFor(t, 60*time.Second, "the jobs after the move run", ranAll(300+after))
	mu.Lock()
	for id, n := range ran {
		if n != 1 {
			t.Errorf("job %s ran %d times", id, n)
		}
	}
	mu.Unlock()
	want := append(slices.Clone(owners[to]), moved)
	together := false
	for _, tr := range rec.trips() {
		if tr.node == to && len(tr.streams) == len(want) && slices.Contains(tr.streams, stream) {
			together = true
		}
		if tr.node == from && slices.Contains(tr.streams, stream) {
			t.Errorf("after the move a read to its old node %s named the moved partition %d: %v", from, moved, tr.streams)
		}
	}
	if !together {
		t.Errorf("no read to %s named the moved partition %d with its partitions %v", to, moved, owners[to])
	}
}

// A backlog in one partition does not starve the others: with fewer free slots per read
// than partitions (Concurrency 1, or a busy worker whose slots come free one at a time),
// the other partitions are still read in turn, so a job enqueued to an idle partition
// runs long before the busy partition's backlog drains, as it would with a worker per
// partition sharing the slots.
func TestABacklogInOnePartitionDoesNotStarveTheOthers(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	const backlog = 100 // 20ms each: about 2s for the busy partition alone
	order := &runOrder{}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: 3, Concurrency: 1, Block: 200 * time.Millisecond, Handler: order})
	time.Sleep(300 * time.Millisecond) // the worker is reading
	busy, idle := keys.InPartition(0), keys.InPartition(1)
	for i := 1; i <= backlog; i++ {
		enqueue(t, rdb, busy, message(i, nil))
	}
	at, ran := order.placeOfOneAfterABacklog(t, backlog, func() { enqueue(t, rdb, idle, message(backlog+1, nil)) })
	if at > 20 {
		t.Fatalf("the idle partition's job ran %dth of %d: it waited for %d jobs of the busy partition's backlog", at+1, ran, at-5)
	}
}

// runOrder is a Handler that records the order jobs run in; each takes 20ms.
type runOrder struct {
	mu  sync.Mutex
	ids []string
}

func (o *runOrder) Handle(ctx context.Context, j *Job) error {
	o.mu.Lock()
	o.ids = append(o.ids, j.JobID)
	o.mu.Unlock()
	time.Sleep(20 * time.Millisecond)
	return nil
}

func (o *runOrder) len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.ids)
}

// placeOfOneAfterABacklog waits for a backlog of jobs to start running (5 of them),
// enqueues one more job with enqueue (jobID(backlog+1)), waits for all backlog+1, and
// returns the index the last job ran at and how many ran.
func (o *runOrder) placeOfOneAfterABacklog(t *testing.T, backlog int, enqueue func()) (at, ran int) {
	t.Helper()
	testenv.WaitFor(t, 5*time.Second, "the backlog to start", func() bool { return o.len() >= 5 })
	enqueue()
	testenv.WaitFor(t, 15*time.Second, "every job", func() bool { return o.len() == backlog+1 })
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Index(o.ids, jobID(backlog+1)), len(o.ids)
}

// A worker reads every one of its partitions whatever its Concurrency: with one slot
// (Concurrency 1) over 2 and over 4 partitions, a job enqueued to each partition runs
// within a few reads.
func TestAWorkerOfOneSlotReadsEveryPartition(t *testing.T) {
	t.Parallel()
	for _, parts := range []int{2, 4} {
		t.Run(fmt.Sprintf("%d partitions", parts), func(t *testing.T) {
			t.Parallel()
			rdb, keys := setup(t)
			h := newCountingHandler()
			start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Concurrency: 1, Handler: h})
			for p := range parts {
				enqueue(t, rdb, keys.InPartition(p), message(p+1, nil))
			}
			deadline := time.Now().Add(5 * time.Second)
			for h.jobs() < parts && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			for p := range parts {
				if h.runs[jobID(p+1)] != 1 {
					t.Errorf("the job of partition %d ran %d times in 5s, want once", p, h.runs[jobID(p+1)])
				}
			}
		})
	}
}

// A backlog of entries to reclaim in one partition (a dead consumer's) does not starve
// the others' new entries: a job enqueued to an idle partition runs long before the
// reclaim backlog drains, as it would with a worker per partition sharing the slots
// (and as a backlog of new entries does not starve them:
// TestABacklogInOnePartitionDoesNotStarveTheOthers). ClaimInterval is 5s, so the idle
// partitions' own reclaim scans (which, finding nothing, leave a slot to a read) do not
// fall due while the backlog drains.
func TestAReclaimBacklogInOnePartitionDoesNotStarveTheOthers(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	const backlog = 100 // 20ms each: about 2s for the reclaim backlog alone
	dead := keys.InPartition(0)
	for i := 1; i <= backlog; i++ {
		enqueue(t, rdb, dead, message(i, nil))
	}
	if err := CreateGroup(ctx, rdb, dead, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	if err := rdb.XReadGroup(ctx, readArgs(dead, "dead", backlog)).Err(); err != nil {
		t.Fatal(err)
	}
	const claimIdle = 200 * time.Millisecond
	time.Sleep(2 * claimIdle) // the consumer "died" holding them: all reclaimable
	order := &runOrder{}
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: 3, Concurrency: 2, Block: 200 * time.Millisecond,
		ClaimIdle: claimIdle, ClaimInterval: 5 * time.Second, Handler: order})
	at, ran := order.placeOfOneAfterABacklog(t, backlog, func() { enqueue(t, rdb, keys.InPartition(1), message(backlog+1, nil)) })
	if at > 30 {
		t.Fatalf("the idle partition's new job ran %dth of %d: it waited for %d jobs of another partition's reclaim backlog", at+1, ran, at-5)
	}
}

// A worker with fewer slots than partitions still reads each of them within a few
// reads: on a single Redis, with MaxPartitions partitions and the default Concurrency,
// an idle worker's reads (each naming as many partitions as it has slots, and blocking
// 20ms) turn through all the partitions in about MaxPartitions/Concurrency reads, so a
// job enqueued to any partition runs within a fraction of a second, as it did with a
// reader per partition sharing the slots (each got a slot for 20ms in turn).
func TestAWorkerOfFewerSlotsThanPartitionsReadsEachWithinAFewReads(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ran := make(chan string, 1)
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: MaxPartitions, Logger: slog.New(slog.DiscardHandler),
		Handler: HandlerFunc(func(_ context.Context, j *Job) error {
			ran <- j.JobID
			return nil
		})})
	time.Sleep(time.Second) // the worker is reading
	const jobs = 16
	var total, worst time.Duration
	for i := 1; i <= jobs; i++ {
		p := (i * 37) % MaxPartitions
		begin := time.Now()
		enqueue(t, rdb, keys.InPartition(p), message(i, nil))
		select {
		case id := <-ran:
			if id != jobID(i) {
				t.Fatalf("job %s ran, want %s", id, jobID(i))
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("the job of partition %d did not run in 30s", p)
		}
		took := time.Since(begin)
		total += took
		worst = max(worst, took)
	}
	// MaxPartitions/DefaultConcurrency = 4 reads of 20ms: 80ms for a turn, about half of
	// it on average. Allow several times that for a loaded machine.
	if mean := total / jobs; mean > 300*time.Millisecond {
		t.Errorf("a job enqueued to one of %d idle partitions waited %v on average (worst %v) before it ran, want under 300ms: the reads do not turn through the partitions %d at a time",
			MaxPartitions, mean.Round(time.Millisecond), worst.Round(time.Millisecond), DefaultConcurrency)
	}
}

// On a Redis Cluster a worker's readers of different nodes share its slots, and an idle
// node's reader that holds the last free slot gives it back within about 20ms
// (contendedBlock; docs/queue.md, Partitions: "while every slot is taken, such a wait
// lasts at most 20 ms before its slot goes back"), however idle the node: a slot taken
// by a handler of the worker (here, taken by the test as a handler would) comes free for
// the next job after about 20ms. With one slot (Concurrency 1) and partitions on two
// nodes or more, a backlog in one partition drains at one job per run and such wait.
func TestAnIdleNodesReaderGivesBackAContendedSlotWithin20ms(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	rdb, err := connect.RedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	const parts = 3
	var keys Keys
	for i := 0; ; i++ { // a queue whose partitions are on two nodes or more
		if i == 50 {
			t.Fatal("no queue name spreads 3 partitions over 2 nodes")
		}
		keys = Keys{Prefix: testenv.Prefix(t), Queue: fmt.Sprintf("idle%d", i)}
		if len(partsOfCluster(t, c.Addrs(), keys, parts)) >= 2 {
			break
		}
	}
	w := start(t, WorkerConfig{Redis: rdb, Keys: keys, Partitions: parts, Concurrency: 1, Logger: slog.New(slog.DiscardHandler),
		Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	time.Sleep(time.Second) // the worker is reading, every partition idle
	const takes = 30
	var total, worst time.Duration
	for range takes {
		begin := time.Now()
		w.slots <- struct{}{} // as a handler's run takes the slot
		waited := time.Since(begin)
		<-w.slots
		total += waited
		worst = max(worst, waited)
		time.Sleep(2 * time.Millisecond)
	}
	// 20ms and a round trip at most; allow 2.5 times that on average for a loaded machine.
	if mean := total / takes; mean > 50*time.Millisecond {
		t.Errorf("the worker's one slot came free after %v on average (worst %v) while its readers of idle nodes held it, want about 20ms at most",
			mean.Round(time.Millisecond), worst.Round(time.Millisecond))
	}
}
