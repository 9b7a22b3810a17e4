package limiter

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// Defaults of Config's fields.
const (
	DefaultProvider       = "llm"
	DefaultModel          = "default"
	DefaultMaxWait        = 2 * time.Second
	DefaultLease          = 2 * time.Minute
	DefaultHalfLife       = 10 * time.Second
	DefaultSyncInterval   = time.Second
	DefaultBudgetRefresh  = 30 * time.Second
	DefaultRateLimitPause = time.Second
	DefaultQuotaPause     = time.Minute
	DefaultMaxPause       = 10 * time.Minute
)

// Internal constants of the lines (see admitScript).
const (
	waitingMark      = 2 * time.Second          // a tenant counts as waiting this long after its place
	placeGrace       = 30 * time.Second         // a place is held this long after it is due
	firstCallDur     = time.Second              // a call's duration until one was measured
	budgetTTL        = 48 * time.Hour           // the budget keys outlive their day by a day
	usageTTL         = 8 * 24 * time.Hour       // the cost view keeps a week of days
	maxPending       = 10000                    // settlements kept for a retry while Redis is down
	settleWithin     = 5 * time.Second          // one settlement's own timeout
	budgetReadWithin = 5 * time.Second          // one read of Config.Budgets
	maxModelName     = 200                      // bytes
	budgetJitter     = int64(time.Minute)       // spread of the wake-up of budget waits at midnight
	waitJitter       = int64(time.Second)       // at most this is added to other waits (a tenth of them)
	dayLen           = 24 * time.Hour           // a budget's window
	maxWaitDelay     = 24*time.Hour + time.Hour // no wait is ever longer (a budget's day and its jitter)
	learnTTL         = 10 * time.Minute         // a learnt limit lapses unless the provider says it again
)

// Limits are the limits of one model across every process that shares the Redis. A
// zero field is no configured limit: the limiter then uses what the provider's headers
// taught it (requests and tokens per minute), or nothing.
type Limits struct {
	// RPM is requests per minute (ONCEFLOW_LLM_RPM).
	RPM int
	// TPM is tokens per minute, prompt and output (ONCEFLOW_LLM_TPM).
	TPM int
	// Concurrency is calls in flight (ONCEFLOW_LLM_CONCURRENCY).
	Concurrency int
}

// IsZero reports whether l configures nothing.
func (l Limits) IsZero() bool { return l == Limits{} }

// Price is what a model costs, in US dollars per million tokens.
type Price struct {
	Input, Output float64
	// BatchInput and BatchOutput are its prices through the provider's batch API (the
	// batch lane); zero is half of Input and Output, both providers' batch discount.
	BatchInput, BatchOutput float64
}

// Batch returns p's batch prices as a Price of their own.
func (p Price) Batch() Price {
	return Price{Input: cmp.Or(p.BatchInput, p.Input/2), Output: cmp.Or(p.BatchOutput, p.Output/2)}
}

// BatchSuffix marks a model's calls made through the provider's batch API in the cost
// view and the metrics: "gpt-4.1-mini (batch)" is gpt-4.1-mini at its batch price
// (BatchModel).
const BatchSuffix = " (batch)"

// BatchModel is model's name for its batch calls: model and BatchSuffix.
func BatchModel(model string) string { return model + BatchSuffix }

// BudgetSource gives the tenants' own token budgets (per UTC day), overriding
// Config.TenantTokenBudget: a tenant that it lists with 0 has no budget. The
// pgbudget package reads them from PostgreSQL (onceflow tenants set).
type BudgetSource interface {
	TokenBudgets(ctx context.Context) (map[string]int64, error)
}

// Config configures a Limiter. The zero value of every field but Prefix is usable.
type Config struct {
	// Prefix is the deployment's key prefix (ONCEFLOW_PREFIX). Required.
	Prefix string
	// Provider names the provider in the limiter's keys and metrics: the limits of
	// "openai/gpt-4.1" are not those of "azure/gpt-4.1". Default: "llm".
	Provider string
	// DefaultModel names the model of calls whose Request.Model is empty (the
	// adapter's own default). Default: "default".
	DefaultModel string
	// Limits apply to every model without an entry in Models (ONCEFLOW_LLM_RPM,
	// ONCEFLOW_LLM_TPM, ONCEFLOW_LLM_CONCURRENCY). Default: none.
	Limits Limits
	// Models are per-model limits (ONCEFLOW_LLM_LIMITS, see ParseModelLimits), by model
	// name as the requests give it.
	Models map[string]Limits
	// TenantConcurrency caps one tenant's calls in flight, across models
	// (ONCEFLOW_TENANT_CONCURRENCY). Default: 0, no cap beyond the fair share.
	TenantConcurrency int
	// TenantTokenBudget is every tenant's tokens per UTC day unless Budgets says
	// otherwise (ONCEFLOW_TENANT_TOKEN_BUDGET). Default: 0, unlimited.
	TenantTokenBudget int64
	// Budgets, when set, gives tenants' own budgets, read every BudgetRefresh by Run.
	Budgets BudgetSource
	// BudgetRefresh is how often Run reads Budgets. Default: 30s.
	BudgetRefresh time.Duration
	// MaxWait is how long Acquire waits in-process for capacity before it gives up with
	// a *retry.WaitError (a queued job then waits in its queue's scheduled set, holding
	// no worker). A wait of more than half of what remains of the caller's context
	// deadline (a per-call timeout) is not waited in-process either. Default: 2s.
	MaxWait time.Duration
	// Lease is how long a permit counts as in flight (and holds its budget
	// reservation) when its process dies before settling it. Default: 2m; keep it above
	// the longest model call.
	Lease time.Duration
	// HalfLife is how quickly a tenant's recent calls are forgotten when shares are
	// compared. Default: 10s.
	HalfLife time.Duration
	// SyncInterval is how often Run reads the shared pauses and learnt limits (a
	// Pub/Sub message usually brings a pause sooner) and writes the cost view.
	// Default: 1s.
	SyncInterval time.Duration
	// RateLimitPause is how long a 429 that says neither Retry-After nor a reset time
	// pauses its model, and, once a pause for a refusal (a 429, an exhausted quota)
	// ends, how long one probe call goes alone before another may go while none has
	// answered (the calls put off by the pause follow the first answer, announced to
	// every process, rather than all meeting the limit again). Default: 1s.
	RateLimitPause time.Duration
	// QuotaPause is how long an exhausted quota (a billing stop) without Retry-After
	// pauses its model. Default: 1m.
	QuotaPause time.Duration
	// MaxPause bounds every pause of a model, whatever the provider's Retry-After or
	// reset says (a provider answering a 429 with "Retry-After: 2592000" does not stop
	// the fleet for a month). Default: 10m.
	MaxPause time.Duration
	// Prices are the models' prices for the cost view and metrics, by model name;
	// DefaultPrices are used for models not in it.
	Prices map[string]Price
	// Logger receives the limiter's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer registers the limiter's metrics. Default: none.
	Registerer prometheus.Registerer
}

