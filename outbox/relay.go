package outbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/retry"
)

// Defaults of Config.
const (
	DefaultBatchSize       = 100
	DefaultConcurrency     = 16
	DefaultPollInterval    = 250 * time.Millisecond
	DefaultLease           = 30 * time.Second
	DefaultMaxAttempts     = 10
	DefaultBackoffBase     = time.Second
	DefaultBackoffCap      = 15 * time.Minute
	DefaultMaxRetryAfter   = time.Hour
	DefaultRetention       = 7 * 24 * time.Hour
	DefaultPurgeInterval   = time.Minute
	DefaultPurgeBatch      = 1000
	DefaultSampleInterval  = 15 * time.Second
	DefaultShutdownTimeout = 30 * time.Second
	// maxErrorLen bounds the last_error text stored per row.
	maxErrorLen = 1000
	// settleTimeout bounds recording a batch's outcome, retries included.
	settleTimeout = 10 * time.Second
)

// Config configures a Relay. The zero value of every field means its default.
type Config struct {
	// Name identifies this relay in claimed_by; it must be unique among running relays
	// (two relays with one name could mark each other's rows). Default: DefaultName().
	Name string
	// BatchSize is the number of rows claimed at once. Default: 100.
	BatchSize int
	// Concurrency is the number of sends in flight within a batch. Default: 16.
	Concurrency int
	// PollInterval is the wait between claims when the last batch was not full.
	// Default: 250ms (ONCEFLOW_RELAY_INTERVAL).
	PollInterval time.Duration
	// Lease is how long a claimed batch stays claimed. The batch's sends must end
	// before it (they are cancelled at Lease minus a margin of a fifth of it, at most
	// 5s), or another relay could claim and send the same rows. Default: 30s
	// (ONCEFLOW_RELAY_LEASE).
	Lease time.Duration
	// MaxAttempts is the number of failed sends after which a row is exhausted. Sends
	// that failed with an error marked Unavailable (a dependency is down) are not
	// counted and never exhaust a row. Default: 10 (ONCEFLOW_RELAY_MAX_ATTEMPTS).
	MaxAttempts int
	// BackoffBase and BackoffCap shape the full-jitter delay after a failed send: a
	// random duration up to min(BackoffCap, BackoffBase * 2^(failures-1)); after a
	// failure marked Unavailable, a random duration up to the outage's age so far (since
	// this relay's sends of the topic first met it), at least BackoffBase and at most
	// BackoffCap. Default: 1s and 15m.
	BackoffBase, BackoffCap time.Duration
	// MaxRetryAfter caps a delay the provider asked for (an error implementing
	// RetryAfter() time.Duration), which replaces the backoff. Default: 1h.
	MaxRetryAfter time.Duration
	// Retention is how long sent rows are kept before they are purged.
	// Default: 7 days (ONCEFLOW_OUTBOX_RETENTION).
	Retention time.Duration
	// PurgeInterval is the time between purges; PurgeBatch the rows one delete
	// statement removes. Default: 1m and 1000.
	PurgeInterval time.Duration
	PurgeBatch    int
	// SampleInterval is the time between samples of the oldest unsent row's age, when
	// the Store implements OldestUnsentStore. Default: 15s.
	SampleInterval time.Duration
	// ShutdownTimeout is how long sends in flight may run after Run's context is
	// cancelled; sends still running then are abandoned and their rows released.
	// Default: 30s (ONCEFLOW_SHUTDOWN_TIMEOUT).
	ShutdownTimeout time.Duration
	// Logger receives the relay's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer receives the relay's metrics. Default: nil, metrics not exported.
	Registerer prometheus.Registerer
}

// DefaultName returns a relay name unique to this process and call:
// hostname-pid-random.
func DefaultName() string {
	host, _ := os.Hostname()
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s-%d-%s", cmp.Or(host, "relay"), os.Getpid(), hex.EncodeToString(b))
}

