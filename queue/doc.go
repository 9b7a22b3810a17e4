// Package queue is an at-least-once job queue on Redis Streams consumer groups: Enqueue
// adds a job, a Worker runs jobs with a bounded number in flight, and jobs that cannot
// succeed end in a dead-letter stream that an operator lists, replays or purges.
//
// # Failure model
//
// Every delivery may be repeated: a worker can finish a job and die before its XACK, or
// a slow worker can lose its message to another after ClaimIdle. Handlers must therefore
// be idempotent (the job id, derived by the caller, is the deduplication key). What the
// queue guarantees is that no job is lost: a message stays in the consumer group's
// pending entries list (PEL) until a handler succeeded or it was moved to the dead-letter
// stream, and the move is atomic.
//
// # How a Worker runs
//
// One loop per Worker and Redis node (a Worker of several partitions reads those one
// node holds in one round trip; see WorkerConfig.Partitions):
//
//  1. wait for at least one free slot (at most Concurrency handlers run at once);
//  2. reclaim entries idle longer than ClaimIdle of the partitions whose scan is due:
//     one script per partition (XAUTOCLAIM, keeping the cursor between calls, and the
//     XPENDING delivery counts of what it claimed), all in one round trip; entries Redis
//     reports as deleted while pending are logged and counted;
//  3. XREADGROUP ">" with COUNT = the remaining free slots (divided between the
//     partitions read) and a finite BLOCK, so the worker never holds more messages than
//     it can run (a new entry read with ">" has been delivered exactly once);
//  4. each job runs in its own goroutine. A nil error is acknowledged through a batching
//     acknowledger (many ids per XACK; the maintenance trim later starts the TTL of
//     the jobs' indexes); an error wrapping ErrPermanent, a malformed
//     message or a delivery count above MaxDeliveries moves the entry to the dead-letter
//     stream (XADD dead + XACK + the job index, in one atomic script); any other error
//     or a panic leaves the entry pending, to be reclaimed after ClaimIdle.
//
// Beside the loop, a lease renewer resets the idle time of the worker's in-flight
// entries (XCLAIM to itself with JUSTID, which does not count as a delivery) every
// RenewInterval, so a slow but live worker keeps its messages; a maintenance goroutine
// trims acknowledged entries (XTRIM MINID below the oldest entry any group still needs)
// and dead letters older than DeadLetterRetention, deletes consumers idle for long with
// nothing pending, and samples gauges.
//
// # The job index
//
// Every enqueue (Enqueue, Replay, and any script running EnqueueStep's step, such as the
// API's accept) records the job's tenant and state in its index; the index does not expire
// while the job is queued, running or dead-lettered, and expires JobTTL after the
// trim removed the job's acknowledged entry or its dead letter was deleted. Enqueueing a job whose index says failed
// runs it again and retires its dead letter, as a replay does.
//
// docs/queue.md explains the design in full: keys, the wire format, delivery counts and
// lease renewal, trimming, consumer hygiene and the dead-letter record.
//
// # Keys
//
// All keys of one queue share a Redis Cluster hash tag: for prefix P and queue Q the
// stream is P:{Q}:stream, the dead-letter stream P:{Q}:dead and the job index of job J
// P:{Q}:job:J (see Keys).
package queue
