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

	"github.com/onceflow/onceflow/internal/redisscript"
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

// enqueueAtScript runs enqueue_at(KEYS, ARGV) (lua/enqueue_at.lua).
var enqueueAtScript = enqueueAtFunc.Script()

// enqueueAtKeys returns the keys enqueue_at.lua takes to enqueue jobID, in order.
func (k Keys) enqueueAtKeys(jobID string) []string {
	return []string{k.Stream(), k.Dead(), k.Job(jobID), k.Scheduled(), k.ScheduledData()}
}

// enqueueAtArgs returns the arguments enqueue_at.lua takes to enqueue m to run at at:
// its tenant, the time, a fresh set member, then its fields. A zero m.EnqueuedAt is set
// to the current time; an m that fails Validate gives an error wrapping ErrMalformed.
func enqueueAtArgs(m Message, at time.Time) ([]any, error) {
	args, err := enqueueArgs(m)
	if err != nil {
		return nil, err
	}
	if at.Before(time.UnixMilli(1)) || at.After(maxRunAt) {
		return nil, fmt.Errorf("enqueue job %q: %w: run at %s is not between 1970 and 9999", clip(m.JobID), ErrMalformed, at.UTC().Format(time.RFC3339))
	}
	member := m.JobID + " " + strconv.FormatInt(time.Now().UnixNano(), 36) + newToken()
	return append([]any{args[0], strconv.FormatInt(at.UnixMilli(), 10), member}, args[1:]...), nil
}

// EnqueueAtStep is EnqueueStep for a job that runs at at: the queue's own enqueue at a
// time (the function EnqueueAt runs: the scheduled set, and the job index's rules) as a
// Step, for a script of another package to run in its own atomic step
// (redisstore.Store.AcceptStep). It validates as EnqueueAt does (a time before 1970 or
// after 9999 is refused with an error wrapping ErrMalformed).
func EnqueueAtStep(keys Keys, m Message, at time.Time) (redisscript.Step, error) {
	if err := keys.Validate(); err != nil {
		return redisscript.Step{}, err
	}
	args, err := enqueueAtArgs(m, at)
	if err != nil {
		return redisscript.Step{}, err
	}
	return enqueueAtFunc.Step(keys.enqueueAtKeys(m.JobID), args...)
}

// maxRunAt is the latest time EnqueueAt takes.
var maxRunAt = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)

// EnqueueAt adds m to the queue to run at at (or as soon as a worker's mover sees it,
// when at is past), in one round trip (lua/enqueue_at.lua): until then it waits in the
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
	args, err := enqueueAtArgs(m, at)
	if err != nil {
		return "", err
	}
	member, err := enqueueAtScript.Run(ctx, rdb, keys.enqueueAtKeys(m.JobID), args...).Text()
	if err != nil {
		return "", fmt.Errorf("enqueue job %s at %s: %w", m.JobID, at.UTC().Format(time.RFC3339Nano), EnqueueError(err))
	}
	return member, nil
}

// scheduleScript settles a pending entry whose run did not finish it: re-added to the
// stream or put in the scheduled set, and acknowledged, in one step (lua/schedule.lua).
var scheduleScript = scripts.MustScript("lua/schedule.lua", historyLib)

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

// dueScript lists the scheduled jobs that are due, by Redis' clock (lua/due.lua).
var dueScript = scripts.MustScript("lua/due.lua")

// readDue runs dueScript: up to n members of keys' scheduled set that are due, and how
// long until the earliest member is due (-1 when the set is empty).
func readDue(ctx context.Context, rdb redis.Scripter, keys Keys, n int) (members []string, next time.Duration, err error) {
	res, err := dueScript.Run(ctx, rdb, []string{keys.Scheduled()}, n).Slice()
	if err != nil {
		return nil, -1, fmt.Errorf("read scheduled jobs: %w", err)
	}
	now, _ := res[0].(int64)
	raw, _ := res[1].([]any)
	next = -1
	if first, ok := res[2].(string); ok {
		if at, perr := strconv.ParseFloat(first, 64); perr == nil {
			next = max(time.Duration(int64(at)-now)*time.Millisecond, 0)
		}
	}
	members = make([]string, 0, len(raw))
	for _, r := range raw {
		m, _ := r.(string)
		members = append(members, m)
	}
	return members, next, nil
}

