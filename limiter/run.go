package limiter

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Run keeps the process's view of the shared state fresh until ctx ends: it listens
// for pauses (Pub/Sub), reads every model's pause and learnt limits every
// SyncInterval (so a pause announced while it was not listening, or a Redis restart,
// is caught within one interval), reads Config.Budgets every BudgetRefresh, retries the
// settlements Redis refused, and writes the cost view. It returns nil when ctx ends.
// Acquire and Done work without it, on what the process learns by itself.
func (l *Limiter) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); l.listen(ctx) }()
	// The budgets have a loop of their own: a stalled store (a lock, a black-holed
	// socket) must not hold back the pauses, the settlements and the cost view.
	go func() { defer wg.Done(); l.budgetLoop(ctx) }()
	tick := time.NewTicker(l.cfg.SyncInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleWithin)
			l.flushUsage(fctx)
			l.retryPending()
			cancel()
			wg.Wait()
			return nil
		case <-tick.C:
			sctx, cancel := context.WithTimeout(ctx, settleWithin)
			l.sync(sctx)
			l.retryPending()
			l.flushUsage(sctx)
			cancel()
		}
	}
}

// budgetLoop reads Config.Budgets every BudgetRefresh until ctx ends; a failed read is
// retried soon (after 1s, doubling up to BudgetRefresh), not a whole BudgetRefresh
// later.
func (l *Limiter) budgetLoop(ctx context.Context) {
	if l.cfg.Budgets == nil {
		return
	}
	// Until the store answers, the copy in Redis: the store may be down or stalled.
	cctx, cancel := context.WithTimeout(ctx, settleWithin)
	if cp, err := l.readBudgetCopy(cctx); err == nil && cp != nil && l.budgets.Load() == nil {
		l.budgets.CompareAndSwap(nil, &cp)
	}
	cancel()
	first := min(time.Second, l.cfg.BudgetRefresh)
	retryIn := first
	for {
		d := l.cfg.BudgetRefresh
		if l.refreshBudgets(ctx) {
			retryIn = first
		} else {
			d = retryIn
			retryIn = min(2*retryIn, l.cfg.BudgetRefresh)
		}
		if sleep(ctx, d) != nil {
			return
		}
	}
}

// listen applies the pauses other processes announce, resubscribing after a failure.
func (l *Limiter) listen(ctx context.Context) {
	for ctx.Err() == nil {
		sub := l.rdb.Subscribe(ctx, l.keys.Events())
		ch := sub.Channel(redis.WithChannelHealthCheckInterval(10 * time.Second))
	read:
		for {
			select {
			case <-ctx.Done():
				break read
			case msg, ok := <-ch:
				if !ok {
					break read
				}
				l.onEvent(msg.Payload)
			}
		}
		_ = sub.Close()
		if err := sleep(ctx, l.cfg.SyncInterval); err != nil {
			return
		}
	}
}

// onEvent applies one announcement: "pause <until ms> <provider/model>", or "resume
// <provider/model>" (a probe's answer ended the model's recovery). Anything else is
// ignored.
func (l *Limiter) onEvent(payload string) {
	f := strings.Fields(payload)
	if len(f) == 2 && f[0] == "resume" && checkName("model", f[1]) == nil {
		l.mu.Lock()
		st := l.models[f[1]] // a model this process never used has no waiters
		l.mu.Unlock()
		if st != nil {
			st.resume()
		}
		return
	}
	if len(f) != 3 || f[0] != "pause" || checkName("model", f[2]) != nil {
		return
	}
	till, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil || till <= 0 {
		return
	}
	l.state(f[2]).setPause(till, "announced by another process")
}

// sync reads the pause and learnt limits of every model the process has used, in one
// round trip.
func (l *Limiter) sync(ctx context.Context) {
	l.mu.Lock()
	states := make([]*modelState, 0, len(l.models))
	for _, s := range l.models {
		states = append(states, s)
	}
	l.mu.Unlock()
	if len(states) == 0 {
		return
	}
	pipe := l.rdb.Pipeline()
	cmds := make([]*redis.SliceCmd, len(states))
	for i, s := range states {
		cmds[i] = pipe.HMGet(ctx, l.keys.Model(s.key), "pause", "why", "lrpm", "ltpm", "lts", "rec")
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		l.m.redisErrors.Inc()
		return
	}
	for i, s := range states {
		v := cmds[i].Val()
		if len(v) != 6 {
			continue
		}
		if v[5] != nil {
			s.recovering.Store(true) // another process paused it: calls go through Redis
		}
		if till := parseInt(v[0]); till > 0 {
			why, _ := v[1].(string)
			s.setPause(till, why)
			if till > time.Now().UnixMilli() {
				l.m.pausedUntil.WithLabelValues(s.key[strings.IndexByte(s.key, '/')+1:]).Set(float64(till) / 1000)
			}
		}
		if n := parseInt(v[2]); n > 0 {
			s.lrpm.Store(n)
		}
		if n := parseInt(v[3]); n > 0 {
			s.ltpm.Store(n)
		}
		if n := parseInt(v[4]); n > s.learntAt.Load() {
			s.learntAt.Store(n)
		}
	}
}

