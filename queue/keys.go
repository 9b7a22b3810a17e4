package queue

import (
	"fmt"
	"strings"
)

// Keys names the Redis keys of one queue. Prefix is the deployment's key prefix
// (ONCEFLOW_PREFIX) and Queue the queue's name ("summaries" in the service). Every key
// carries the hash tag {Queue}, so a queue's stream, dead-letter stream and job index
// live in one Redis Cluster slot and one Lua script may touch them all.
//
// Keys is a plain value, safe to copy and to use from many goroutines.
type Keys struct {
	Prefix string
	Queue  string
}

// Stream returns the key of the job stream: Prefix:{Queue}:stream.
func (k Keys) Stream() string { return k.base() + "stream" }

// Dead returns the key of the dead-letter stream: Prefix:{Queue}:dead.
func (k Keys) Dead() string { return k.base() + "dead" }

// Job returns the key of the job index hash of jobID: Prefix:{Queue}:job:jobID. The hash
// holds "tenant", "state" (queued) and "entry" (the latest stream entry id), written at
// enqueue and replay, and once the job was dead-lettered "state" failed, "reason",
// "dead_id" and "failed_at" (and no "entry"); see EnqueueLua and JobState. It has no TTL while the job is
// in the stream or dead-lettered, and WorkerConfig.JobTTL once its acknowledged entry was
// trimmed from the stream or its dead letter purged.
func (k Keys) Job(jobID string) string { return k.base() + "job:" + jobID }

// Runs returns the key of the hash of long runs' starts: Prefix:{Queue}:runs, entry id
// -> Unix milliseconds, written at a run's first lease renewal (see LongRuns).
func (k Keys) Runs() string { return k.base() + "runs" }

// Key returns Prefix:{Queue}:name, a further key in the queue's Cluster slot, for data
// that a Lua script must touch together with the queue's keys.
func (k Keys) Key(name string) string { return k.base() + name }

func (k Keys) base() string { return k.Prefix + ":{" + k.Queue + "}:" }

// Validate reports whether k can name keys: Prefix and Queue must be non-empty and free
// of braces, colons and whitespace (a brace would break the hash tag).
func (k Keys) Validate() error {
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
