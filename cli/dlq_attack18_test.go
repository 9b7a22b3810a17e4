package cli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"io"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/retry"

	"github.com/onceflow/onceflow/queue"
)

// Found by the attack round of issue 18, failed before its fix: docs/queue.md: "`onceflow dlq` lists ... (a `PARTITION` column, and
// `partition` in `--json`, when there are several)". DeadLetter.Partition is
// `json:"partition,omitempty"`, so the dead letters of partition 0 have no "partition"
// field in `dlq list --json` of a queue of several partitions: a script that reads
// .partition (to replay with the right keys) gets null for them.
func TestAttack18DLQListJSONHasPartitionOfEveryEntry(t *testing.T) {
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
}

// Found by the attack round of issue 18, failed before its fix: a P:partitions record that is not an integer (an operator's hand edit, which
// docs/queue.md asks for when lowering N: `HSET P:partitions Q N`) makes every `onceflow
// dlq` command fail ("strconv.Atoi"), so during an incident the operator cannot even
// list the dead letters of the configured partitions.
func TestAttack18DLQWithMalformedPartitionsRecord(t *testing.T) {
	t.Parallel()
	env, rdb, keys := workEnv(t, "ONCEFLOW_QUEUE_PARTITIONS=2")
	jobs := deadLetterJobs(t, rdb, keys, 1)
	if err := rdb.HSet(context.Background(), queue.PartitionsKey(keys.Prefix), keys.Queue, "2 ").Err(); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := dlq(t, env, "list"); code != 0 || !strings.Contains(out, jobs[0]) {
		t.Fatalf("dlq list with a malformed partitions record: exit %d, %q, %s", code, out, errOut)
	}
}

// Guard (attack round of issue 18): dead letters of a partition above the configured count (N lowered from 3 to 1,
// the record still 3) are listed and replayed, by job id and with --all, into their own
// partition; an entry id found in two partitions is refused with the job ids.
func TestAttack18DLQLoweredPartitions(t *testing.T) {
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
}

// Found by the attack round of issue 18, failed before its fix: the same job id dead-lettered in two partitions (a keyed job accepted twice
// across a change of N, which docs/queue.md accepts, whose runs both failed): `dlq
// replay <job id>` replays both dead letters, one into each partition, so the job is
// queued twice. In one partition the replay of a job's first dead letter retires its
// other (dlqAct's "replayed" map) and the job is queued once.
func TestAttack18DLQReplayJobDeadInTwoPartitionsQueuesItOnce(t *testing.T) {
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
