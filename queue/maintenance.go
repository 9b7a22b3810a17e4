package queue

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// thresholdScript finds how far the stream can be trimmed: the lowest entry id a
// consumer group still needs (lua/threshold.lua).
var thresholdScript = scripts.MustScript("lua/threshold.lua")

// readThreshold runs thresholdScript: "" when keys' stream has no entry every group has
// acknowledged (no stream, or no group).
func readThreshold(ctx context.Context, rdb redis.Scripter, keys Keys) (string, error) {
	return thresholdScript.Run(ctx, rdb, []string{keys.Stream()}).Text()
}

// trimBatchScript releases the job indexes of a batch of acknowledged entries, moves
// their success records into them, and trims the batch from the stream
// (lua/trim_batch.lua).
var trimBatchScript = scripts.MustScript("lua/trim_batch.lua")

// trimEntries runs trimBatchScript for msgs, a batch of acknowledged entries of keys'
// stream in order, giving their jobs' indexes jobTTL, and returns how many entries it
// trimmed.
func trimEntries(ctx context.Context, rdb redis.Scripter, keys Keys, jobTTL time.Duration, msgs []redis.XMessage) (int64, error) {
	ks := make([]string, 2, 2+len(msgs))
	ks[0], ks[1] = keys.Stream(), keys.Successes()
	args := make([]any, 2, 2+len(msgs))
	args[0], args[1] = jobTTL.Milliseconds(), nextID(msgs[len(msgs)-1].ID)
	for _, m := range msgs {
		if id, _ := m.Values[fieldJobID].(string); ValidJobID(id) {
			ks = append(ks, keys.Job(id))
			args = append(args, m.ID)
		}
	}
	return trimBatchScript.Run(ctx, rdb, ks, args...).Int64()
}

// trimBatch bounds the entries one trimBatchScript call releases.
const trimBatch = 500

// Trim removes from keys.Stream() every entry that all consumer groups have
// acknowledged, never one that is pending or not yet delivered to some group (unlike
// MAXLEN trimming, which can delete pending entries), and gives the job index of each
// removed entry jobTTL (the index of a job that left the stream; see trimBatchScript).
// It returns the number of entries removed. Its cost grows with them: one round trip to
// find the threshold, then two per batch of 500 entries (XRANGE, and the script that
// releases their indexes and trims them), off the jobs' path. Safe for concurrent use
// and to run from several workers.
func Trim(ctx context.Context, rdb redis.Cmdable, keys Keys, jobTTL time.Duration) (int64, error) {
	if err := keys.Validate(); err != nil {
		return 0, err
	}
	if err := sweepSuccesses(ctx, rdb, keys); err != nil {
		return 0, fmt.Errorf("trim %s: %w", keys.Stream(), err)
	}
	threshold, err := readThreshold(ctx, rdb, keys)
	if err != nil {
		return 0, fmt.Errorf("trim %s: %w", keys.Stream(), err)
	}
	if threshold == "" {
		return 0, nil
	}
	var total int64
	for {
		msgs, err := rdb.XRangeN(ctx, keys.Stream(), "-", "("+threshold, trimBatch).Result()
		if err != nil {
			return total, fmt.Errorf("trim %s: %w", keys.Stream(), err)
		}
		if len(msgs) == 0 {
			return total, nil
		}
		n, err := trimEntries(ctx, rdb, keys, jobTTL, msgs)
		if err != nil {
			return total, fmt.Errorf("trim %s: %w", keys.Stream(), err)
		}
		total += n
		if len(msgs) < trimBatch {
			return total, nil
		}
	}
}

// sweepSuccessesScript deletes, from one HSCAN page of the successes hash, the records of
// entries no longer in the stream (lua/sweep_successes.lua).
var sweepSuccessesScript = scripts.MustScript("lua/sweep_successes.lua")

// sweepSuccesses runs sweepSuccessesScript over the whole successes hash: one round
// trip when it is empty or small (recent successes, not yet trimmed), once a trim.
func sweepSuccesses(ctx context.Context, rdb redis.Scripter, keys Keys) error {
	cursor := "0"
	for {
		next, err := sweepSuccessesScript.Run(ctx, rdb, []string{keys.Stream(), keys.Successes()}, cursor).Text()
		if err != nil {
			return fmt.Errorf("sweep success records: %w", err)
		}
		if next == "0" {
			return nil
		}
		cursor = next
	}
}

// nextID returns the stream entry id just after id (ms-seq).
func nextID(id string) string {
	ms, seq, _ := splitID(id)
	return strconv.FormatUint(ms, 10) + "-" + strconv.FormatUint(seq+1, 10)
}

// deleteConsumersScript deletes the idle consumers of a group that hold no pending
// entry (lua/delete_consumers.lua).
var deleteConsumersScript = scripts.MustScript("lua/delete_consumers.lua")