// moveScript moves due scheduled jobs to the stream, each once (lua/move.lua).
var moveScript = scripts.MustScript("lua/move.lua")

// moveMembers runs moveScript for members of keys' scheduled set and returns how many
// moved.
func moveMembers(ctx context.Context, rdb redis.Scripter, keys Keys, members []string) (int, error) {
	ks := make([]string, 0, 4+len(members))
	ks = append(ks, keys.Stream(), keys.Scheduled(), keys.ScheduledData(), keys.Dead())
	args := make([]any, 0, len(members))
	for _, m := range members {
		job, _, _ := strings.Cut(m, " ")
		ks = append(ks, keys.Job(job))
		args = append(args, m)
	}
	n, err := moveScript.Run(ctx, rdb, ks, args...).Int()
	if err != nil {
		return n, fmt.Errorf("move scheduled jobs: %w", err)
	}
	return n, nil
}

// moveBatch bounds the members one MoveDue round moves.
const moveBatch = 256

// MoveDue moves the scheduled jobs of keys that are due to the stream, up to limit (at
// most moveBatch per round trip pair), and returns how many moved and how long until
// the earliest job still scheduled is due (-1 when none is). Workers run it on their
// own (WorkerConfig.ScheduleInterval); it is exported for tools and tests. Safe for
// concurrent use and to run from many processes: each job moves once.
func MoveDue(ctx context.Context, rdb redis.Scripter, keys Keys, limit int) (moved int, next time.Duration, err error) {
	if err := keys.Validate(); err != nil {
		return 0, -1, err
	}
	if limit <= 0 {
		limit = moveBatch
	}
	for {
		n := min(limit-moved, moveBatch)
		members, next, err := readDue(ctx, rdb, keys, n)
		if err != nil {
			return moved, -1, err
		}
		if len(members) == 0 {
			return moved, next, nil
		}
		reach("move.read")
		k, err := moveMembers(ctx, rdb, keys, members)
		moved += k
		if err != nil {
			return moved, -1, err
		}
		reach("move.after")
		if len(members) < n || moved >= limit {
			if len(members) == n {
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

// wakeScript runs lua/wake.lua.
var wakeScript = scripts.MustScript("lua/wake.lua")

// Wake makes tenant's job jobID, waiting in the scheduled set for something that has
// now happened (a signal, an approval), due at once; a job that is not waiting there
// (it runs right now, or is queued) gets a wake mark in its index instead, which the
// settlement that would put it in the set turns into "due now" (one script each, so a
// wake is never lost in between). A waiting job is then moved to the stream at once
// (move.lua, a second round trip), so a worker blocked on the stream takes it within
// milliseconds. It reports whether the job was waiting. A job without an index, or
// another tenant's, is ErrUnknownJob.
func Wake(ctx context.Context, rdb redis.Scripter, keys Keys, tenant, jobID string) (bool, error) {
	return WakeFor(ctx, rdb, keys, tenant, jobID, "")
}

// WakeFor is Wake for what the job may wait for: waiting is the wait's reason as the
// job's index records it (retry.WaitError.Reason: "signal payment"). A job waiting in
// the scheduled set for something else is left alone (WakeFor reports false); "" wakes
// whatever it waits for, as Wake does.
func WakeFor(ctx context.Context, rdb redis.Scripter, keys Keys, tenant, jobID, waiting string) (bool, error) {
	if err := keys.Validate(); err != nil {
		return false, err
	}
	if !ValidJobID(jobID) {
		return false, ErrUnknownJob
	}
	res, err := wakeScript.Run(ctx, rdb, []string{keys.Scheduled(), keys.Job(jobID)}, tenant, waiting).Result()
	if err != nil {
		return false, fmt.Errorf("wake job %s: %w", jobID, err)
	}
	member, due := res.(string)
	if !due {
		if n, _ := res.(int64); n == 0 {
			return false, ErrUnknownJob
		}
		return false, nil
	}
	// Due now: move it to the stream at once rather than at the next mover's poll (a
	// mover that gets there first moves it instead: each member moves once).
	if _, err := moveMembers(ctx, rdb, keys, []string{member}); err != nil {
		return true, fmt.Errorf("wake job %s: it is due now, and the movers will take it: %w", jobID, err)
	}
	return true, nil
}