// Validate checks cfg's values: a prefix, no negative setting, sane model names.
func (cfg Config) Validate() error {
	if cfg.Prefix == "" || strings.ContainsAny(cfg.Prefix, "{} \t\r\n") {
		return fmt.Errorf("limiter: Config.Prefix %q must be non-empty, without braces or whitespace", cfg.Prefix)
	}
	if err := checkName("Config.Provider", cmp.Or(cfg.Provider, DefaultProvider)); err != nil {
		return err
	}
	if err := checkName("Config.DefaultModel", cmp.Or(cfg.DefaultModel, DefaultModel)); err != nil {
		return err
	}
	if err := cfg.Limits.check("Config.Limits"); err != nil {
		return err
	}
	for name, l := range cfg.Models {
		if err := checkName("Config.Models", name); err != nil {
			return err
		}
		if err := l.check("Config.Models[" + name + "]"); err != nil {
			return err
		}
	}
	for name, d := range map[string]time.Duration{"BudgetRefresh": cfg.BudgetRefresh, "MaxWait": cfg.MaxWait,
		"Lease": cfg.Lease, "HalfLife": cfg.HalfLife, "SyncInterval": cfg.SyncInterval,
		"RateLimitPause": cfg.RateLimitPause, "QuotaPause": cfg.QuotaPause, "MaxPause": cfg.MaxPause} {
		if d < 0 {
			return fmt.Errorf("limiter: Config.%s %v must not be negative", name, d)
		}
	}
	if cfg.TenantConcurrency < 0 || cfg.TenantTokenBudget < 0 {
		return errors.New("limiter: Config.TenantConcurrency and TenantTokenBudget must not be negative")
	}
	for name, p := range cfg.Prices {
		if p.Input < 0 || p.Output < 0 || p.Input != p.Input || p.Output != p.Output {
			return fmt.Errorf("limiter: Config.Prices[%s] must be non-negative numbers", name)
		}
	}
	return nil
}

func (l Limits) check(what string) error {
	if l.RPM < 0 || l.TPM < 0 || l.Concurrency < 0 {
		return fmt.Errorf("limiter: %s must not be negative", what)
	}
	return nil
}

// checkName accepts 1 to 200 printable ASCII bytes without spaces: model and provider
// names become parts of keys and of Pub/Sub messages.
func checkName(what, v string) error {
	if v == "" || len(v) > maxModelName {
		return fmt.Errorf("limiter: %s %q must be 1 to %d bytes", what, clip(v), maxModelName)
	}
	for i := 0; i < len(v); i++ {
		if v[i] <= ' ' || v[i] > '~' {
			return fmt.Errorf("limiter: %s %q must be printable ASCII without spaces", what, clip(v))
		}
	}
	return nil
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// Limiter is the admission control of model calls: fleet-wide limits per model
// (requests and tokens per minute, calls in flight), pauses after a 429 seen by every
// process, fair shares between tenants, and tenants' daily token budgets. Its state
// is in Redis and every decision is one atomic script (scripts.go); see
// docs/limits.md. Wrap puts it in front of an llm.Client. A Limiter is safe for
// concurrent use; Run keeps its shared state fresh.
type Limiter struct {
	rdb  redis.UniversalClient
	cfg  Config
	keys Keys
	log  *slog.Logger
	m    *limiterMetrics

	mu     sync.Mutex
	models map[string]*modelState // by "provider/model"

	budgets atomic.Pointer[map[string]int64]
	copied  bool // the budgets last read are copied to Redis (Run's goroutine only)

	pmu     sync.Mutex
	pending []settlement // settlements that failed (Redis down), retried by Run

	umu   sync.Mutex
	usage map[usageKey]*usageSum // the cost view, written by Run
}

// modelState is what this process knows of a model's shared state.
type modelState struct {
	key        string // provider/model
	maxPause   time.Duration
	pauseUntil atomic.Int64
	pauseWhy   atomic.Pointer[string]
	pauses     atomic.Uint64 // how many times setPause set or lengthened the pause
	lrpm, ltpm atomic.Int64  // learnt limits
	recovering atomic.Bool   // new, or a pause was set: calls go through Redis until one admission finds no recovery
	wmu        sync.Mutex
	wake       chan struct{} // closed when a probe's answer ends the recovery (resume)
	learntAt   atomic.Int64  // when the provider last said them, Unix ms
}

// learnt returns the model's learnt limits, or zeros once the provider has not said
// them for learnTTL (a limit a proxy or a bad answer taught does not stick).
func (s *modelState) learnt(now time.Time) (rpm, tpm int64) {
	if now.UnixMilli()-s.learntAt.Load() >= learnTTL.Milliseconds() {
		return 0, 0
	}
	return s.lrpm.Load(), s.ltpm.Load()
}

func (s *modelState) pausedFor(now time.Time) (time.Duration, string) {
	until := s.pauseUntil.Load()
	if until == 0 || until <= now.UnixMilli() {
		return 0, ""
	}
	why := ""
	if p := s.pauseWhy.Load(); p != nil {
		why = *p
	}
	return time.UnixMilli(until).Sub(now), why
}

// waitResume waits for d, or until a probe's answer ends the model's recovery, or ctx
// ends.
func (s *modelState) waitResume(ctx context.Context, d time.Duration) error {
	s.wmu.Lock()
	if s.wake == nil {
		s.wake = make(chan struct{})
	}
	ch := s.wake
	s.wmu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-ch:
	case <-t.C:
	}
	return nil
}

