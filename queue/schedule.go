package queue

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scheduled set holds the jobs that run later: a retry after a failure, a snoozed
// job, a job handed back while a dependency is down, and a job enqueued to run at a
// time (EnqueueAt). It is two keys in the queue's hash slot:
//
//   - Keys.Scheduled, a sorted set: member "<job id> <token>" (token: the entry id it
//     came from, or a fresh one for EnqueueAt), score the Unix millisecond time it is
//     due;
//   - Keys.ScheduledData, a hash: member -> the entry's field/value list as a JSON array
//     of strings, encoded and decoded by Redis' cjson, so bytes go through unchanged.
//
// Every move is one script, so Redis applies it whole or not at all (also across a
// crash: AOF logs a script's effects as one MULTI/EXEC): an entry leaves the stream
// (XACK) in the same step it enters the set (scheduleScript), and leaves the set in the
// same step a new entry is added (moveScript). A process that dies between two scripts
// leaves the job in exactly one place: pending in the stream (reclaimed after
// ClaimIdle), or in the set (moved by any worker's mover). The crash tests in
// schedule_crash_test.go kill a process at each of these points.

// crashPoint, set by the crash tests only, is called at each step of a job's way
// between the stream and the scheduled set, with the step's name: "settle.before" and
// "settle.after" around scheduleScript, "move.read" between dueScript and moveScript,
// "move.after" after moveScript.
var crashPoint func(step string)

// reach calls crashPoint for step.
func reach(step string) {
	if crashPoint != nil {
		crashPoint(step)
	}
}

// Scheduled returns the key of the scheduled set: Prefix:{Queue}:scheduled.
func (k Keys) Scheduled() string { return k.base() + "scheduled" }

// ScheduledData returns the key of the scheduled jobs' entries: Prefix:{Queue}:scheduled:data.
func (k Keys) ScheduledData() string { return k.base() + "scheduled:data" }

// StateScheduled is the job index state of a job in the scheduled set: it runs at
// "run_at" (Unix milliseconds). The onceflow package reports it as queued, with the time.
const StateScheduled = "scheduled"

// jobIDCheckLua refuses, before any write, an enqueue of a job id whose index names
// another tenant; f is the index's HMGET of state, dead_id and tenant. Shared by
// EnqueueLua and EnqueueAtLua.
const jobIDCheckLua = `
if f[3] and f[3] ~= argv[1] then
  error({err = 'JOBIDTAKEN the job id ' .. keys[3] .. ' belongs to another tenant'})
end
if f[2] then
  local t = redis.call('TYPE', keys[2]).ok
  if t ~= 'stream' and t ~= 'none' then
    error({err = 'WRONGTYPE ' .. keys[2] .. ' holds a ' .. t .. ', not a stream'})
  end
end
`

// retireLua is what an enqueue does to the index of a job asked for again: the dead
// letter it points at is deleted and the failure's fields removed. (Its new entry has
// no attempts field: the job runs again with its whole budget.)
const retireLua = `
if f[2] then redis.call('XDEL', keys[2], f[2]) end
if f[1] == 'failed' or f[2] then redis.call('HDEL', keys[3], 'reason', 'dead_id', 'failed_at', 'last_error') end
`

