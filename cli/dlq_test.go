package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// deadLetterJobs enqueues n jobs and lets a worker fail them permanently.
func deadLetterJobs(t *testing.T, rdb *redis.Client, keys queue.Keys, n int) []string {
	t.Helper()
	return deadLetterJobsFrom(t, rdb, keys, 1, n)
}

// deadLetterJobsFrom is deadLetterJobs with job numbers first to first+n-1.
func deadLetterJobsFrom(t *testing.T, rdb *redis.Client, keys queue.Keys, first, n int) []string {
	t.Helper()
	var jobs []string
	before := rdb.XLen(context.Background(), keys.Dead()).Val()
	for i := range n {
		jobs = append(jobs, testJob(t, rdb, keys, first+i))
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { return retry.Permanent(io.ErrUnexpectedEOF) })})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	testenv.WaitFor(t, 10*time.Second, "dead letters", func() bool { return rdb.XLen(context.Background(), keys.Dead()).Val() == before+int64(n) })
	cancel()
	<-done
	return jobs
}

func dlq(t *testing.T, env []string, args ...string) (int, string, string) {
	t.Helper()
	p := testenv.Start(t, testenv.Binary(t), env, append([]string{"dlq"}, args...)...)
	code := p.Wait(20 * time.Second)
	return code, p.Stdout(), p.Stderr()
}

type listedDead struct {
	DeadID     string `json:"dead_id"`
	JobID      string `json:"job_id"`
	Tenant     string `json:"tenant"`
	Reason     string `json:"reason"`
	Deliveries int    `json:"deliveries"`
	Message    struct {
		Payload json.RawMessage `json:"payload"`
	} `json:"message"`
}

