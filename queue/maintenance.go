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

// thresholdScript finds how far the stream can be trimmed.
//
//	KEYS[1]  the stream
//
// Returns the lowest entry id any consumer group still needs (its oldest pending entry,
// or the entry after its last delivered one), or "" when there is no stream or no group:
// every entry below it has been acknowledged by every group.
var thresholdScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return '' end
local best_ms, best_seq
local function consider(ms, seq)
  if best_ms == nil or ms < best_ms or (ms == best_ms and seq < best_seq) then
    best_ms, best_seq = ms, seq
  end
end
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['pending'] > 0 then
    local summary = redis.call('XPENDING', KEYS[1], info['name'])
    local ms, seq = string.match(summary[2], '^(%d+)-(%d+)$')
    consider(tonumber(ms), tonumber(seq))
  else
    local ms, seq = string.match(info['last-delivered-id'], '^(%d+)-(%d+)$')
    consider(tonumber(ms), tonumber(seq) + 1)
  end
end
return string.format('%d-%d', best_ms, best_seq)
`)

// trimBatchScript releases the job indexes of a batch of acknowledged entries and trims
// them from the stream; each entry's success record moves from the successes hash into
// its job's index (field "done", when the index exists).
//
//	KEYS[1]    the stream
//	KEYS[2]    the successes hash (Keys.Successes)
//	KEYS[2+i]  the job index of the i-th entry
//	ARGV[1]    index TTL in milliseconds
//	ARGV[2]    the MINID to trim to (just above the batch's last entry)
//	ARGV[2+i]  the i-th entry id
//
// Returns the number of entries trimmed. An index gets the TTL only when its "entry" is
// the trimmed entry and the job has no copy in the scheduled set ("scheduled"): not when
// the job was enqueued again and a newer entry, or a delayed one, waits (its index must
// not expire while it does), and not when the job was dead-lettered (the
// dead-letter script removes "entry": the index must outlive the dead letter).
// Invariant: an index expires only after its job left the stream.
var trimBatchScript = redis.NewScript(`
for i = 3, #KEYS do
  local rec = redis.call('HGET', KEYS[2], ARGV[i])
  if rec then
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSET', KEYS[i], 'done', rec) end
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
  if redis.call('HGET', KEYS[i], 'entry') == ARGV[i] and redis.call('HEXISTS', KEYS[i], 'scheduled') == 0 then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
  end
end
return redis.call('XTRIM', KEYS[1], 'MINID', ARGV[2])
`)

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
	if err := sweepSuccesses(ctx, rdb, keys); err != nil {
		return 0, fmt.Errorf("trim %s: %w", keys.Stream(), err)
	}
	threshold, err := thresholdScript.Run(ctx, rdb, []string{keys.Stream()}).Text()
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
		n, err := trimBatchScript.Run(ctx, rdb, ks, args...).Int64()
		if err != nil {
			return total, fmt.Errorf("trim %s: %w", keys.Stream(), err)
		}
		total += n
		if len(msgs) < trimBatch {
			return total, nil
		}
	}
}

// sweepSuccessesScript deletes, from one HSCAN page of the successes hash, the records
// of entries no longer in the stream (older than its first entry, or any when it is
// empty): those the trim could not move, because the entry was acknowledged by a run
// that had lost its lease after another run's acknowledgement and the trim, or deleted
// by someone's XDEL. Without it they would stay: the hash has no TTL.
//
//	KEYS[1]  the stream
//	KEYS[2]  the successes hash
//	ARGV[1]  the HSCAN cursor
//
// Returns the next cursor ("0" when the scan is complete).
var sweepSuccessesScript = redis.NewScript(`
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local fms, fseq
if #first > 0 then fms, fseq = parse(first[1][1]) end
local r = redis.call('HSCAN', KEYS[2], ARGV[1], 'COUNT', 500)
local kv, del = r[2], {}
for i = 1, #kv, 2 do
  local ms, seq = parse(kv[i])
  if ms == nil or fms == nil or ms < fms or (ms == fms and seq < fseq) then del[#del + 1] = kv[i] end
end
if #del > 0 then redis.call('HDEL', KEYS[2], unpack(del)) end
return r[1]
`)

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

// deleteConsumersScript deletes the idle consumers of a group that hold nothing.
//
//	KEYS[1]  the stream
//	ARGV[1]  consumer group
//	ARGV[2]  consumer never to delete (the caller)
//	ARGV[3]  idle threshold in milliseconds
//
// Returns the names deleted. Invariant: XGROUP DELCONSUMER drops a consumer's pending
// entries from the PEL, losing them; the script deletes only consumers with 0 pending,
// checked in the same atomic step, so no pending entry is ever lost this way.
var deleteConsumersScript = redis.NewScript(`
local deleted = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if info['name'] ~= ARGV[2] and info['pending'] == 0 and info['idle'] > tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    deleted[#deleted + 1] = info['name']
  end
end
return deleted
`)

// DeleteIdleConsumers deletes the consumers of group that have no pending entries and
// have been idle longer than maxIdle, except keep (the caller's own name), and returns
// their names. A consumer with pending entries is never deleted. One round trip; safe
// for concurrent use.
func DeleteIdleConsumers(ctx context.Context, rdb redis.Scripter, keys Keys, group, keep string, maxIdle time.Duration) ([]string, error) {
	names, err := deleteConsumersScript.Run(ctx, rdb, []string{keys.Stream()}, group, keep, maxIdle.Milliseconds()).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("delete idle consumers of %s: %w", group, err)
	}
	return names, nil
}

// renewScript resets the idle time of entries the caller still owns, and records when
// their runs started.
//
//	KEYS[1]  the stream
//	KEYS[2]  the runs hash (Keys.Runs)
//	ARGV[1]  consumer group
//	ARGV[2]  consumer (the caller)
//	ARGV[3:] pairs of an entry id and the Unix millisecond time its run started
//
// Returns {ids owned by another consumer or no longer pending, ids deleted from the
// stream while pending}. XCLAIM with JUSTID and min-idle-time 0 resets the idle time
// without incrementing the delivery counter. Each owned entry's start is kept in the
// runs hash (HSETNX: the first renewal's), since renewals hide a long run's age from its
// idle time; the worker deletes it when it settles the entry. Invariant: only entries
// still pending to ARGV[2] are claimed; a plain XCLAIM would take back an entry another
// worker reclaimed after a pause of ours, and both would run it at once.
var renewScript = redis.NewScript(`
local owned, lost = {}, {}
for i = 3, #ARGV - 1, 2 do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    owned[#owned + 1] = ARGV[i]
    redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
local deleted = {}
if #owned > 0 then
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(owned) do args[#args + 1] = id end
  args[#args + 1] = 'JUSTID'
  local claimed = {}
  for _, id in ipairs(redis.call('XCLAIM', unpack(args))) do claimed[id] = true end
  for _, id in ipairs(owned) do
    if not claimed[id] then
      deleted[#deleted + 1] = id
      redis.call('HDEL', KEYS[2], id)
    end
  end
end
return {lost, deleted}
`)

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