// EnqueueAtLua is EnqueueLua for a job that runs at a time: the body of a Lua function
// of (keys, argv) with
//
//	keys[1]  the stream (Keys.Stream)
//	keys[2]  the dead-letter stream (Keys.Dead)
//	keys[3]  the job index (Keys.Job(job_id))
//	keys[4]  the scheduled set (Keys.Scheduled)
//	keys[5]  the scheduled entries (Keys.ScheduledData)
//	argv[1]  tenant
//	argv[2]  the Unix millisecond time it runs at
//	argv[3]  the set member ("<job id> <token>", see EnqueueAtArgs)
//	argv[4:] the entry's field/value list (Message.Values)
//
// It checks the job id as EnqueueLua does, adds the job to the scheduled set, and
// records in the index tenant, state=scheduled, run_at and the member (and no entry). A
// worker's mover adds it to the stream once it is due. It returns the member.
const EnqueueAtLua = `
local f = redis.call('HMGET', keys[3], 'state', 'dead_id', 'tenant')
` + jobIDCheckLua + `
redis.call('ZADD', keys[4], argv[2], argv[3])
redis.call('HSET', keys[5], argv[3], cjson.encode({unpack(argv, 4)}))
` + retireLua + `
redis.call('HSET', keys[3], 'tenant', argv[1], 'state', 'scheduled', 'run_at', argv[2], 'scheduled', argv[3])
redis.call('HDEL', keys[3], 'entry')
redis.call('PERSIST', keys[3])
return argv[3]
`

var enqueueAtScript = redis.NewScript("local function enqueue_at(keys, argv)\n" + EnqueueAtLua + "end\nreturn enqueue_at(KEYS, ARGV)\n")

// EnqueueAtKeys returns the keys EnqueueAtLua takes to enqueue jobID, in order.
func (k Keys) EnqueueAtKeys(jobID string) []string {
	return []string{k.Stream(), k.Dead(), k.Job(jobID), k.Scheduled(), k.ScheduledData()}
}

// EnqueueAtArgs returns the arguments EnqueueAtLua takes to enqueue m to run at at: its
// tenant, the time, a fresh set member, then its fields. A zero m.EnqueuedAt is set to
// the current time; an m that fails Validate gives an error wrapping ErrMalformed.
func EnqueueAtArgs(m Message, at time.Time) ([]any, error) {
	args, err := EnqueueArgs(m)
	if err != nil {
		return nil, err
	}
	if at.Before(time.UnixMilli(1)) || at.After(maxRunAt) {
		return nil, fmt.Errorf("enqueue job %q: %w: run at %s is not between 1970 and 9999", clip(m.JobID), ErrMalformed, at.UTC().Format(time.RFC3339))
	}
	member := m.JobID + " " + strconv.FormatInt(time.Now().UnixNano(), 36) + newToken()
	return append([]any{args[0], strconv.FormatInt(at.UnixMilli(), 10), member}, args[1:]...), nil
}

// maxRunAt is the latest time EnqueueAt takes.
var maxRunAt = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)

// EnqueueAt adds m to the queue to run at at (or as soon as a worker's mover sees it,
// when at is past), in one round trip (EnqueueAtLua): until then it waits in the
// scheduled set and its index says scheduled, with the time. at is read on this
// process's clock; workers compare it with Redis' clock. The rest is as Enqueue: the
// job id's tenant is checked (ErrJobIDTaken), a job whose index says failed runs
// again, nothing is written for a malformed m. It returns the set member. Safe for
// concurrent use. A time before 1970 or after 9999 is refused with an error wrapping
// ErrMalformed.
func EnqueueAt(ctx context.Context, rdb redis.Scripter, keys Keys, m Message, at time.Time) (string, error) {
	if err := keys.Validate(); err != nil {
		return "", err
	}
	args, err := EnqueueAtArgs(m, at)
	if err != nil {
		return "", err
	}
	member, err := enqueueAtScript.Run(ctx, rdb, keys.EnqueueAtKeys(m.JobID), args...).Text()
	if err != nil {
		return "", fmt.Errorf("enqueue job %s at %s: %w", m.JobID, at.UTC().Format(time.RFC3339Nano), EnqueueError(err))
	}
	return member, nil
}