func parseInt(v any) int64 {
	s, _ := v.(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}

// refreshBudgets reads Config.Budgets and reports whether it could. On success it
// keeps a copy in Redis (Keys.Budgets) when they changed; on failure the last budgets
// stay, and a process that has none yet (it started while the store was down, or the
// read took longer than budgetReadWithin) takes
// the copy in Redis, so that tenants' own budgets hold through an outage of the store.
func (l *Limiter) refreshBudgets(ctx context.Context) bool {
	if l.cfg.Budgets == nil {
		return true
	}
	m, err := l.readBudgets(ctx)
	if ctx.Err() != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, settleWithin)
	defer cancel()
	if err != nil {
		if l.budgets.Load() == nil {
			if cp, cerr := l.readBudgetCopy(ctx); cerr == nil && cp != nil {
				l.budgets.Store(&cp)
				l.log.Warn("limiter: could not read the tenants' token budgets; using the copy in Redis", "err", err, "tenants", len(cp))
				return false
			}
		}
		l.log.Warn("limiter: could not read the tenants' token budgets; keeping the last ones", "err", err)
		return false
	}
	if old := l.budgets.Load(); old == nil || !maps.Equal(*old, m) || !l.copied {
		l.copied = l.writeBudgetCopy(ctx, m) == nil
	}
	l.budgets.Store(&m)
	return true
}

// readBudgets reads Config.Budgets under budgetReadWithin, in a goroutine of its own:
// a source that does not honour its context (a stalled socket, a user's own source)
// cannot hold Run past its context's end; its late answer is dropped.
func (l *Limiter) readBudgets(ctx context.Context) (map[string]int64, error) {
	type answer struct {
		m   map[string]int64
		err error
	}
	rctx, cancel := context.WithTimeout(ctx, budgetReadWithin)
	defer cancel()
	ch := make(chan answer, 1)
	go func() {
		m, err := l.cfg.Budgets.TokenBudgets(rctx)
		ch <- answer{m, err}
	}()
	select {
	case a := <-ch:
		return a.m, a.err
	case <-rctx.Done():
		return nil, fmt.Errorf("limiter: read the tenants' budgets: %w", rctx.Err())
	}
}

// writeBudgetCopy replaces the copy of the tenants' budgets in Redis, in one MULTI.
func (l *Limiter) writeBudgetCopy(ctx context.Context, m map[string]int64) error {
	key := l.keys.Budgets()
	_, err := l.rdb.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
		pipe.Del(ctx, key)
		if len(m) > 0 {
			vals := make([]any, 0, 2*len(m))
			for t, n := range m {
				vals = append(vals, t, n)
			}
			pipe.HSet(ctx, key, vals...)
		}
		return nil
	})
	if err != nil {
		l.m.redisErrors.Inc()
	}
	return err
}

// readBudgetCopy reads the copy of the tenants' budgets in Redis; nil when there is none.
func (l *Limiter) readBudgetCopy(ctx context.Context) (map[string]int64, error) {
	raw, err := l.rdb.HGetAll(ctx, l.keys.Budgets()).Result()
	if err != nil || len(raw) == 0 {
		return nil, err
	}
	m := make(map[string]int64, len(raw))
	for t, v := range raw {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			continue
		}
		m[t] = n
	}
	return m, nil
}

// SetBudgets replaces the tenants' own budgets at once (as a refresh of Config.Budgets
// does), for tests and tools.
func (l *Limiter) SetBudgets(m map[string]int64) {
	cp := make(map[string]int64, len(m))
	for k, v := range m {
		cp[k] = v
	}
	l.budgets.Store(&cp)
}

// retryPending retries the settlements Redis refused, oldest first, until one fails.
func (l *Limiter) retryPending() {
	l.pmu.Lock()
	pending := l.pending
	l.pending = nil
	l.pmu.Unlock()
	for i, s := range pending {
		if err := l.settle(s); err != nil {
			l.pmu.Lock()
			l.pending = append(pending[i:], l.pending...)
			l.pmu.Unlock()
			return
		}
	}
}

// flushUsage adds the calls settled since the last flush to the cost view (Keys.Usage),
// in one round trip (MULTI/EXEC); what fails to be written is kept for the next.
func (l *Limiter) flushUsage(ctx context.Context) {
	l.umu.Lock()
	if len(l.usage) == 0 {
		l.umu.Unlock()
		return
	}
	batch := l.usage
	l.usage = map[usageKey]*usageSum{}
	l.umu.Unlock()
	pipe := l.rdb.TxPipeline() // all of it or none: a failed flush is kept whole
	days := map[string]bool{}
	for k, u := range batch {
		key := l.keys.base() + "usage:" + k.day
		f := part(k.tenant) + "|" + part(k.model) + "|"
		if u.in > 0 {
			pipe.HIncrBy(ctx, key, f+"in", u.in)
		}
		if u.out > 0 {
			pipe.HIncrBy(ctx, key, f+"out", u.out)
		}
		pipe.HIncrBy(ctx, key, f+"calls", u.calls)
		days[key] = true
	}
	for key := range days {
		pipe.Expire(ctx, key, usageTTL)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		l.m.redisErrors.Inc()
		l.umu.Lock()
		for k, u := range batch {
			cur := l.usage[k]
			if cur == nil {
				l.usage[k] = u
				continue
			}
			cur.in += u.in
			cur.out += u.out
			cur.calls += u.calls
		}
		l.umu.Unlock()
	}
}