// withDefaults returns c with every zero field set to its default, or an error naming
// the first invalid field.
func (c Config) withDefaults() (Config, error) {
	c.Name = cmp.Or(c.Name, DefaultName())
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.Lease = cmp.Or(c.Lease, DefaultLease)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.BackoffBase = cmp.Or(c.BackoffBase, DefaultBackoffBase)
	c.BackoffCap = cmp.Or(c.BackoffCap, DefaultBackoffCap)
	c.MaxRetryAfter = cmp.Or(c.MaxRetryAfter, DefaultMaxRetryAfter)
	c.Retention = cmp.Or(c.Retention, DefaultRetention)
	c.PurgeInterval = cmp.Or(c.PurgeInterval, DefaultPurgeInterval)
	c.PurgeBatch = cmp.Or(c.PurgeBatch, DefaultPurgeBatch)
	c.SampleInterval = cmp.Or(c.SampleInterval, DefaultSampleInterval)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"BatchSize", int64(c.BatchSize)}, {"Concurrency", int64(c.Concurrency)},
		{"PollInterval", int64(c.PollInterval)}, {"Lease", int64(c.Lease)},
		{"MaxAttempts", int64(c.MaxAttempts)}, {"BackoffBase", int64(c.BackoffBase)},
		{"BackoffCap", int64(c.BackoffCap)}, {"MaxRetryAfter", int64(c.MaxRetryAfter)},
		{"Retention", int64(c.Retention)}, {"PurgeInterval", int64(c.PurgeInterval)},
		{"PurgeBatch", int64(c.PurgeBatch)}, {"SampleInterval", int64(c.SampleInterval)},
		{"ShutdownTimeout", int64(c.ShutdownTimeout)},
	} {
		if f.v < 0 {
			return c, fmt.Errorf("outbox relay config: %s must not be negative", f.name)
		}
	}
	if c.BackoffCap < c.BackoffBase {
		return c, errors.New("outbox relay config: BackoffCap must not be below BackoffBase")
	}
	return c, nil
}

// leaseMargin is the part of the lease kept free for recording the outcome.
func (c Config) leaseMargin() time.Duration { return min(c.Lease/5, 5*time.Second) }

// Relay drains an outbox: it claims due rows under a lease, sends them with a Sender and
// records the outcome, batch by batch. Run several relays, in one process or many, for
// throughput and availability; they never send the same row at once.
//
// A send's error decides the row's fate: Permanent exhausts it at once; Unavailable (a
// dependency is down) retries it after a backoff that grows with the outage, counting no
// attempt, so an outage never exhausts a row; any other error counts an attempt and
// retries it, until MaxAttempts.
//
// A Relay is safe for concurrent use, but Run and Pass are meant to be called by one
// goroutine at a time: the relay's name is its fencing token.
type Relay struct {
	store  Store
	sender Sender
	cfg    Config
	log    *slog.Logger
	m      *relayMetrics
	// claim is store.Claim, or store.ClaimTopics of the sender's topics.
	claim   func(ctx context.Context, relay string, limit int, lease time.Duration) ([]Message, error)
	outages outages
}