// scheduleScript settles a pending entry whose run did not finish it: it is re-added to
// the stream (due now) or put in the scheduled set, with the attempts it spent added to
// its "attempts" field, and acknowledged, in one step.
//
//	KEYS[1]  the stream
//	KEYS[2]  the scheduled set
//	KEYS[3]  the scheduled entries
//	KEYS[4]  the job index
//	ARGV[1]  consumer group
//	ARGV[2]  consumer that must own the entry
//	ARGV[3]  entry id
//	ARGV[4]  attempts this settlement spends (runs that failed or never reported)
//	ARGV[5]  the budget: when the entry's attempts + ARGV[4] reach it, nothing is
//	         written and the reply is {'exhausted', n}; 0 for none
//	ARGV[6]  the failure's error for the index's last_error, "" for none
//	ARGV[7]  job id
//	ARGV[8]  explicit delay in milliseconds, or -1 to take it from ARGV[10:]
//	ARGV[9]  what the job waits for (a limiter's reason), kept in the index's "waiting"
//	         field while it is scheduled; "" for none
//	ARGV[10] the delivery's history event (historyRecord), appended to the index's
//	         history with "wait" (the delay, ms) when the settlement lands; "" for none
//	ARGV[11:] delays in milliseconds by the attempts spent before this settlement (the
//	         retry policy's full-jitter draws); past the end, the last
//
// Returns false when the entry is no longer pending to ARGV[2] (acknowledged, or
// reclaimed by another consumer whose run now decides); {'exhausted', n}; {'gone'} when
// the entry was deleted from the stream (it is acknowledged); else {id} with the new
// entry id, or {'scheduled', delay}. The job index follows the job (state queued and
// the new entry, or state scheduled with run_at and the member) when it pointed at this
// entry. Invariant: the job is in exactly one of the stream (this entry pending, or the
// new one) and the scheduled set after the script, whatever happens around it.
var scheduleScript = redis.NewScript(historyLua + `
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return false end
local e = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])
if #e == 0 then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  return {'gone'}
end
local fields = e[1][2]
local spent, at_pos = 0, nil
for i = 1, #fields - 1, 2 do
  if fields[i] == 'attempts' then spent, at_pos = tonumber(fields[i + 1]) or 0, i + 1 end
end
local add = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
if budget > 0 and spent + add >= budget then return {'exhausted', spent + add} end
if add > 0 then
  if at_pos then
    fields[at_pos] = tostring(spent + add)
  else
    fields[#fields + 1] = 'attempts'
    fields[#fields + 1] = tostring(spent + add)
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
local delay = tonumber(ARGV[8])
if delay < 0 then
  local i = 11 + spent
  if i > #ARGV then i = #ARGV end
  delay = tonumber(ARGV[i]) or 0
end
local current = redis.call('HGET', KEYS[4], 'entry') == ARGV[3]
local result
if delay <= 0 then
  local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
  if current then
    redis.call('HSET', KEYS[4], 'state', 'queued', 'entry', id)
    redis.call('HDEL', KEYS[4], 'waiting')
  end
  result = {id}
else
  local t = redis.call('TIME')
  local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + delay
  local member = ARGV[7] .. ' ' .. ARGV[3]
  redis.call('ZADD', KEYS[2], at, member)
  redis.call('HSET', KEYS[3], member, cjson.encode(fields))
  if current then
    redis.call('HSET', KEYS[4], 'state', 'scheduled', 'run_at', at, 'scheduled', member)
    if ARGV[9] ~= '' then
      redis.call('HSET', KEYS[4], 'waiting', ARGV[9])
      redis.call('HDEL', KEYS[4], 'entry')
    else
      redis.call('HDEL', KEYS[4], 'entry', 'waiting')
    end
    redis.call('PERSIST', KEYS[4])
  end
  result = {'scheduled', delay}
end
if ARGV[6] ~= '' and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('HSET', KEYS[4], 'last_error', ARGV[6]) end
if ARGV[10] ~= '' then
  local wait = 0
  if delay > 0 then wait = delay end
  history(KEYS[4], string.sub(ARGV[10], 1, -2) .. ',"wait":' .. wait .. '}')
end
return result
`)