func TestDLQListReplayPurge(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t)
	ctx := context.Background()
	if code, out, _ := dlq(t, env, "list"); code != 0 || !strings.Contains(out, "no dead letters") {
		t.Fatalf("list of an empty queue: %d %q", code, out)
	}
	jobs := deadLetterJobs(t, rdb, keys, 3)

	code, out, errOut := dlq(t, env, "list", "--json")
	if code != 0 {
		t.Fatalf("list --json: exit %d: %s", code, errOut)
	}
	var listed []listedDead
	if err := json.Unmarshal([]byte(out), &listed); err != nil {
		t.Fatalf("list --json output %q: %v", out, err)
	}
	if len(listed) != 3 {
		t.Fatalf("listed %+v", listed)
	}
	// The handlers ran concurrently: order the listing by job.
	slices.SortFunc(listed, func(a, b listedDead) int { return strings.Compare(a.JobID, b.JobID) })
	for i, d := range listed {
		var payload bytes.Buffer
		_ = json.Compact(&payload, d.Message.Payload)
		if d.JobID != jobs[i] || d.Tenant != "acme" || d.Deliveries != 1 || d.Reason != "permanent: unexpected EOF" || payload.String() != `{"text":"x"}` {
			t.Errorf("listed %+v", d)
		}
	}
	code, out, _ = dlq(t, env, "list")
	if code != 0 || !strings.Contains(out, "DEAD ID") || !strings.Contains(out, jobs[2]) || !strings.Contains(out, "permanent: unexpected EOF") {
		t.Errorf("list table: %d\n%s", code, out)
	}

	// Replay by dead-letter entry id, flags after the id.
	code, out, errOut = dlq(t, env, "replay", listed[0].DeadID, "--json")
	var results []struct {
		DeadID  string `json:"dead_id"`
		JobID   string `json:"job_id"`
		EntryID string `json:"entry_id"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &results) != nil || len(results) != 1 || results[0].JobID != jobs[0] {
		t.Fatalf("replay %s: %d %q %s", listed[0].DeadID, code, out, errOut)
	}
	// Replay by job id.
	if code, out, errOut := dlq(t, env, "replay", jobs[1]); code != 0 || !strings.Contains(out, "replayed "+listed[1].DeadID) {
		t.Fatalf("replay %s: %d %q %s", jobs[1], code, out, errOut)
	}
	if n := rdb.XLen(ctx, keys.Dead()).Val(); n != 1 {
		t.Errorf("%d dead letters after two replays, want 1", n)
	}
	msgs := rdb.XRange(ctx, keys.Stream(), "-", "+").Val()
	replayed := map[string]int{}
	for _, m := range msgs {
		replayed[m.Values["job_id"].(string)]++
	}
	if replayed[jobs[0]] != 2 || replayed[jobs[1]] != 2 || replayed[jobs[2]] != 1 {
		t.Errorf("entries per job in the stream %v: the replayed jobs must be there again, with the same ids", replayed)
	}
	for _, j := range jobs[:2] {
		if _, state, _, _ := queue.JobState(ctx, rdb, keys, j); state != queue.StateQueued {
			t.Errorf("job %s state %q after replay", j, state)
		}
	}
	// A dead letter that is gone: exit 1.
	if code, _, errOut := dlq(t, env, "replay", listed[0].DeadID); code != 1 || !strings.Contains(errOut, "not found") {
		t.Errorf("replay of a replayed dead letter: %d %s", code, errOut)
	}
	if code, out, errOut := dlq(t, env, "purge", "--all"); code != 0 || !strings.Contains(out, "purged "+listed[2].DeadID) {
		t.Errorf("purge --all: %d %q %s", code, out, errOut)
	}
	if n := rdb.XLen(ctx, keys.Dead()).Val(); n != 0 {
		t.Errorf("%d dead letters after purge --all", n)
	}
	if _, state, _, _ := queue.JobState(ctx, rdb, keys, jobs[2]); state != queue.StateFailed {
		t.Errorf("purged job state %q, want failed", state)
	}
}

func TestDLQReplayAll(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t)
	deadLetterJobs(t, rdb, keys, 2)
	if code, out, errOut := dlq(t, env, "replay", "--all"); code != 0 || strings.Count(out, "replayed ") != 2 {
		t.Fatalf("replay --all: %d %q %s", code, out, errOut)
	}
	if n := rdb.XLen(context.Background(), keys.Dead()).Val(); n != 0 {
		t.Errorf("%d dead letters left", n)
	}
}

func TestDLQUsageErrors(t *testing.T) {
	t.Parallel()
	env, _, _ := workEnv(t)
	for _, args := range [][]string{
		{}, {"frob"}, {"replay"}, {"purge", "1-1", "--all"}, {"replay", "not an id"}, {"list", "1-1"}, {"replay", "1-1", "2-2"},
	} {
		if code, _, errOut := dlq(t, env, args...); code != 2 {
			t.Errorf("dlq %v: exit %d, want 2; %s", args, code, errOut)
		}
	}
	if code, _, errOut := dlq(t, env, "purge", "00000000-0000-4000-8000-000000000099"); code != 1 || !strings.Contains(errOut, "has no dead letter") {
		t.Errorf("purge of a job without dead letters: %d %s", code, errOut)
	}
}

// Issue 12, item 8: `dlq purge --older-than D` deletes the dead letters that failed more
// than D ago, gives their job indexes the result TTL, and says how many it deleted.
func TestDLQPurgeOlderThan(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t)
	ctx := context.Background()
	oldJob := "00000000-0000-4000-8000-0000000000aa"
	failedAt := time.Now().Add(-48 * time.Hour).UnixMilli()
	oldID := strconv.FormatInt(failedAt, 10) + "-0"
	m := queue.Message{JobID: oldJob, Tenant: "acme", Payload: json.RawMessage(`{"text":"x"}`), EnqueuedAt: time.UnixMilli(failedAt - 1000)}
	rec := append(m.Values(), "reason", "permanent: old", "original_id", "1-0", "failed_at", strconv.FormatInt(failedAt, 10), "deliveries", "1")
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Dead(), ID: oldID, Values: rec}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, keys.Job(oldJob), "tenant", "acme", "state", "failed", "reason", "permanent: old", "dead_id", oldID).Err(); err != nil {
		t.Fatal(err)
	}
	young := deadLetterJobs(t, rdb, keys, 1)[0]

	code, out, errOut := dlq(t, env, "purge", "--older-than", "24h", "--json")
	if code != 0 {
		t.Fatalf("purge --older-than 24h --json: exit %d: %s", code, errOut)
	}
	var res struct {
		Purged int64 `json:"purged"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.Purged != 1 {
		t.Fatalf("purge --older-than --json output %q (%v), want {\"purged\": 1}", out, err)
	}
	left, _, err := queue.ListDead(ctx, rdb, keys, "", 10)
	if err != nil || len(left) != 1 || left[0].JobID != young {
		t.Fatalf("dead letters left %+v (%v), want only the young one", left, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(oldJob)).Val(); ttl <= 0 || ttl > 24*time.Hour {
		t.Errorf("purged job's index TTL %v, want the result TTL", ttl)
	}
	if code, out, errOut := dlq(t, env, "purge", "--older-than", "24h"); code != 0 || !strings.Contains(out, "purged 0 dead letters") {
		t.Errorf("second purge --older-than: exit %d %q %s, want purged 0", code, out, errOut)
	}
	for _, args := range [][]string{
		{"purge", "--older-than", "24h", "--all"}, {"purge", "--older-than", "24h", oldID}, {"purge", "--older-than", "0s"},
		{"purge", "--older-than", "soon"}, {"replay", "--older-than", "24h"},
	} {
		if code, _, errOut := dlq(t, env, args...); code != 2 {
			t.Errorf("dlq %v: exit %d, want 2; %s", args, code, errOut)
		}
	}
}

// `onceflow dlq` on a queue of several partitions: it lists and replays every
// partition's dead letters, into their own partition, whatever the P:partitions record
// says.
func TestDLQOnAPartitionedQueue(t *testing.T) {
	t.Parallel()
	// docs/queue.md: "a `PARTITION` column, and `partition` in `--json`, when there are
	// several": partition 0's dead letters too (a script reads .partition to replay with the
	// right keys), not only those of the others.
	t.Run("list --json names every entry's partition", func(t *testing.T) {
		t.Parallel()
		env, rdb, keys := workEnv(t, "ONCEFLOW_QUEUE_PARTITIONS=2")
		deadLetterJobs(t, rdb, keys.InPartition(0), 1)
		deadLetterJobs(t, rdb, keys.InPartition(1), 1)
		code, out, errOut := dlq(t, env, "list", "--json")
		if code != 0 {
			t.Fatalf("list --json: exit %d: %s", code, errOut)
		}
		var listed []map[string]json.RawMessage
		if err := json.Unmarshal([]byte(out), &listed); err != nil || len(listed) != 2 {
			t.Fatalf("list --json: %q, %v", out, err)
		}
		for _, d := range listed {
			if _, ok := d["partition"]; !ok {
				t.Errorf("dead letter %s of a queue of 2 partitions has no \"partition\" in --json", d["dead_id"])
			}
		}
	})
	// A P:partitions record that is not an integer (an operator's hand edit, which
	// docs/queue.md asks for when lowering N: `HSET P:partitions Q N`) does not make every
	// command fail: during an incident the operator can still list and replay.
	t.Run("a malformed partitions record does not stop it", func(t *testing.T) {
		t.Parallel()
		env, rdb, keys := workEnv(t, "ONCEFLOW_QUEUE_PARTITIONS=2")
		jobs := deadLetterJobs(t, rdb, keys, 1)
		if err := rdb.HSet(context.Background(), queue.PartitionsKey(keys.Prefix), keys.Queue, "2 ").Err(); err != nil {
			t.Fatal(err)
		}
		if code, out, errOut := dlq(t, env, "list"); code != 0 || !strings.Contains(out, jobs[0]) {
			t.Fatalf("dlq list with a malformed partitions record: exit %d, %q, %s", code, out, errOut)
		}
	})
	// N lowered from 3 to 1, the record still 3: the dead letters of the higher partitions
	// are listed and replayed, by job id and with --all, into their own partition; an entry
	// id found in two partitions is refused with the job ids.
	t.Run("dead letters above the configured count are listed and replayed", func(t *testing.T) {
		t.Parallel()
		env, rdb, keys := workEnv(t, "ONCEFLOW_QUEUE_PARTITIONS=1")
		ctx := context.Background()
		if _, err := queue.RegisterPartitions(ctx, rdb, keys, 3); err != nil {
			t.Fatal(err)
		}
		p0 := deadLetterJobs(t, rdb, keys.InPartition(0), 1)
		// Other job ids than partition 0's (deadLetterJobs numbers its jobs from 1).
		p2 := deadLetterJobsFrom(t, rdb, keys.InPartition(2), 11, 2)
		code, out, errOut := dlq(t, env, "list", "--json")
		var listed []queue.DeadLetter
		if code != 0 || json.Unmarshal([]byte(out), &listed) != nil || len(listed) != 3 {
			t.Fatalf("list --json: %d %q %s", code, out, errOut)
		}
		for _, d := range listed {
			want := 2
			if d.JobID == p0[0] {
				want = 0
			}
			if d.Partition != want {
				t.Errorf("dead letter of job %s listed in partition %d, want %d", d.JobID, d.Partition, want)
			}
		}
		if code, out, errOut := dlq(t, env, "replay", p2[0]); code != 0 || !strings.Contains(out, "replayed") {
			t.Fatalf("replay %s: %d %q %s", p2[0], code, out, errOut)
		}
		if n := rdb.XLen(ctx, keys.InPartition(2).Stream()).Val(); n != 3 {
			t.Fatalf("partition 2's stream has %d entries after one replay, want 3 (2 + the replay)", n)
		}
		if n := rdb.XLen(ctx, keys.Stream()).Val(); n != 1 {
			t.Fatalf("partition 0's stream has %d entries, want 1 (the replay must go to partition 2)", n)
		}
		// The same entry id in partitions 0 and 2.
		raw := rdb.XRange(ctx, keys.InPartition(2).Dead(), "-", "+").Val()
		if len(raw) != 1 {
			t.Fatalf("partition 2 has %d dead letters", len(raw))
		}
		for _, k := range []queue.Keys{keys.InPartition(0), keys.InPartition(2)} {
			if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: k.Dead(), ID: "9999999999999-0", Values: raw[0].Values}).Err(); err != nil {
				t.Fatal(err)
			}
		}
		if code, _, errOut := dlq(t, env, "purge", "9999999999999-0"); code == 0 || !strings.Contains(errOut, "partitions") {
			t.Fatalf("purge of an entry id in two partitions: exit %d, %s; want refused", code, errOut)
		}
		if code, out, errOut := dlq(t, env, "replay", "--all"); code != 0 {
			t.Fatalf("replay --all: %d %q %s", code, out, errOut)
		}
		if n := rdb.XLen(ctx, keys.InPartition(2).Dead()).Val() + rdb.XLen(ctx, keys.Dead()).Val(); n != 0 {
			t.Fatalf("%d dead letters after replay --all", n)
		}
	})
	// The same job id dead-lettered in two partitions (a keyed job accepted twice across a
	// change of N, whose runs both failed): `dlq replay <job id>` queues the job once, as
	// in one partition, where the replay of a job's first dead letter retires its other.
	t.Run("a job dead in two partitions is replayed once", func(t *testing.T) {
		t.Parallel()
		env, rdb, keys := workEnv(t, "ONCEFLOW_QUEUE_PARTITIONS=3")
		ctx := context.Background()
		job := deadLetterJobs(t, rdb, keys.InPartition(0), 1)[0]
		if again := deadLetterJobs(t, rdb, keys.InPartition(2), 1)[0]; again != job {
			t.Fatalf("job ids %s and %s", job, again)
		}
		before := rdb.XLen(ctx, keys.Stream()).Val() + rdb.XLen(ctx, keys.InPartition(2).Stream()).Val()
		if code, out, errOut := dlq(t, env, "replay", job); code != 0 {
			t.Fatalf("replay %s: %d %q %s", job, code, out, errOut)
		}
		after := rdb.XLen(ctx, keys.Stream()).Val() + rdb.XLen(ctx, keys.InPartition(2).Stream()).Val()
		if after-before != 1 {
			t.Fatalf("replay of job %s (dead in partitions 0 and 2) added %d stream entries, want 1", job, after-before)
		}
	})
}