// NewRelay returns a relay that drains store with sender. When sender is a TopicSender
// (a *Router) that does not send every topic, the relay claims only the rows of its
// topics, and store must be a TopicStore. It returns an error when cfg holds a negative
// or inconsistent value, or store cannot claim by topic when it has to.
func NewRelay(store Store, sender Sender, cfg Config) (*Relay, error) {
	if store == nil || sender == nil {
		return nil, errors.New("outbox relay: store and sender are required")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Relay{
		store: store, sender: sender, cfg: cfg, claim: store.Claim,
		log: cfg.Logger.With("relay", cfg.Name),
	}
	if ts, ok := sender.(TopicSender); ok {
		if topics := ts.Topics(); !topics.All() {
			tstore, ok := store.(TopicStore)
			if !ok {
				return nil, fmt.Errorf("outbox relay: the sender sends only some topics, and the store (%T) cannot claim by topic (TopicStore)", store)
			}
			r.claim = func(ctx context.Context, relay string, limit int, lease time.Duration) ([]Message, error) {
				return tstore.ClaimTopics(ctx, relay, topics, limit, lease)
			}
		}
	}
	r.m = newRelayMetrics(cfg.Registerer)
	return r, nil
}

// Name returns the relay's name, as stored in claimed_by.
func (r *Relay) Name() string { return r.cfg.Name }

// Run drains the outbox until ctx is cancelled: it claims a batch, sends it, records the
// outcome, and claims again at once when the batch was full or after PollInterval when
// it was not. Every PurgeInterval it deletes sent rows older than Retention, in batches.
// Database errors are logged and retried after a growing pause (up to 5s), never
// returned: a relay outlives a database restart.
//
// When ctx is cancelled Run stops claiming, lets the sends in flight finish within
// ShutdownTimeout, records what was sent, releases what was claimed but not sent, and
// returns nil.
func (r *Relay) Run(ctx context.Context) error {
	r.log.InfoContext(ctx, "outbox relay started", "batch_size", r.cfg.BatchSize,
		"concurrency", r.cfg.Concurrency, "lease", r.cfg.Lease, "poll_interval", r.cfg.PollInterval,
		"max_attempts", r.cfg.MaxAttempts)
	var nextPurge, nextSample time.Time
	failures := 0
	for ctx.Err() == nil {
		now := time.Now()
		if !now.Before(nextSample) {
			r.sample(ctx)
			nextSample = now.Add(r.cfg.SampleInterval)
		}
		if !now.Before(nextPurge) {
			if _, err := r.Purge(ctx); err != nil && ctx.Err() == nil {
				r.log.WarnContext(ctx, "outbox purge failed", "err", err)
			}
			nextPurge = now.Add(r.cfg.PurgeInterval)
		}
		res, err := r.Pass(ctx)
		wait := r.cfg.PollInterval
		switch {
		case err != nil && ctx.Err() != nil:
			wait = 0
		case err != nil:
			failures++
			wait = min(r.cfg.PollInterval<<min(failures, 10), 5*time.Second)
			r.log.WarnContext(ctx, "outbox relay pass failed", "err", err, "retry_in", wait)
		case res.Claimed >= r.cfg.BatchSize:
			failures, wait = 0, 0
		default:
			failures = 0
		}
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
	}
	r.log.InfoContext(ctx, "outbox relay stopped")
	return nil
}

// PassResult counts what one Pass did with the rows it claimed.
type PassResult struct {
	Claimed   int
	Sent      int // marked sent
	Retrying  int // failed, due again after a backoff (an outage's failures included)
	Exhausted int // failed for good: permanent error or MaxAttempts reached
	Released  int // claimed but not sent (shutdown), lease cleared
	Fenced    int // outcome not recorded: the lease ran out and another relay claimed the row
}

// errShutdown is the cause of cancelling sends that outlived ShutdownTimeout.
var errShutdown = errors.New("relay shutting down")

// Pass claims one batch, sends it and records the outcome: one claim statement and one
// settle statement, whatever the batch size. It returns an error when the claim or the
// settle failed; rows whose outcome could not be recorded stay claimed until their lease
// ends and are then sent again, with the same dedupe key. If ctx is cancelled during
// the sends, no further send starts and the ones in flight get ShutdownTimeout.
func (r *Relay) Pass(ctx context.Context) (PassResult, error) {
	if err := ctx.Err(); err != nil {
		return PassResult{}, err
	}
	claimedAt := time.Now()
	msgs, err := r.claim(ctx, r.cfg.Name, r.cfg.BatchSize, r.cfg.Lease)
	if err != nil {
		return PassResult{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	res := PassResult{Claimed: len(msgs)}
	if len(msgs) == 0 {
		return res, nil
	}
	r.m.batches.Inc()
	s := r.sendAll(ctx, msgs, claimedAt.Add(r.cfg.Lease-r.cfg.leaseMargin()))

	// Recording the outcome must happen even when ctx was cancelled meanwhile.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	var settled Settled
	for try := 1; ; try++ {
		settled, err = r.store.Settle(sctx, r.cfg.Name, s)
		if err == nil || try == 3 || sctx.Err() != nil {
			break
		}
		select {
		case <-sctx.Done():
		case <-time.After(time.Duration(try) * 200 * time.Millisecond):
		}
	}
	if err != nil {
		r.log.ErrorContext(ctx, "outbox settle failed: these rows stay claimed until their lease ends, then are sent again with the same dedupe key",
			"err", err, "sent", len(s.Sent), "failed", len(s.Failed), "released", len(s.Released))
		return res, fmt.Errorf("settle outbox batch: %w", err)
	}
	res.Sent, res.Retrying = len(settled.Sent), len(settled.Retrying)
	res.Exhausted, res.Released = len(settled.Exhausted), len(settled.Released)
	res.Fenced = len(msgs) - settled.Len()
	r.m.sent.Add(float64(res.Sent))
	r.m.exhausted.Add(float64(res.Exhausted))
	r.m.released.Add(float64(res.Released))
	if res.Fenced > 0 {
		r.m.fenced.Add(float64(res.Fenced))
		r.log.WarnContext(ctx, "outbox marks fenced: the lease ran out and another relay claimed these rows; they may be sent twice, with the same dedupe key",
			"ids", fenced(msgs, settled), "lease", r.cfg.Lease)
	}
	for _, id := range settled.Exhausted {
		attrs := []any{"id", id}
		if i := slices.IndexFunc(msgs, func(m Message) bool { return m.ID == id }); i >= 0 {
			attrs = logAttrs(msgs[i])
		}
		r.log.WarnContext(ctx, "outbox row exhausted: it waits for `onceflow outbox retry`", attrs...)
	}
	return res, nil
}

// outcome of one send.
type outcome int

const (
	outcomeReleased outcome = iota // not sent: never started or abandoned at shutdown
	outcomeSent
	outcomeFailed
)

// sendAll sends msgs with up to Concurrency sends at once and returns the settlement.
// Sends are cancelled at deadline (the lease's end less a margin); once ctx is
// cancelled no send starts and those in flight get ShutdownTimeout.
func (r *Relay) sendAll(ctx context.Context, msgs []Message, deadline time.Time) Settlement {
	base, cancelSends := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancelSends(nil)
	sendCtx, cancelDeadline := context.WithDeadline(base, deadline)
	defer cancelDeadline()
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-done:
			return
		case <-ctx.Done():
		}
		t := time.NewTimer(r.cfg.ShutdownTimeout)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			cancelSends(errShutdown)
		}
	}()

	outcomes := make([]outcome, len(msgs))
	failures := make([]Failure, len(msgs))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(r.cfg.Concurrency, len(msgs)) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(msgs) {
					return
				}
				if ctx.Err() != nil || sendCtx.Err() != nil {
					continue // outcomeReleased: not started
				}
				outcomes[i], failures[i] = r.sendOne(sendCtx, msgs[i])
			}
		})
	}
	wg.Wait()
	var s Settlement
	for i, m := range msgs {
		switch outcomes[i] {
		case outcomeSent:
			s.Sent = append(s.Sent, m.ID)
		case outcomeFailed:
			s.Failed = append(s.Failed, failures[i])
		default:
			s.Released = append(s.Released, m.ID)
		}
	}
	return s
}