// settlement is how a pending entry leaves its worker without finishing.
type settlement struct {
	// spend is the attempts the settlement spends.
	spend int64
	// budget is the attempts after which the job is dead-lettered instead; 0 for none.
	budget int64
	// lastError is the failure kept in the index, "" for none.
	lastError string
	// waiting is what a scheduled job waits for (a limiter's reason), kept in the index
	// while it is scheduled; "" for none.
	waiting string
	// delay is the wait before the next run; negative to draw it from delays by the
	// attempts already spent.
	delay  time.Duration
	delays []time.Duration
	// history is the delivery's history event (historyRecord); "" for none.
	history string
}

// settleResult is what scheduleScript did.
type settleResult struct {
	owned     bool          // false: the entry was not pending to the consumer
	exhausted bool          // the budget is spent; nothing was written
	attempts  int64         // with exhausted: the attempts spent
	gone      bool          // the entry had been deleted from the stream
	entry     string        // the new entry id when re-added at once
	delay     time.Duration // the wait when scheduled
}

// settle runs scheduleScript for the pending entry id of msg.
func settle(ctx context.Context, rdb redis.Scripter, keys Keys, group, consumer, id string, msg *Message, s settlement) (settleResult, error) {
	delay := int64(-1)
	if s.delay >= 0 {
		delay = s.delay.Milliseconds()
	}
	args := []any{group, consumer, id, s.spend, s.budget, s.lastError, msg.JobID, delay, clipTo(s.waiting, maxReasonLen), s.history}
	if len(s.delays) == 0 {
		args = append(args, 0)
	}
	for _, d := range s.delays {
		args = append(args, d.Milliseconds())
	}
	res, err := scheduleScript.Run(ctx, rdb, []string{keys.Stream(), keys.Scheduled(), keys.ScheduledData(), keys.Job(msg.JobID)}, args...).Slice()
	if errors.Is(err, redis.Nil) {
		return settleResult{}, nil
	}
	if err != nil {
		return settleResult{}, fmt.Errorf("settle entry %s: %w", id, err)
	}
	out := settleResult{owned: true}
	if len(res) == 0 {
		return out, fmt.Errorf("settle entry %s: empty reply", id)
	}
	head, _ := res[0].(string)
	switch head {
	case "exhausted":
		out.exhausted = true
		if len(res) > 1 {
			out.attempts, _ = res[1].(int64)
		}
	case "gone":
		out.gone = true
	case "scheduled":
		if len(res) > 1 {
			ms, _ := res[1].(int64)
			out.delay = time.Duration(ms) * time.Millisecond
		}
	default:
		out.entry = head
	}
	return out, nil
}

// dueScript lists the scheduled jobs that are due, by Redis' clock.
//
//	KEYS[1]  the scheduled set
//	ARGV[1]  the most members to return
//
// Returns {now ms, {members due}, score of the earliest member or false}.
var dueScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, ARGV[1])
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {now, due, first[2] or false}
`)

// moveScript moves due scheduled jobs to the stream.
//
//	KEYS[1]    the stream
//	KEYS[2]    the scheduled set
//	KEYS[3]    the scheduled entries
//	KEYS[4]    the dead-letter stream
//	KEYS[4+i]  the job index of the i-th member
//	ARGV[i]    the i-th member
//
// A member moves only when it is still in the set and due by Redis' clock now: its
// removal from the set, the XADD of its entry and the index update are one step, so two
// movers racing move it once, and a crash on either side of the script leaves it in
// exactly one place. When the index still points at this member (a later enqueue of the
// job may have replaced it), it says queued with the new entry, without a TTL; and, as
// for any enqueue of a job whose index records a failure (EnqueueLua), the dead letter
// it points at is retired, so the index never says queued while that dead letter
// exists. Returns how many moved.
var moveScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local moved = 0
for i = 1, #ARGV do
  local m = ARGV[i]
  local s = redis.call('ZSCORE', KEYS[2], m)
  if s and tonumber(s) <= now then
    local raw = redis.call('HGET', KEYS[3], m)
    redis.call('ZREM', KEYS[2], m)
    redis.call('HDEL', KEYS[3], m)
    if raw then
      local id = redis.call('XADD', KEYS[1], '*', unpack(cjson.decode(raw)))
      local ix = KEYS[4 + i]
      if redis.call('HGET', ix, 'scheduled') == m then
        local dead = redis.call('HGET', ix, 'dead_id')
        if dead then redis.call('XDEL', KEYS[4], dead) end
        redis.call('HDEL', ix, 'scheduled', 'run_at', 'reason', 'dead_id', 'failed_at', 'waiting')
        redis.call('HSET', ix, 'state', 'queued', 'entry', id)
        redis.call('PERSIST', ix)
      end
      moved = moved + 1
    end
  end
end
return moved
`)

