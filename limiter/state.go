package limiter

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// ModelState is what the fleet's limiter holds for one model at one moment, as
// operators look at it (State).
type ModelState struct {
	// Model is the model's name (without the provider).
	Model string
	// Configured are its configured limits (Config.Models, else Config.Limits);
	// LearntRPM and LearntTPM what the provider's headers said, 0 when nothing.
	Configured           Limits
	LearntRPM, LearntTPM int
	// RequestsLeft and TokensLeft are what the buckets hold now (refilled to now), -1
	// when the bucket has no limit or was never used.
	RequestsLeft, TokensLeft int64
	// InFlight is the permits whose lease has not ended.
	InFlight int64
	// PausedUntil is when the fleet-wide pause ends (zero when not paused), Why its
	// reason.
	PausedUntil time.Time
	Why         string
}

// Models returns the names of the models the limiter knows of: those with limits of
// their own (Config.Models) and those this process has called, sorted.
func (l *Limiter) Models() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for name := range l.cfg.Models {
		out = append(out, name)
	}
	for mk := range l.models {
		if name, ok := strings.CutPrefix(mk, l.cfg.Provider+"/"); ok && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// State reads each model's state from Redis, in one pipelined round trip. Safe for
// concurrent use.
func (l *Limiter) State(ctx context.Context, models ...string) ([]ModelState, error) {
	now := time.Now()
	pipe := l.rdb.Pipeline()
	hashes := make([]*redis.SliceCmd, len(models))
	inflight := make([]*redis.IntCmd, len(models))
	for i, name := range models {
		mk := l.cfg.Provider + "/" + name
		hashes[i] = pipe.HMGet(ctx, l.keys.Model(mk), "rt", "rts", "tt", "tts", "pause", "why", "lrpm", "ltpm")
		inflight[i] = pipe.ZCount(ctx, l.keys.InFlight(mk), strconv.FormatInt(now.UnixMilli(), 10), "+inf")
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return nil, fmt.Errorf("limiter: read the models' state: %w", err)
	}
	out := make([]ModelState, 0, len(models))
	for i, name := range models {
		v, _ := hashes[i].Result()
		num := func(j int) float64 {
			if j >= len(v) {
				return 0
			}
			s, _ := v[j].(string)
			f, _ := strconv.ParseFloat(s, 64)
			return f
		}
		str := func(j int) string {
			if j >= len(v) {
				return ""
			}
			s, _ := v[j].(string)
			return s
		}
		st := ModelState{Model: name, Configured: l.limitsFor(name), LearntRPM: int(num(6)), LearntTPM: int(num(7)), RequestsLeft: -1, TokensLeft: -1}
		st.InFlight, _ = inflight[i].Result()
		rpm := float64(max(st.Configured.RPM, 0))
		if rpm == 0 {
			rpm = float64(st.LearntRPM)
		}
		tpm := float64(max(st.Configured.TPM, 0))
		if tpm == 0 {
			tpm = float64(st.LearntTPM)
		}
		// A bucket (left, updated at) refills continuously up to one minute's limit.
		refill := func(j int, perMin float64) int64 {
			if perMin <= 0 || str(j) == "" {
				return -1
			}
			return int64(min(perMin, num(j)+perMin*float64(now.UnixMilli()-int64(num(j+1)))/60000))
		}
		st.RequestsLeft, st.TokensLeft = refill(0, rpm), refill(2, tpm)
		if p := int64(num(4)); p > now.UnixMilli() {
			st.PausedUntil, st.Why = time.UnixMilli(p), str(5)
		}
		out = append(out, st)
	}
	return out, nil
}
