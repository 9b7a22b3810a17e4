package limiter

import (
	"context"
	"embed"
	"strconv"
	"time"

	"github.com/onceflow/onceflow/internal/redisscript"
)

// The limiter's state is in Redis, every key under Prefix:{limits}: one hash slot, so
// that each script below runs on one node (a Redis Cluster keeps the limiter on the
// node that owns the slot). Per model (provider/model):
//
//   - Keys.Model, a hash: the token buckets "rt" (requests left) and "tt" (tokens left)
//     with their update times "rts" and "tts" in Unix milliseconds, the fleet-wide pause
//     "pause" (Unix ms) and its reason "why", the learnt limits "lrpm" and "ltpm" (from
//     the provider's headers) and when they were last said "lts", the moving averages of a call's duration "dur" (ms) and
//     of its cost in tokens "avgtok", and after a pause "rec" (that pause's end, or
//     "first" at a first contact: the model is recovering until a probe answers),
//     "probe" (until when the probe out goes alone, Unix ms) and "seen" (when an
//     answer last settled through Redis, Unix ms);
//   - Keys.InFlight, a sorted set: the permits in flight, scored by when their lease
//     ends (a permit whose process died stops counting then);
//   - Keys.Lines, a hash: per tenant, "n:T" the next free place in its line (Unix ms),
//     "w:T" until when it counts as waiting, "u:T" its recent admissions as
//     "<count>|<ms>" (a count halving every HalfLife);
//   - Keys.Places, a sorted set: the calls (by their work key) that were given a place
//     in a line, scored by when the place lapses.
//
// Per tenant: Keys.TenantInFlight (its permits in flight, across models), and per UTC
// day Keys.Budget, a hash with "used" and "reserved" tokens, "p:<permit>" the tokens
// each live permit reserved and "x:<permit>" those of a permit whose lease ended before
// it settled (charged whole until it does), and Keys.Held, the live permits scored by
// their lease's end.
//
// A bucket holds at most one minute of its limit and refills continuously (so a limit
// of 600 requests per minute admits a burst of 600, then 10 a second), as the
// providers' own limiters do. Tokens are reserved at admission (the estimate: prompt
// plus the output that may come) and corrected at settlement from the answer's usage;
// the token bucket may go below zero when an answer used more than its estimate.
//
// The scripts that keep this state are the .lua files in lua/, each with a header naming
// its KEYS, ARGV, reply and the invariant it keeps (internal/redisscript), each run by
// one typed function below.

//go:embed lua/*.lua
var luaFiles embed.FS

// scripts is the limiter's script set.
var scripts = redisscript.NewSet(luaFiles)

// admitScript decides whether one call may go now, and reserves what it takes, in one
// atomic step (lua/admit.lua).
var admitScript = scripts.MustScript("lua/admit.lua")

// admitArgs are admitScript's arguments (see its ARGV), by name.
type admitArgs struct {
	permit, tenant, work      string
	lim                       Limits
	tenantConc                int
	need, budget              int64
	lease, halfLife, probeFor time.Duration
	dayEnd                    time.Time
	firstCost                 int
	free                      float64 // a background call's share of each limit left free; 0 otherwise
}

// runAdmit runs admitScript for a permit of model mk for a.tenant on day.
func (l *Limiter) runAdmit(ctx context.Context, mk string, day time.Time, a admitArgs) ([]any, error) {
	t := tenantKey(a.tenant)
	keys := []string{l.keys.Model(mk), l.keys.InFlight(mk), l.keys.Lines(mk), l.keys.Places(mk),
		l.keys.TenantInFlight(t), l.keys.Budget(t, day), l.keys.Held(t, day), l.keys.Released(a.permit)}
	return admitScript.Run(ctx, l.rdb, keys, a.permit, a.tenant, a.work, a.lim.RPM, a.lim.TPM, a.lim.Concurrency, a.tenantConc,
		a.need, a.budget, a.lease.Milliseconds(), a.dayEnd.UnixMilli(), int64(budgetTTL.Seconds()),
		a.halfLife.Milliseconds(), waitingMark.Milliseconds(), placeGrace.Milliseconds(), firstCallDur.Milliseconds(),
		a.firstCost, learnTTL.Milliseconds(), a.probeFor.Milliseconds(), strconv.FormatFloat(a.free, 'f', -1, 64)).Slice()
}

// settleScript ends a permit: its concurrency back, its tokens corrected, the provider's
// limits learnt, the tenant's budget charged (lua/settle.lua).
var settleScript = scripts.MustScript("lua/settle.lua")

// runSettle runs settleScript for s and returns its reply (rpm, tpm, learnt at).
func (l *Limiter) runSettle(ctx context.Context, s settlement) ([]int64, error) {
	t, a := tenantKey(s.tenant), s.args
	keys := []string{l.keys.Model(s.model), l.keys.InFlight(s.model), l.keys.TenantInFlight(t), l.keys.Budget(t, s.day),
		l.keys.Held(t, s.day), l.keys.Released(a.id)}
	return settleScript.Run(ctx, l.rdb, keys, a.id, boolArg(a.sent), a.tokens, a.cost, a.budgetRes,
		a.lim.RPM, a.lim.TPM, a.leftReq, a.leftTok, a.dur, a.lrpm, a.ltpm, learnTTL.Milliseconds(), a.probe, boolArg(a.answered),
		a.release.Milliseconds(), l.keys.Events(), s.model).Int64Slice()
}

// pauseScript pauses a model for the whole fleet and announces it; a pause only
// lengthens (lua/pause.lua).
var pauseScript = scripts.MustScript("lua/pause.lua")

// runPause runs pauseScript for model mk: paused for d, for why, a refusal when probe
// (one probe goes first after it). It returns the end of the pause in force, Unix ms.
func (l *Limiter) runPause(ctx context.Context, mk string, d time.Duration, why string, probe bool) (int64, error) {
	return pauseScript.Run(ctx, l.rdb, []string{l.keys.Model(mk)}, d.Milliseconds(), why, l.keys.Events(), mk, boolArg(probe)).Int64()
}