// sendOne sends m and classifies the result.
func (r *Relay) sendOne(ctx context.Context, m Message) (out outcome, f Failure) {
	start := time.Now()
	err := r.safeSend(ctx, m)
	r.m.latency.Observe(time.Since(start).Seconds())
	if err == nil {
		r.outages.over(m.Topic)
		return outcomeSent, Failure{}
	}
	if errors.Is(context.Cause(ctx), errShutdown) {
		r.log.WarnContext(ctx, "outbox send abandoned at shutdown: released, it will be sent again with the same dedupe key",
			logAttrs(m)...)
		return outcomeReleased, Failure{}
	}
	attempt := m.Attempts + 1
	class := classOf(ctx, err)
	r.m.failures.WithLabelValues(class).Inc()
	f = Failure{
		ID:      m.ID,
		Error:   truncate(err.Error(), maxErrorLen),
		Exhaust: class == classPermanent || (class != classUnavailable && attempt >= r.cfg.MaxAttempts),
		Outage:  class == classUnavailable,
	}
	if f.Outage {
		f.Delay = r.outages.delay(m.Topic, time.Now(), r.cfg.BackoffBase, r.cfg.BackoffCap)
	} else {
		f.Delay = retry.FullJitter(nil, r.cfg.BackoffBase, r.cfg.BackoffCap, attempt-1)
	}
	if d, ok := RetryAfterOf(err); ok {
		f.Delay = min(d, r.cfg.MaxRetryAfter)
	}
	if f.Outage {
		r.log.WarnContext(ctx, "outbox send failed: a dependency is down; the row waits for it without spending an attempt",
			append(logAttrs(m), "attempts", m.Attempts, "class", class, "retry_in", f.Delay, "err", err)...)
		return outcomeFailed, f
	}
	r.log.WarnContext(ctx, "outbox send failed", append(logAttrs(m), "attempt", attempt,
		"class", class, "exhausted", f.Exhaust, "retry_in", f.Delay, "err", err)...)
	return outcomeFailed, f
}

