package queue

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
)

// Keys names the Redis keys of one queue, or of one partition of a partitioned queue.
// Prefix is the deployment's key prefix (ONCEFLOW_PREFIX) and Queue the queue's name
// ("summaries" in the service). Every key carries one hash tag, {Queue} for partition 0
// and {Queue:P} for partition P, so a partition's stream, dead-letter stream, scheduled
// set and job index live in one Redis Cluster slot and one Lua script may touch them
// all, while the partitions of a queue spread over a cluster's nodes. A queue of one
// partition is partition 0: its keys are those of an unpartitioned queue.
//
// Keys is a plain value, safe to copy and to use from many goroutines.
type Keys struct {
	Prefix string
	Queue  string
	// Partition is the partition's number, from 0 (the default) to the queue's
	// partitions minus one; see PartitionOf.
	Partition int
}

// InPartition returns k for partition p of the same queue.
func (k Keys) InPartition(p int) Keys { k.Partition = p; return k }

// Partitions returns the keys of partitions 0 to n-1 of k's queue (one when n < 2).
func (k Keys) Partitions(n int) []Keys {
	out := make([]Keys, max(n, 1))
	for p := range out {
		out[p] = k.InPartition(p)
	}
	return out
}

// PartitionOf returns the partition, of n, of the job jobID: a hash of its id (FNV-1a,
// modulo n), so every process agrees without asking Redis. A job id derived from an
// idempotency key (the API's jobs) makes the partition a function of the key and its
// tenant: a retried request finds its record in the partition it was accepted in, as long
// as n is unchanged (docs/queue.md, "Partitions"). n < 2 gives 0.
func PartitionOf(jobID string, n int) int {
	if n < 2 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(jobID))
	return int(h.Sum32() % uint32(n)) // #nosec G115 -- n is 2 to MaxPartitions here: no overflow either way
}

// PartitionsKey returns the key of the hash of the most partitions each queue was ever
// given (queue -> count), under prefix: Workers read it to keep consuming partitions a
// lowered count no longer enqueues to (RegisterPartitions).
func PartitionsKey(prefix string) string { return prefix + ":partitions" }

// Stream returns the key of the job stream: Prefix:{Queue}:stream.
func (k Keys) Stream() string { return k.base() + "stream" }

// Dead returns the key of the dead-letter stream: Prefix:{Queue}:dead.
func (k Keys) Dead() string { return k.base() + "dead" }

// Job returns the key of the job index hash of jobID: Prefix:{Queue}:job:jobID. The hash
// holds "tenant", "state" (queued) and "entry" (the latest stream entry id), written at
// enqueue and replay, and once the job was dead-lettered "state" failed, "reason",
// "dead_id" and "failed_at" (and no "entry"); see lua/enqueue.lua and JobState. It has no TTL while the job is
// in the stream or dead-lettered, and WorkerConfig.JobTTL once its acknowledged entry was
// trimmed from the stream or its dead letter purged.
func (k Keys) Job(jobID string) string { return k.base() + "job:" + jobID }

// Successes returns the key of the hash of recent successes: Prefix:{Queue}:successes,
// entry id -> the success record of its delivery (see ReadHistory). The acknowledgement
// writes it in the same round trip as its XACK; the trim moves each record into its
// job's index ("done") as it removes the entry.
func (k Keys) Successes() string { return k.base() + "successes" }

// Runs returns the key of the hash of long runs' starts: Prefix:{Queue}:runs, entry id
// -> Unix milliseconds, written at a run's first lease renewal (see LongRuns).
func (k Keys) Runs() string { return k.base() + "runs" }

// Key returns Prefix:{Queue}:name, a further key in the queue's Cluster slot, for data
// that a Lua script must touch together with the queue's keys.
func (k Keys) Key(name string) string { return k.base() + name }

func (k Keys) base() string {
	if k.Partition == 0 {
		return k.Prefix + ":{" + k.Queue + "}:"
	}
	return k.Prefix + ":{" + k.Queue + ":" + strconv.Itoa(k.Partition) + "}:"
}

// Name returns the queue's name with its partition when it is not 0 (summaries:2), for
// logs and pages.
func (k Keys) Name() string {
	if k.Partition == 0 {
		return k.Queue
	}
	return k.Queue + ":" + strconv.Itoa(k.Partition)
}

// Validate reports whether k can name keys: Prefix and Queue must be non-empty and free
// of braces, colons and whitespace (a brace would break the hash tag), and Partition
// within 0 to MaxPartitions-1. The functions of this package that run a script on a
// queue's keys (Enqueue, EnqueueAt, Replay, Purge, TrimDead, Trim, MoveDue, Wake,
// WakeFor, DeleteIdleConsumers, ReadHistory, RegisterPartitions) and NewWorker return its
// error before they reach Redis, where a broken hash tag is a CROSSSLOT error on a Redis
// Cluster.
func (k Keys) Validate() error {
	if k.Partition < 0 || k.Partition >= MaxPartitions {
		return fmt.Errorf("queue keys: partition %d is outside 0 to %d", k.Partition, MaxPartitions-1)
	}
	for _, f := range []struct{ name, v string }{{"prefix", k.Prefix}, {"queue", k.Queue}} {
		if f.v == "" {
			return fmt.Errorf("queue keys: %s is empty", f.name)
		}
		if strings.ContainsAny(f.v, "{}: \t\r\n") {
			return fmt.Errorf("queue keys: %s %q contains a brace, colon or whitespace", f.name, f.v)
		}
	}
	return nil
}

// MaxPartitions bounds a queue's partitions: each has a reader loop and a consumer group
// in every worker process.
const MaxPartitions = 256