// DeleteIdleConsumers deletes the consumers of group that have no pending entries and
// have been idle longer than maxIdle, except keep (the caller's own name), and returns
// their names. A consumer with pending entries is never deleted. One round trip; safe
// for concurrent use.
func DeleteIdleConsumers(ctx context.Context, rdb redis.Scripter, keys Keys, group, keep string, maxIdle time.Duration) ([]string, error) {
	if err := keys.Validate(); err != nil {
		return nil, err
	}
	names, err := deleteConsumersScript.Run(ctx, rdb, []string{keys.Stream()}, group, keep, maxIdle.Milliseconds()).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("delete idle consumers of %s: %w", group, err)
	}
	return names, nil
}

// renewScript resets the idle time of entries the caller still owns and records when
// their runs started (lua/renew.lua).
var renewScript = scripts.MustScript("lua/renew.lua")

// renew runs renewScript for ids, whose runs started at starts (at most renewChunk per
// call).
func renew(ctx context.Context, rdb redis.Scripter, keys Keys, group, consumer string, ids []string, starts []time.Time) (lost, deleted []string, err error) {
	args := make([]any, 0, 2+2*len(ids))
	args = append(args, group, consumer)
	for i, id := range ids {
		args = append(args, id, starts[i].UnixMilli())
	}
	res, err := renewScript.Run(ctx, rdb, []string{keys.Stream(), keys.Runs()}, args...).Slice()
	if err != nil {
		return nil, nil, fmt.Errorf("renew leases: %w", err)
	}
	strs := func(v any) []string {
		l, _ := v.([]any)
		out := make([]string, 0, len(l))
		for _, x := range l {
			if s, ok := x.(string); ok {
				out = append(out, s)
			}
		}
		return out
	}
	return strs(res[0]), strs(res[1]), nil
}

// renewChunk bounds the ids per renewal script call (Lua's unpack has a stack limit).
const renewChunk = 1000

// Stats describes a queue at one moment.
type Stats struct {
	// Length is the number of entries in the stream.
	Length int64 `json:"length"`
	// Pending is the number of entries delivered to the group and not acknowledged.
	Pending int64 `json:"pending"`
	// OldestPendingIdle is the idle time of the pending entry with the lowest id (the
	// longest waiting one, unless it was reclaimed or renewed), 0 when none is pending.
	OldestPendingIdle time.Duration `json:"oldest_pending_idle"`
	// Dead is the number of entries in the dead-letter stream.
	Dead int64 `json:"dead"`
	// Scheduled is the number of jobs in the scheduled set (retries, snoozes,
	// hand-backs and EnqueueAt's jobs waiting for their time).
	Scheduled int64 `json:"scheduled"`
}

// ReadStats reads Stats for group in one round trip (a pipeline of XLEN, XPENDING, XLEN
// and ZCARD). A missing stream or group counts as empty. Safe for concurrent use.
func ReadStats(ctx context.Context, rdb redis.Cmdable, keys Keys, group string) (Stats, error) {
	return ReadStatsOf(ctx, rdb, []Keys{keys}, group)
}

// ReadStatsOf reads the Stats of the partitions parts (Keys.Partitions) summed, the
// oldest pending idle time the longest of theirs, in one pipeline (one round trip per
// Redis node that holds one of them).
func ReadStatsOf(ctx context.Context, rdb redis.Cmdable, parts []Keys, group string) (Stats, error) {
	type reads struct {
		length, dead, scheduled *redis.IntCmd
		summary                 *redis.XPendingCmd
		oldest                  *redis.XPendingExtCmd
	}
	pipe := rdb.Pipeline()
	rs := make([]reads, len(parts))
	for i, keys := range parts {
		rs[i] = reads{
			length:    pipe.XLen(ctx, keys.Stream()),
			summary:   pipe.XPending(ctx, keys.Stream(), group),
			oldest:    pipe.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: group, Start: "-", End: "+", Count: 1}),
			dead:      pipe.XLen(ctx, keys.Dead()),
			scheduled: pipe.ZCard(ctx, keys.Scheduled()),
		}
	}
	_, _ = pipe.Exec(ctx)
	var total Stats
	for _, r := range rs {
		var s Stats
		var err error
		s.Length, err = r.length.Result()
		if err != nil {
			return Stats{}, fmt.Errorf("read queue stats: %w", err)
		}
		if s.Dead, err = r.dead.Result(); err != nil {
			return Stats{}, fmt.Errorf("read queue stats: %w", err)
		}
		if s.Scheduled, err = r.scheduled.Result(); err != nil {
			return Stats{}, fmt.Errorf("read queue stats: %w", err)
		}
		sum, err := r.summary.Result()
		if err != nil && !isNoGroup(err) && !errors.Is(err, redis.Nil) {
			return Stats{}, fmt.Errorf("read queue stats: %w", err)
		}
		if sum != nil {
			s.Pending = sum.Count
		}
		if o, err := r.oldest.Result(); err == nil && len(o) > 0 {
			s.OldestPendingIdle = o[0].Idle
		}
		total = total.Add(s)
	}
	return total, nil
}