// outages tracks, per topic, since when this relay's sends of it have met a
// dependency's outage (errors matching ErrUnavailable), so that the retry delay grows
// with the outage: rows that wait for a dependency spend no attempts, so their own
// attempt counts cannot shape the backoff. Its state is one time per topic in an
// outage, cleared by the topic's next successful send. Safe for concurrent use.
type outages struct {
	mu    sync.Mutex
	since map[string]time.Time
}

// delay records that a send of topic met an outage at now and returns the wait before
// the row is tried again: a uniformly random duration up to the outage's age so far,
// that bound kept between base and most (the relay's BackoffBase and BackoffCap). Each
// row is retried about when the outage has grown by half again, so retries thin out as
// it lasts, like exponential backoff, and the rows are spread over the interval.
func (o *outages) delay(topic string, now time.Time, base, most time.Duration) time.Duration {
	o.mu.Lock()
	since, ok := o.since[topic]
	if !ok {
		if o.since == nil {
			o.since = map[string]time.Time{}
		}
		o.since[topic], since = now, now
	}
	o.mu.Unlock()
	upper := min(max(now.Sub(since), base), most)
	return retry.FullJitter(nil, upper, upper, 0)
}

// over records that a send of topic succeeded: its outage, if any, is over.
func (o *outages) over(topic string) {
	o.mu.Lock()
	delete(o.since, topic)
	o.mu.Unlock()
}

// safeSend calls the sender, turning a panic into an error.
func (r *Relay) safeSend(ctx context.Context, m Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("sender panicked: %v", p)
		}
	}()
	return r.sender.Send(ctx, m)
}

// Failure classes, the values of the metric label "class".
const (
	classPermanent   = "permanent"
	classUnavailable = "unavailable" // a dependency is down: no attempt counted
	classTimeout     = "timeout"
	classRetryable   = "retryable"
)

// classOf names the kind of a send failure for metrics and logs.
func classOf(ctx context.Context, err error) string {
	var ne net.Error
	switch {
	case retry.IsPermanent(err):
		return classPermanent
	case errors.Is(err, ErrUnavailable):
		return classUnavailable
	case errors.Is(err, context.DeadlineExceeded), ctx.Err() != nil, errors.As(err, &ne) && ne.Timeout():
		return classTimeout
	default:
		return classRetryable
	}
}

// Purge deletes sent rows older than Retention, PurgeBatch rows per statement, until
// none is left or ctx is done, and returns how many it deleted.
func (r *Relay) Purge(ctx context.Context) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		n, err := r.store.PurgeSent(ctx, r.cfg.Retention, r.cfg.PurgeBatch)
		total += n
		r.m.purged.Add(float64(n))
		if err != nil {
			return total, fmt.Errorf("purge sent outbox rows: %w", err)
		}
		if n < int64(r.cfg.PurgeBatch) {
			break
		}
	}
	if total > 0 {
		r.log.InfoContext(ctx, "outbox purged sent rows", "rows", total, "retention", r.cfg.Retention)
	}
	return total, nil
}

// sample updates the oldest-unsent-age gauge when the store can tell it.
func (r *Relay) sample(ctx context.Context) {
	s, ok := r.store.(OldestUnsentStore)
	if !ok {
		return
	}
	age, err := s.OldestUnsent(ctx)
	if err != nil {
		if ctx.Err() == nil {
			r.log.WarnContext(ctx, "outbox sample failed", "err", err)
		}
		return
	}
	r.m.oldest.Set(age.Seconds())
}

// fenced lists the ids of msgs that settled does not mention, at most 20 of them.
func fenced(msgs []Message, settled Settled) []string {
	var ids []string
	for _, m := range msgs {
		if !slices.Contains(settled.Sent, m.ID) && !slices.Contains(settled.Retrying, m.ID) &&
			!slices.Contains(settled.Exhausted, m.ID) && !slices.Contains(settled.Released, m.ID) {
			ids = append(ids, strconv.FormatInt(m.ID, 10))
			if len(ids) == 20 {
				break
			}
		}
	}
	return ids
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