// resume wakes the calls waiting for a probe's answer.
func (s *modelState) resume() {
	s.wmu.Lock()
	if s.wake != nil {
		close(s.wake)
		s.wake = nil
	}
	s.wmu.Unlock()
}

// setPause pauses the model until (Unix ms), at most maxPause from now whatever another
// process or Redis says, unless it is paused longer already.
func (s *modelState) setPause(until int64, why string) {
	if s.maxPause > 0 {
		until = min(until, time.Now().Add(s.maxPause).UnixMilli())
	}
	for {
		cur := s.pauseUntil.Load()
		if until <= cur {
			return
		}
		if s.pauseUntil.CompareAndSwap(cur, until) {
			s.pauseWhy.Store(&why)
			s.recovering.Store(true)
			s.pauses.Add(1)
			return
		}
	}
}

type usageKey struct {
	day           string
	tenant, model string
}

type usageSum struct {
	in, out, calls int64
}

// New returns a Limiter on rdb. cfg is validated (Config.Validate).
func New(rdb redis.UniversalClient, cfg Config) (*Limiter, error) {
	if rdb == nil {
		return nil, errors.New("limiter: nil Redis client")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Provider = cmp.Or(cfg.Provider, DefaultProvider)
	cfg.DefaultModel = cmp.Or(cfg.DefaultModel, DefaultModel)
	cfg.BudgetRefresh = cmp.Or(cfg.BudgetRefresh, DefaultBudgetRefresh)
	cfg.MaxWait = cmp.Or(cfg.MaxWait, DefaultMaxWait)
	cfg.Lease = cmp.Or(cfg.Lease, DefaultLease)
	cfg.HalfLife = cmp.Or(cfg.HalfLife, DefaultHalfLife)
	cfg.SyncInterval = cmp.Or(cfg.SyncInterval, DefaultSyncInterval)
	cfg.RateLimitPause = cmp.Or(cfg.RateLimitPause, DefaultRateLimitPause)
	cfg.QuotaPause = cmp.Or(cfg.QuotaPause, DefaultQuotaPause)
	cfg.MaxPause = cmp.Or(cfg.MaxPause, DefaultMaxPause)
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	l := &Limiter{rdb: rdb, cfg: cfg, keys: Keys{Prefix: cfg.Prefix}, log: log, models: map[string]*modelState{},
		usage: map[usageKey]*usageSum{}}
	l.m = newMetrics(cfg.Registerer, cfg.DefaultModel)
	return l, nil
}

// Keys returns the limiter's key names.
func (l *Limiter) Keys() Keys { return l.keys }

// Provider returns Config.Provider (its default applied).
func (l *Limiter) Provider() string { return l.cfg.Provider }

// state returns the process's state of model key mk.
func (l *Limiter) state(mk string) *modelState {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.models[mk]
	if s == nil {
		s = &modelState{key: mk, maxPause: l.cfg.MaxPause}
		// The first call to a model admits through Redis: a process that just started
		// has not read the fleet's pause or recovery yet.
		s.recovering.Store(true)
		l.models[mk] = s
	}
	return s
}

// limitsFor returns the configured limits of model name.
func (l *Limiter) limitsFor(name string) Limits {
	if lim, ok := l.cfg.Models[name]; ok {
		return lim
	}
	return l.cfg.Limits
}

// budgetFor returns tenant's tokens per day (0: none).
func (l *Limiter) budgetFor(tenant string) int64 {
	if tenant == "" {
		return 0
	}
	if m := l.budgets.Load(); m != nil {
		if b, ok := (*m)[tenant]; ok {
			return b
		}
	}
	return l.cfg.TenantTokenBudget
}

// Call describes a model call that asks for admission.
type Call struct {
	// Model is the model's name; "" is Config.DefaultModel.
	Model string
	// Tenant is who the call is for: its budget, its share and its concurrency cap. ""
	// is nobody's: no budget, no cap, one share.
	Tenant string
	// Work is the call's stable identity (the ledger's work key: the same for every
	// delivery of a job's step), so that a call put off with a place in its tenant's
	// line keeps the place when it comes back; "" for none (a place is then kept only
	// while Acquire waits in-process).
	Work string
	// InputTokens is the prompt's estimate (llm.EstimateInputTokens); OutputTokens the
	// output it may produce (Request.MaxTokens, or llm.DefaultOutputTokens).
	InputTokens, OutputTokens int
	// Background makes the call take only capacity nobody else needs (a shadow run):
	// it waits while another tenant waits for capacity, and while it would leave less
	// than BackgroundHeadroom of a shared limit (requests, tokens per minute, calls in
	// flight) free. It takes no place in a line.
	Background bool
}

// BackgroundHeadroom is the share of each shared limit a background call leaves free
// (Call.Background).
const BackgroundHeadroom = 0.25

// CallFor returns the Call of req for tenant: its model, work key and token estimates.
func CallFor(tenant string, req *llm.Request) Call {
	c := Call{Tenant: tenant}
	if req == nil {
		return c
	}
	out := req.MaxTokens
	if out <= 0 {
		out = llm.DefaultOutputTokens
	}
	c.Model, c.Work, c.InputTokens, c.OutputTokens = req.Model, req.IdempotencyKey, llm.EstimateInputTokens(req), out
	return c
}

// ErrTooLarge is matched by Acquire's permanent error for a call that needs more tokens
// than its model's tokens per minute or its tenant's daily budget: waiting cannot
// admit it.
var ErrTooLarge = errors.New("limiter: the call needs more tokens than a limit allows")

// Acquire admits c, waiting in-process for at most Config.MaxWait, and returns its
// Permit, which the caller must end with Done once the call is over (or was never
// made). When the capacity c needs is not free within that wait it returns a
// *retry.WaitError saying how long to wait and why (a rate limit, the model's pause,
// the tenant's budget or share), having reserved c's place in its tenant's line; a
// call that can never be admitted gets a permanent error matching ErrTooLarge; Redis
// failing gives an error matching retry.ErrUnavailable; ctx ending, ctx's error. The
// in-process wait is kept out of the delivery's budget (retry.ExtendDeadline). With no
// limit configured or learnt, no budget and no tenant cap, Acquire makes no round trip
// but for a process's first call to a model and the calls after a pause until one is
// admitted with no recovery in force: it only honours the model's pause. Safe for
// concurrent use.
func (l *Limiter) Acquire(ctx context.Context, c Call) (*Permit, error) {
	name := cmp.Or(c.Model, l.cfg.DefaultModel)
	if err := checkName("model", name); err != nil {
		return nil, retry.Permanent(err)
	}
	mk := l.cfg.Provider + "/" + name
	st := l.state(mk)
	lim := l.limitsFor(name)
	need := int64(max(c.InputTokens, 0)) + int64(max(c.OutputTokens, 0))
	// Only a configured limit makes a call too large: a learnt one may be a window the
	// estimate does not fit (an input-token limit, a proxy's), and it lapses; under it
	// the call waits for a full bucket (admitScript caps what it takes at the limit).
	if tpm := int64(lim.TPM); tpm > 0 && need > tpm {
		return nil, retry.Permanent(fmt.Errorf("%w: the call to %s needs %d tokens (estimate), its tokens per minute are %d", ErrTooLarge, mk, need, tpm))
	}
	budget := l.budgetFor(c.Tenant)
	if budget > 0 && need > budget {
		return nil, retry.Permanent(fmt.Errorf("%w: the call needs %d tokens (estimate), tenant %s has %d a day", ErrTooLarge, need, c.Tenant, budget))
	}
	p := &Permit{l: l, st: st, model: mk, name: name, tenant: c.Tenant, need: need, lim: lim, start: time.Now()}
	p.id = newID()
	work := c.Work
	if work == "" {
		work = "acquire:" + p.id // keeps the place across this Acquire's own waits
	}
	var waited time.Duration
	defer func() {
		retry.ExtendDeadline(ctx, waited)
	}()
	for {
		// Taken before the admission's checks: a pause set while they run counts as
		// set after it (Permit.pausedSinceAdmission).
		p.pauseGen = st.pauses.Load()
		now := time.Now()
		if d, why := st.pausedFor(now); d > 0 {
			if l.mayWait(ctx, waited, d) {
				if err := sleep(ctx, d); err != nil {
					return nil, err
				}
				waited += d
				continue
			}
			return nil, l.putOff(mk, c.Tenant, d, "paused", why, 0)
		}
		lrpm, ltpm := st.learnt(now)
		shared := !lim.IsZero() || lrpm > 0 || ltpm > 0 || budget > 0 || l.cfg.TenantConcurrency > 0 || st.recovering.Load()
		if !shared {
			l.m.admitted(name, waited)
			return p, nil
		}
		day := now.UTC().Truncate(dayLen)
		res, err := l.runAdmit(ctx, mk, day, admitArgs{permit: p.id, tenant: c.Tenant, work: work, lim: lim,
			tenantConc: tenantCap(c.Tenant, l.cfg.TenantConcurrency), need: need, budget: budget, lease: l.cfg.Lease,
			dayEnd: day.Add(dayLen), halfLife: l.cfg.HalfLife, firstCost: max(c.InputTokens, 1), probeFor: l.cfg.RateLimitPause,
			free: backgroundFree(c.Background)})
		if err != nil {
			if replyLost(err) {
				// Redis may have run the admission and its reply is lost: Run ends the
				// permit as a call that never left (a no-op if it was never admitted),
				// so its reservation is not charged when its lease ends.
				var bres int64
				if budget > 0 {
					bres = need
				}
				l.keep(l.settlementOf(mk, c.Tenant, day, settleArgs{id: p.id, sent: true, budgetRes: bres, lim: lim,
					leftReq: -1, leftTok: -1, dur: -1, release: l.cfg.Lease}))
			}
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			l.m.redisErrors.Inc()
			return nil, retry.Unavailable(fmt.Errorf("limiter: admit a call to %s: %w", mk, err))
		}
		if ok, _ := res[0].(int64); ok == 1 {
			p.viaRedis = true
			p.day = day
			if budget > 0 {
				p.budgetRes = need
			}
			p.tokens = int64At(res, 1)
			if p.probe = stringAt(res, 2); p.probe == "" {
				st.recovering.Store(false) // no pause to recover from
			}
			l.m.admitted(name, waited)
			return p, nil
		}
		delay := time.Duration(int64At(res, 1)) * time.Millisecond
		reason, detail := stringAt(res, 2), stringAt(res, 3)
		if reason == "paused" {
			delay = min(delay, l.cfg.MaxPause) // a pause another process set with a larger MaxPause
			st.setPause(time.Now().Add(delay).UnixMilli(), detail)
		}
		if reason == "recovering" && l.mayWait(ctx, waited, delay) {
			// A probe is out: wait for its answer (announced) or the probe's window,
			// then ask again, without pausing the model locally.
			t0 := time.Now()
			if err := st.waitResume(ctx, delay); err != nil {
				return nil, err
			}
			waited += time.Since(t0)
			continue
		}
		if reason != "budget" && reason != "recovering" && l.mayWait(ctx, waited, delay) {
			if err := sleep(ctx, delay); err != nil {
				return nil, err
			}
			waited += delay
			continue
		}
		var spent int64
		if reason == "budget" || reason == "budget reserved" {
			spent, _ = strconv.ParseInt(detail, 10, 64)
		}
		return nil, l.putOff(mk, c.Tenant, delay, reason, detail, spent)
	}
}

// answered reports whether r is an answer of the provider that shows it takes calls
// again after a pause: anything but a 429, an exhausted quota or no answer at all.
func answered(r Result) bool {
	if !r.Sent {
		return false
	}
	if r.Err == nil {
		return true
	}
	var api *llm.APIError
	if !errors.As(r.Err, &api) || api.StatusCode == http.StatusTooManyRequests {
		return false
	}
	return retry.Classify(r.Err).Class != retry.ClassQuota
}

// mayWait reports whether Acquire may wait d more in-process, having waited already:
// within MaxWait, and leaving the call at least half of what remains of ctx's deadline
// (a per-call timeout), so that a wait never turns into the call's timeout, which would
// count as a failure of the provider: a longer wait is put off (a WaitError) instead.
func (l *Limiter) mayWait(ctx context.Context, waited, d time.Duration) bool {
	if waited+d > l.cfg.MaxWait {
		return false
	}
	if dl, ok := ctx.Deadline(); ok && d > time.Until(dl)/2 {
		return false
	}
	return true
}

// replyLost reports whether err may have come after Redis received the command: a
// timeout or an ended context, not a refused connection.
func replyLost(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// whyQuota starts the reason of a pause for an exhausted quota (followed by the
// provider's answer), as every process reads it from Redis.
const whyQuota = "the provider's quota is exhausted"

// ErrQuotaPaused is matched (errors.Is) by the *retry.WaitError of a call put off
// because its model is paused for an exhausted quota or billing stop, whichever
// process met it: a caller with a circuit breaker for the provider can open it for the
// wait (the onceflow Client does, so /readyz and its metrics show the stop).
var ErrQuotaPaused = errors.New("limiter: paused for an exhausted quota")

// putOff counts a call put off and returns its *retry.WaitError, with a jitter that
// spreads the wake-ups of calls put off together.
func (l *Limiter) putOff(mk, tenant string, delay time.Duration, reason, detail string, spent int64) error {
	name := mk[strings.IndexByte(mk, '/')+1:]
	l.m.deferred.WithLabelValues(name, reason).Inc()
	var text string
	var cause error
	switch reason {
	case "paused":
		text = "model " + mk + " is paused"
		if detail != "" {
			text += ": " + detail
		}
		if strings.HasPrefix(detail, whyQuota) {
			cause = ErrQuotaPaused
		}
		delay += jitter(delay/10, waitJitter)
	case "budget":
		l.m.budgetWaits.WithLabelValues(tenantLabel(tenant)).Inc()
		text = fmt.Sprintf("token budget of tenant %s is spent for today (%d tokens used or reserved); waiting for the next UTC day", tenant, spent)
		delay += jitter(time.Duration(budgetJitter), budgetJitter)
	case "recovering":
		text = "model " + mk + " is waiting for a probe's answer (the first call after a pause, or at first contact)"
		delay += jitter(delay, waitJitter)
	case "budget reserved":
		text = fmt.Sprintf("token budget of tenant %s is held by its calls in flight (%d tokens used or reserved today)", tenant, spent)
		delay += jitter(delay, waitJitter)
	case "tenant concurrency":
		text = fmt.Sprintf("tenant %s has %d calls in flight (ONCEFLOW_TENANT_CONCURRENCY)", tenant, l.cfg.TenantConcurrency)
		delay += jitter(delay, waitJitter)
	default:
		text = "model " + mk + ": " + reason
	}
	return &retry.WaitError{Delay: min(max(delay, time.Millisecond), maxWaitDelay), Reason: text, Err: cause}
}

// jitter returns a random duration in [0, min(d, cap)].
func jitter(d time.Duration, capNs int64) time.Duration {
	n := min(int64(d), capNs)
	if n <= 0 {
		return 0
	}
	return time.Duration(rand.Int64N(n + 1)) // #nosec G404 -- spreading wake-ups, not a secret
}

// sleep waits for d or until ctx ends (retry's clock).
func sleep(ctx context.Context, d time.Duration) error { return retry.SystemClock{}.Sleep(ctx, d) }

// NoTenant stands for the calls of no tenant in the limiter's keys and cost view; no
// tenant can be named so (tenants are A-Z a-z 0-9 . _ -).
const NoTenant = "(none)"

// backgroundFree is admitScript's ARGV[20] for a call: BackgroundHeadroom for a
// background one, else 0.
func backgroundFree(background bool) float64 {
	if background {
		return BackgroundHeadroom
	}
	return 0
}

// tenantKey is tenant's name in keys.
func tenantKey(tenant string) string { return cmp.Or(tenant, NoTenant) }

func tenantCap(tenant string, n int) int {
	if tenant == "" {
		return 0
	}
	return n
}

func int64At(res []any, i int) int64 {
	if i < len(res) {
		if v, ok := res[i].(int64); ok {
			return v
		}
	}
	return 0
}

func stringAt(res []any, i int) string {
	if i < len(res) {
		if v, ok := res[i].(string); ok {
			return v
		}
	}
	return ""
}

func newID() string {
	var b [12]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Permit is an admitted call. End it with Done, once, when the call is over.
type Permit struct {
	l      *Limiter
	st     *modelState // the model's state in this process (Acquire's permits)
	id     string
	model  string // provider/model
	name   string
	tenant string
	need   int64 // the estimate: prompt plus output
	lim    Limits
	start  time.Time

	viaRedis  bool      // admitted by admitScript: settled by settleScript
	tokens    int64     // tokens taken from the model's token bucket
	budgetRes int64     // tokens reserved from the tenant's budget
	probe     string    // the pause this call probes, "" none (admitScript)
	pauseGen  uint64    // the model's pause count (modelState.pauses) at admission
	day       time.Time // the budget's day

	obs    atomic.Pointer[Result] // what the inner observer saw (WrapAround)
	paused atomic.Int64           // the pause the answer set, once set (observed or Done)
	done   atomic.Bool
}

// pausedSinceAdmission returns the wait (a *retry.WaitError, as Acquire's) of a call
// whose model this process has seen paused since the call was admitted (another
// call's answer here, or a pause another process announced): for what is left of the
// pause, or, when it has ended and the model is recovering, for a probe's window
// (RateLimitPause), since the call must go back through Acquire and its one-probe rule
// rather than join the probe. Nil when no pause was set since, or p is nil.
func (p *Permit) pausedSinceAdmission() error {
	if p == nil || p.st == nil {
		return nil
	}
	st := p.st
	if st.pauses.Load() == p.pauseGen {
		return nil
	}
	if d, why := st.pausedFor(time.Now()); d > 0 {
		return p.l.putOff(p.model, p.tenant, d, "paused", why, 0)
	}
	if !st.recovering.Load() {
		return nil // a pause with no probe after it (a window the answers said was empty) has ended
	}
	return p.l.putOff(p.model, p.tenant, p.l.cfg.RateLimitPause, "recovering", "", 0)
}

// observed records what the observer below a layer saw of the call, and pauses the
// model at once when the answer calls for it: the layer (the ledger) may take a
// PostgreSQL commit to hand the answer up, and every process should stop calling as
// soon as possible.
func (p *Permit) observed(r Result) {
	p.obs.Store(&r)
	p.pauseOnce(r)
}

// pauseOnce pauses the model for r's answer (pauseFor), the first time it is asked.
func (p *Permit) pauseOnce(r Result) time.Duration {
	if d := p.paused.Load(); d != 0 {
		return max(time.Duration(d), 0)
	}
	pause, why := p.pauseFor(r)
	pause = min(pause, p.l.cfg.MaxPause)
	refused := r.Err != nil && !answered(r) && r.Sent // a 429 or an exhausted quota
	if !p.paused.CompareAndSwap(0, int64(cmp.Or(pause, -1))) {
		return max(time.Duration(p.paused.Load()), 0)
	}
	if pause > 0 {
		p.l.pause(p.model, pause, why, refused)
	}
	return pause
}

// Model returns the permit's model, as "provider/name".
func (p *Permit) Model() string { return p.model }

// Result is what became of a permit's call, for Done.
type Result struct {
	// Sent reports that the request left for the provider (it counts against the
	// requests per minute); false for a call that was never made.
	Sent bool
	// Usage is the answer's usage, when an answer arrived and said it.
	Usage *llm.Usage
	// Ambiguous reports a call that was sent and whose answer was lost (a timeout, a
	// dropped connection): the provider may have billed it, so it is charged as
	// reserved.
	Ambiguous bool
	// RateLimit is what the answer's headers said of the provider's limits.
	RateLimit *llm.RateLimit
	// Err is the call's error, if any: a 429 pauses the model, an exhausted quota too.
	Err error
}

// cost is what r's call is charged in tokens: its usage when it arrived; the estimate
// when the answer is lost (Ambiguous) or came without usage; nothing when the call
// was not sent or the provider answered an error.
func (p *Permit) cost(r Result) int64 {
	switch {
	case !r.Sent:
		return 0
	case r.Usage != nil && r.Usage.InputTokens+r.Usage.OutputTokens > 0:
		return int64(r.Usage.InputTokens) + int64(r.Usage.OutputTokens)
	case r.Ambiguous:
		return p.need
	case r.Err != nil:
		return 0
	}
	return p.need
}

// Done ends the permit with r: it gives back the call's concurrency, corrects its
// reservation to its cost (see Result), learns the provider's limits from the
// answer's headers, and, when the answer was a 429 or an exhausted quota, pauses the
// model for the whole fleet (one round trip, and a Pub/Sub message every process
// reads at once). It returns the pause it set (0: none). It runs under a timeout of its
// own, so a cancelled call is still settled; when Redis cannot be reached the
// settlement is kept and retried by Run. A second Done does nothing. Safe for
// concurrent use.
func (p *Permit) Done(r Result) time.Duration {
	if p == nil || !p.done.CompareAndSwap(false, true) {
		return 0
	}
	l := p.l
	cost := p.cost(r)
	l.account(p, r, cost)
	st := l.state(p.model)
	var lrpm, ltpm int64
	leftReq, leftTok := int64(-1), int64(-1)
	if rl := r.RateLimit; rl != nil {
		lrpm = rl.Requests.Limit
		ltpm = cmp.Or(rl.Tokens.Limit, rl.InputTokens.Limit)
		if rl.Requests.HasRemaining {
			leftReq = rl.Requests.Remaining
		}
		if rl.Tokens.HasRemaining {
			leftTok = rl.Tokens.Remaining
		} else if rl.InputTokens.HasRemaining {
			leftTok = rl.InputTokens.Remaining
		}
	}
	oldRPM, oldTPM := st.learnt(time.Now())
	learnt := (lrpm > 0 && lrpm != oldRPM) || (ltpm > 0 && ltpm != oldTPM)
	if lrpm > 0 {
		st.lrpm.Store(lrpm)
	}
	if ltpm > 0 {
		st.ltpm.Store(ltpm)
	}
	if lrpm > 0 || ltpm > 0 {
		st.learntAt.Store(time.Now().UnixMilli())
	}
	pause := p.pauseOnce(r)
	if !p.viaRedis && !learnt {
		return pause
	}
	dur := int64(-1)
	if r.Sent {
		dur = time.Since(p.start).Milliseconds()
	}
	s := l.settlementOf(p.model, p.tenant, p.day, settleArgs{id: p.id, sent: r.Sent, tokens: p.tokens, cost: cost, budgetRes: p.budgetRes,
		lim: p.lim, leftReq: leftReq, leftTok: leftTok, dur: dur, lrpm: lrpm, ltpm: ltpm, probe: p.probe, answered: answered(r)})
	if err := l.settle(s); err != nil {
		l.keep(s)
		l.log.Warn("limiter: could not settle a model call; retrying in the background", "model", p.model, "err", err)
	}
	return pause
}

// pauseFor returns how long r's answer pauses the model, and why: a 429 until its
// Retry-After (or the reset of the exhausted window, or RateLimitPause), an exhausted
// quota until its Retry-After (or QuotaPause), and an answer saying that no request
// or token is left until its reset.
func (p *Permit) pauseFor(r Result) (time.Duration, string) {
	cfg := &p.l.cfg
	if r.Err != nil {
		v := retry.Classify(r.Err)
		var api *llm.APIError
		status := 0
		if errors.As(r.Err, &api) {
			status = api.StatusCode
		}
		switch {
		case v.Class == retry.ClassQuota:
			return cmp.Or(positive(v.RetryAfter, v.HasRetryAfter), cfg.QuotaPause), whyQuota + ": " + clip(r.Err.Error())
		case status == http.StatusTooManyRequests:
			p.l.m.rateLimited.WithLabelValues(p.name).Inc()
			d := positive(v.RetryAfter, v.HasRetryAfter)
			if d == 0 && r.RateLimit != nil {
				d = exhaustedReset(r.RateLimit)
			}
			return cmp.Or(d, cfg.RateLimitPause), "the provider answered 429"
		}
	}
	if r.RateLimit != nil {
		if d := exhaustedReset(r.RateLimit); d > 0 {
			return d, "the provider says no capacity is left until its reset"
		}
	}
	return 0, ""
}

func positive(d time.Duration, ok bool) time.Duration {
	if ok && d > 0 {
		return d
	}
	return 0
}

// exhaustedReset returns how long a window with nothing remaining stays empty, the
// longest of them: the providers' resets say when the window is whole again, so a
// window of known size gives back its first unit after reset/limit (60s/600 = 100ms),
// and one of unknown size is paused until its reset.
func exhaustedReset(rl *llm.RateLimit) time.Duration {
	var d time.Duration
	for _, w := range []llm.RateWindow{rl.Requests, rl.Tokens, rl.InputTokens, rl.OutputTokens} {
		if !w.HasRemaining || w.Remaining != 0 || !w.HasReset {
			continue
		}
		if w.Limit > 0 {
			d = max(d, w.Reset/time.Duration(w.Limit))
		} else {
			d = max(d, w.Reset)
		}
	}
	return d
}

func boolArg(b bool) int {
	if b {
		return 1
	}
	return 0
}

// pause pauses model mk for d (at most MaxPause), locally at once and for the fleet
// through Redis. After a pause for a refusal (a 429, an exhausted quota) one probe goes
// first (see pauseScript); after a window the answers said was empty, whose reset is
// known, everyone goes.
func (l *Limiter) pause(mk string, d time.Duration, why string, probe bool) {
	d = min(d, l.cfg.MaxPause)
	st := l.state(mk)
	st.setPause(time.Now().Add(d).UnixMilli(), why)
	name := mk[strings.IndexByte(mk, '/')+1:]
	l.m.pauses.WithLabelValues(name).Inc()
	ctx, cancel := context.WithTimeout(context.Background(), settleWithin)
	defer cancel()
	till, err := l.runPause(ctx, mk, d, why, probe)
	if err != nil {
		l.m.redisErrors.Inc()
		l.log.Warn("limiter: could not share a pause of a model; other processes will meet it on their own", "model", mk, "err", err)
		return
	}
	st.setPause(till, why)
	l.m.pausedUntil.WithLabelValues(name).Set(float64(till) / 1000)
	l.log.Info("limiter: model paused for every process", "model", mk, "for", d, "why", why)
}

// settleArgs are settleScript's arguments (see its ARGV), by name.
type settleArgs struct {
	id               string
	sent, answered   bool
	tokens, cost     int64 // taken from the token bucket; what the call cost
	budgetRes        int64
	lim              Limits
	leftReq, leftTok int64 // what the provider says remains, -1 unsaid
	dur              int64 // ms, -1 when not sent
	lrpm, ltpm       int64 // limits the provider says, 0 unsaid
	probe            string
	release          time.Duration // > 0: the release of an admission whose reply was lost
}

// settlementOf builds the settleScript call of a permit of model for tenant on day.
func (l *Limiter) settlementOf(model, tenant string, day time.Time, a settleArgs) settlement {
	return settlement{model: model, tenant: tenant, day: day, args: a}
}

// settlement is one settleScript call, kept for a retry when Redis fails.
type settlement struct {
	model, tenant string
	day           time.Time
	args          settleArgs
}

func (l *Limiter) settle(s settlement) error {
	ctx, cancel := context.WithTimeout(context.Background(), settleWithin)
	defer cancel()
	res, err := l.runSettle(ctx, s)
	if err != nil {
		l.m.redisErrors.Inc()
		return err
	}
	if len(res) == 3 && res[2] > 0 {
		st := l.state(s.model)
		lim := l.limitsFor(s.model[strings.IndexByte(s.model, '/')+1:])
		if res[0] > 0 && lim.RPM == 0 {
			st.lrpm.Store(res[0])
		}
		if res[1] > 0 && lim.TPM == 0 {
			st.ltpm.Store(res[1])
		}
		st.learntAt.Store(max(st.learntAt.Load(), res[2]))
	}
	return nil
}

func (l *Limiter) keep(s settlement) {
	l.pmu.Lock()
	defer l.pmu.Unlock()
	if len(l.pending) >= maxPending {
		l.m.settlementsDropped.Inc()
		return // its permit's lease ends it: its concurrency comes back, its budget reservation is charged
	}
	l.pending = append(l.pending, s)
}

// account adds a settled call to the metrics and the cost view.
func (l *Limiter) account(p *Permit, r Result, cost int64) {
	tl := tenantLabel(p.tenant)
	l.m.tokens.WithLabelValues(tl, p.name, "reserved").Add(float64(p.need))
	if cost > 0 {
		l.m.tokens.WithLabelValues(tl, p.name, "used").Add(float64(cost))
	}
	if r.Sent && r.Ambiguous {
		l.m.tokens.WithLabelValues(tl, p.name, "wasted").Add(float64(cost))
	}
	in, out := int64(0), int64(0)
	switch {
	case r.Usage != nil && r.Usage.InputTokens+r.Usage.OutputTokens > 0:
		in, out = int64(r.Usage.InputTokens), int64(r.Usage.OutputTokens)
	case cost > 0:
		in = cost // charged without a breakdown: priced as input
	}
	if in+out > 0 {
		price := l.priceOf(p.name)
		l.m.cost.WithLabelValues(tl, p.name).Add((float64(in)*price.Input + float64(out)*price.Output) / 1e6)
	}
	if !r.Sent {
		return
	}
	k := usageKey{day: time.Now().UTC().Format("2006-01-02"), tenant: tenantKey(p.tenant), model: p.name}
	l.umu.Lock()
	u := l.usage[k]
	if u == nil {
		u = &usageSum{}
		l.usage[k] = u
	}
	u.in += in
	u.out += out
	u.calls++
	l.umu.Unlock()
}

// priceOf returns model name's price: Config.Prices, then DefaultPrices, else zero;
// a BatchModel name's is its model's batch price.
func (l *Limiter) priceOf(name string) Price {
	if base, ok := strings.CutSuffix(name, BatchSuffix); ok {
		return l.priceOf(base).Batch()
	}
	if p, ok := l.cfg.Prices[name]; ok {
		return p
	}
	return DefaultPrices[name]
}

// AccountBatch adds a call of model made through the provider's batch API, which used
// u, to the cost view and the metrics of tenant, as model's BatchModel at its batch
// price. Batch calls take no permit: they are not counted against the requests and
// tokens per minute, the concurrency or the tenant's budget. Run writes the cost view.
func (l *Limiter) AccountBatch(tenant, model string, u llm.Usage) {
	if l == nil {
		return
	}
	name := BatchModel(model)
	p := &Permit{l: l, model: name, name: name, tenant: tenant}
	l.account(p, Result{Sent: true, Usage: &u}, int64(u.InputTokens)+int64(u.OutputTokens))
}

func tenantLabel(tenant string) string { return cmp.Or(tenant, "none") }