// Add returns the Stats of s and o together (of two partitions): the counts summed, the
// longer oldest pending idle time.
func (s Stats) Add(o Stats) Stats {
	return Stats{
		Length: s.Length + o.Length, Pending: s.Pending + o.Pending, Dead: s.Dead + o.Dead,
		Scheduled: s.Scheduled + o.Scheduled, OldestPendingIdle: max(s.OldestPendingIdle, o.OldestPendingIdle),
	}
}

// PendingEntry is one entry of a consumer group's pending entries list.
type PendingEntry struct {
	// ID is the stream entry id.
	ID string `json:"id"`
	// Consumer owns the entry.
	Consumer string `json:"consumer"`
	// Idle is the time since it was last delivered, claimed or renewed.
	Idle time.Duration `json:"idle"`
	// Deliveries is its delivery count.
	Deliveries int64 `json:"deliveries"`
}

// StalePending returns up to count entries of group that have been pending for at least
// idle without a delivery, claim or lease renewal (XPENDING ... IDLE), lowest id first.
// With workers running, an entry stays pending longer than about ClaimIdle plus the
// claim interval only when nothing reclaims it, so `onceflow audit` reports entries
// idle for twice ClaimIdle. A missing stream or group has none. One round trip; safe for
// concurrent use.
func StalePending(ctx context.Context, rdb redis.Cmdable, keys Keys, group string, idle time.Duration, count int64) ([]PendingEntry, error) {
	res, err := rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: keys.Stream(), Group: group, Idle: idle, Start: "-", End: "+", Count: count,
	}).Result()
	if isNoGroup(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read stale pending entries: %w", err)
	}
	out := make([]PendingEntry, 0, len(res))
	for _, p := range res {
		out = append(out, PendingEntry{ID: p.ID, Consumer: p.Consumer, Idle: p.Idle, Deliveries: p.RetryCount})
	}
	return out, nil
}

// LongRun is a run whose lease was renewed: its entry, when it started, and its entry's
// pending record.
type LongRun struct {
	PendingEntry
	// Started is when the run began (the worker's clock).
	Started time.Time `json:"started"`
}

// LongRuns returns up to count runs that started before before and whose entries are
// still pending in group, oldest first: runs that renewals keep from looking idle
// (StalePending misses them). Their starts are in the runs hash (Keys.Runs), written at
// a run's first lease renewal and deleted when its worker settles it; an entry that is
// no longer pending (its worker died after the start was written) is left out. Two
// round trips (HGETALL, then one pipelined XPENDING per old run).
func LongRuns(ctx context.Context, rdb redis.Cmdable, keys Keys, group string, before time.Time, count int) ([]LongRun, error) {
	all, err := rdb.HGetAll(ctx, keys.Runs()).Result()
	if err != nil {
		return nil, fmt.Errorf("read long runs: %w", err)
	}
	var old []LongRun
	for id, v := range all {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || !time.UnixMilli(ms).Before(before) {
			continue
		}
		old = append(old, LongRun{PendingEntry: PendingEntry{ID: id}, Started: time.UnixMilli(ms).UTC()})
	}
	if len(old) == 0 {
		return nil, nil
	}
	slices.SortFunc(old, func(a, b LongRun) int { return a.Started.Compare(b.Started) })
	pipe := rdb.Pipeline()
	cmds := make([]*redis.XPendingExtCmd, len(old))
	for i, r := range old {
		cmds[i] = pipe.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: group, Start: r.ID, End: r.ID, Count: 1})
	}
	_, _ = pipe.Exec(ctx)
	out := make([]LongRun, 0, min(len(old), count))
	for i, r := range old {
		p, err := cmds[i].Result()
		if isNoGroup(err) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read long runs: %w", err)
		}
		if len(p) == 1 && len(out) < count {
			r.Consumer, r.Idle, r.Deliveries = p[0].Consumer, p[0].Idle, p[0].RetryCount
			out = append(out, r)
		}
	}
	return out, nil
}

// forgetRuns deletes from the runs hash the starts of entries no longer pending in group
// (their worker died between writing the start and settling the entry). Maintenance
// runs it; its cost grows with the long runs in flight.
func forgetRuns(ctx context.Context, rdb redis.Cmdable, keys Keys, group string) (int, error) {
	ids, err := rdb.HKeys(ctx, keys.Runs()).Result()
	if err != nil || len(ids) == 0 {
		return 0, err
	}
	pipe := rdb.Pipeline()
	cmds := make([]*redis.XPendingExtCmd, len(ids))
	for i, id := range ids {
		cmds[i] = pipe.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: group, Start: id, End: id, Count: 1})
	}
	_, _ = pipe.Exec(ctx)
	var gone []string
	for i, c := range cmds {
		if p, err := c.Result(); err == nil && len(p) == 0 {
			gone = append(gone, ids[i])
		}
	}
	if len(gone) == 0 {
		return 0, nil
	}
	return len(gone), rdb.HDel(ctx, keys.Runs(), gone...).Err()
}