// moveBatch bounds the members one MoveDue round moves.
const moveBatch = 256

// MoveDue moves the scheduled jobs of keys that are due to the stream, up to limit (at
// most moveBatch per round trip pair), and returns how many moved and how long until
// the earliest job still scheduled is due (-1 when none is). Workers run it on their
// own (WorkerConfig.ScheduleInterval); it is exported for tools and tests. Safe for
// concurrent use and to run from many processes: each job moves once.
func MoveDue(ctx context.Context, rdb redis.Scripter, keys Keys, limit int) (moved int, next time.Duration, err error) {
	if limit <= 0 {
		limit = moveBatch
	}
	for {
		n := min(limit-moved, moveBatch)
		res, err := dueScript.Run(ctx, rdb, []string{keys.Scheduled()}, n).Slice()
		if err != nil {
			return moved, -1, fmt.Errorf("read scheduled jobs: %w", err)
		}
		now, _ := res[0].(int64)
		raw, _ := res[1].([]any)
		next = -1
		if first, ok := res[2].(string); ok {
			if at, perr := strconv.ParseFloat(first, 64); perr == nil {
				next = max(time.Duration(int64(at)-now)*time.Millisecond, 0)
			}
		}
		if len(raw) == 0 {
			return moved, next, nil
		}
		ks := []string{keys.Stream(), keys.Scheduled(), keys.ScheduledData(), keys.Dead()}
		args := make([]any, 0, len(raw))
		for _, r := range raw {
			m, _ := r.(string)
			job, _, _ := strings.Cut(m, " ")
			ks = append(ks, keys.Job(job))
			args = append(args, m)
		}
		reach("move.read")
		k, err := moveScript.Run(ctx, rdb, ks, args...).Int()
		moved += k
		if err == nil {
			reach("move.after")
		}
		if err != nil {
			return moved, -1, fmt.Errorf("move scheduled jobs: %w", err)
		}
		if len(raw) < n || moved >= limit {
			if len(raw) == n {
				next = 0 // more are due
			}
			return moved, next, nil
		}
	}
}

// newToken returns 8 random hex digits.
func newToken() string {
	b := make([]byte, 4)
	_, _ = crand.Read(b)
	return hex.EncodeToString(b)
}

// ScheduledJob is one job in the scheduled set.
type ScheduledJob struct {
	// JobID is the job's id.
	JobID string `json:"job_id"`
	// Member is its member in the set.
	Member string `json:"member"`
	// RunAt is when it is due.
	RunAt time.Time `json:"run_at"`
}

// ListScheduled returns up to count scheduled jobs, earliest first. One round trip.
func ListScheduled(ctx context.Context, rdb redis.Cmdable, keys Keys, count int64) ([]ScheduledJob, error) {
	if count <= 0 {
		count = 100
	}
	zs, err := rdb.ZRangeWithScores(ctx, keys.Scheduled(), 0, count-1).Result()
	if err != nil {
		return nil, fmt.Errorf("list scheduled jobs: %w", err)
	}
	out := make([]ScheduledJob, 0, len(zs))
	for _, z := range zs {
		m, _ := z.Member.(string)
		job, _, _ := strings.Cut(m, " ")
		out = append(out, ScheduledJob{JobID: job, Member: m, RunAt: time.UnixMilli(int64(z.Score)).UTC()})
	}
	return out, nil
}
