package queue

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/retry"
)

// Worker defaults; see WorkerConfig.
const (
	DefaultGroup           = "workers"
	DefaultConcurrency     = 64
	DefaultClaimIdle       = 2 * time.Minute
	DefaultMaxDeliveries   = 5
	DefaultBlock           = 250 * time.Millisecond
	DefaultShutdownTimeout = 30 * time.Second
	DefaultAckBatch        = 512
	DefaultAckLinger       = 500 * time.Microsecond
	DefaultTrimInterval    = time.Minute
	DefaultConsumerMaxIdle = time.Hour
	DefaultStatsInterval   = 15 * time.Second
	// DefaultRetryBase and DefaultRetryMax bound the full-jitter delay before the next
	// attempt of a failed job (ONCEFLOW_RETRY_BASE, ONCEFLOW_RETRY_MAX).
	DefaultRetryBase = time.Second
	DefaultRetryMax  = 5 * time.Minute
	// DefaultScheduleInterval is how often a worker looks for scheduled jobs that are
	// due when it knows of none due sooner.
	DefaultScheduleInterval = time.Second
	// DefaultMaxRunTime bounds one run of a job (ONCEFLOW_MAX_RUN_TIME).
	DefaultMaxRunTime = 15 * time.Minute
	// DefaultDeadLetterRetention is 30 days.
	DefaultDeadLetterRetention = 30 * 24 * time.Hour
)

// WorkerConfig configures a Worker. Redis, Keys and Handler are required; every other
// field has a default, applied by NewWorker.
type WorkerConfig struct {
	// Redis is the client the worker uses (a *redis.Client or *redis.ClusterClient). Its
	// pool must allow a few connections at once: the read loop, the acknowledger, the
	// lease renewer, maintenance and dead-lettering handlers each hold one while busy.
	Redis redis.UniversalClient
	// Keys names the queue, and its partition the first the worker consumes.
	Keys Keys
	// Partitions is how many partitions of the queue the worker consumes, from
	// Keys.Partition on (Keys.InPartition(Keys.Partition) to
	// Keys.InPartition(Keys.Partition+Partitions-1)), with one budget of Concurrency
	// slots: a partition with a backlog uses the slots the others do not. It reads the
	// partitions one Redis node holds in one round trip, and acknowledges their entries in
	// one (see reader.go and docs/queue.md, "Partitions"); each partition keeps its own
	// reclaim, scheduler and maintenance. Default: 1.
	Partitions int
	// Handler runs the jobs.
	Handler Handler

	// Group is the consumer group, created (idempotently) when Run starts.
	// Default: DefaultGroup ("workers").
	Group string
	// Consumer is this worker's name in the group; it must be unique among the workers
	// of a group. Default: ConsumerName() (host, pid and a random suffix).
	Consumer string
	// Concurrency is the most handlers that run at once; the worker never reads more
	// messages than it has free slots. Default: 64, or Budget's size.
	Concurrency int
	// Budget, when set, is the concurrency budget this worker shares with other workers
	// of the queue (those of other partitions of it): its handlers take their slots from
	// it, and Concurrency, when set, must be its size. Default: nil, a budget of its own
	// of Concurrency slots.
	Budget *Budget
	// ClaimIdle is how long an entry must have been idle (not delivered, claimed or
	// renewed) before a worker reclaims it: the time in which a dead worker's jobs, and a
	// failed run's, are retried. Default: 2m.
	ClaimIdle time.Duration
	// MaxDeliveries is the job's budget of failed attempts (the name is kept from when
	// it counted deliveries): a run whose handler failed on the job spends one, and so
	// does a delivery that never reported (its worker died: a job that kills its worker
	// cannot be told from a worker killed by someone else); a run cut by a shutdown, a
	// dependency's outage (ErrUnavailable) and a snooze spend none. The failure that
	// spends the last one dead-letters the job with the reason "failed N attempts; last
	// error: ..." unless the handler reports it completed (Completer). Default: 5.
	MaxDeliveries int
	// RetryBase and RetryMax shape the wait before the next attempt after a failure: a
	// full-jitter exponential delay (retry.FullJitter: uniform in [0, min(RetryMax,
	// RetryBase·2ⁿ)] after the n+1-th failure), or the failure's own Retry-After
	// (retry.RetryAfterer, as a provider's 429 and RetryAfter carry). The entry leaves
	// the worker at once: it waits in the scheduled set, not in the pending list.
	// Defaults: 1s and 5m.
	RetryBase, RetryMax time.Duration
	// ScheduleInterval is how often the worker moves due scheduled jobs (retries,
	// snoozes, EnqueueAt's) to the stream when it knows of none due sooner; a job this
	// worker scheduled wakes it at the job's time. Default: 1s.
	ScheduleInterval time.Duration
	// MaxRunTime bounds one run: the handler's context is cancelled after it, the
	// entry's lease is no longer renewed (so another worker takes it over after
	// ClaimIdle even if the handler ignores its context), and the run counts as a failed
	// attempt. Negative: no bound. Default: 15m.
	MaxRunTime time.Duration
	// Block is how long one blocking XREADGROUP waits for new messages; it bounds how
	// late the worker notices cancellation (a read in progress is not cut: its entries
	// would be delivered to no one until reclaimed), and an idle partition costs one
	// read per Block. Default: 250ms, so that a stopped worker (SIGTERM, a rolling
	// deploy, a test's Client) is gone within a quarter of a second.
	Block time.Duration
	// ClaimInterval is how often the worker looks for entries to reclaim when its last
	// XAUTOCLAIM scan reached the end of the pending list (while a scan is under way it
	// continues on every loop). Default: ClaimIdle/4, at most 1s.
	ClaimInterval time.Duration
	// RenewInterval is how often the idle time of in-flight entries is reset, so that a
	// run longer than ClaimIdle keeps its entry. Negative disables renewal (then ClaimIdle
	// must exceed the slowest run, or slow runs are reclaimed and run twice).
	// Default: ClaimIdle/3. It must be shorter than ClaimIdle.
	RenewInterval time.Duration
	// ShutdownTimeout is how long Run waits, once its context is cancelled, for running
	// handlers before it cancels their context and hands their jobs back: each is
	// re-added to the stream at once, so another worker starts it within its next read,
	// without spending an attempt (a restart is not the job's failure). Default: 30s.
	ShutdownTimeout time.Duration
	// AckBatch is the most ids one XACK carries. Default: 512.
	AckBatch int
	// RecordSuccesses adds each successful delivery (its consumer, delivery number and
	// times) to its job's history (ReadHistory), written in the acknowledgement's round
	// trip. Failures, hand-backs, dead letters, replays and purges are always recorded,
	// by the scripts that settle them; a success costs a write of its own: 0.83 to 0.92
	// of the throughput of a worker whose handlers do nothing (docs/BENCHMARKS.md),
	// about 0.74 µs of Redis time and a record's encoding per job. Default: false (the
	// job page then shows the acknowledged run without its consumer and times).
	RecordSuccesses bool
	// AckLinger is how long the acknowledger waits for more finished jobs before sending
	// a batch that is not full; a longer linger means fewer XACK round trips, and on a
	// crash that many more finished jobs redelivered. Negative sends each batch as soon
	// as the previous XACK returned. Default: 500µs.
	AckLinger time.Duration
	// TrimInterval is how often the worker trims acknowledged entries and deletes idle
	// consumers. Negative disables both. Default: 1m.
	TrimInterval time.Duration
	// ConsumerMaxIdle is how long a consumer with no pending entries may stay idle before
	// maintenance deletes it from the group. Negative disables deletion. Default: 1h.
	ConsumerMaxIdle time.Duration
	// StatsInterval is how often the stream length, pending count, oldest pending idle
	// time and dead-letter count gauges are sampled (only when Registerer is set).
	// Default: 15s.
	StatsInterval time.Duration
	// JobTTL is how long a job's index (Keys.Job: its tenant and state, what the API's
	// GET reads) is kept once the job left the stream: the acknowledgement of its latest
	// entry, or the trimming of its dead letter, starts it. While the job is queued,
	// running or dead-lettered its index does not expire. The service sets it to
	// ONCEFLOW_RESULT_TTL. Default: DefaultJobTTL (24h).
	JobTTL time.Duration
	// DeadLetterRetention is how long a dead letter is kept: maintenance (every
	// TrimInterval) deletes older ones with TrimDead, and their job indexes get JobTTL.
	// Negative keeps dead letters for ever. The service sets it to
	// ONCEFLOW_DLQ_RETENTION. Default: DefaultDeadLetterRetention (720h, 30 days).
	DeadLetterRetention time.Duration

	// Gate, when set, is consulted before every read of new or reclaimed work: while it
	// blocks (a dependency the handler needs is down), the worker takes nothing, and
	// when it admits a limited number (a probe), the worker takes at most that many.
	// Default: nil, no gate.
	Gate Gate

	// Logger receives the worker's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer receives the worker's metrics (onceflow_queue_*). Default: nil, not
	// exported.
	Registerer prometheus.Registerer
}

// withDefaults returns c with every zero field set to its default.
func (c WorkerConfig) withDefaults() WorkerConfig {
	c.Group = cmp.Or(c.Group, DefaultGroup)
	c.Consumer = cmp.Or(c.Consumer, ConsumerName())
	if c.Budget != nil {
		c.Concurrency = cmp.Or(c.Concurrency, c.Budget.Size())
	}
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.Partitions = cmp.Or(c.Partitions, 1)
	c.ClaimIdle = cmp.Or(c.ClaimIdle, DefaultClaimIdle)
	c.MaxDeliveries = cmp.Or(c.MaxDeliveries, DefaultMaxDeliveries)
	c.Block = cmp.Or(c.Block, DefaultBlock)
	c.ClaimInterval = cmp.Or(c.ClaimInterval, min(c.ClaimIdle/4, time.Second))
	c.RenewInterval = cmp.Or(c.RenewInterval, c.ClaimIdle/3)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	c.AckBatch = cmp.Or(c.AckBatch, DefaultAckBatch)
	c.AckLinger = cmp.Or(c.AckLinger, DefaultAckLinger)
	c.TrimInterval = cmp.Or(c.TrimInterval, DefaultTrimInterval)
	c.ConsumerMaxIdle = cmp.Or(c.ConsumerMaxIdle, DefaultConsumerMaxIdle)
	c.StatsInterval = cmp.Or(c.StatsInterval, DefaultStatsInterval)
	c.JobTTL = cmp.Or(c.JobTTL, DefaultJobTTL)
	c.DeadLetterRetention = cmp.Or(c.DeadLetterRetention, DefaultDeadLetterRetention)
	c.RetryBase = cmp.Or(c.RetryBase, DefaultRetryBase)
	c.RetryMax = cmp.Or(c.RetryMax, DefaultRetryMax)
	c.ScheduleInterval = cmp.Or(c.ScheduleInterval, DefaultScheduleInterval)
	c.MaxRunTime = cmp.Or(c.MaxRunTime, DefaultMaxRunTime)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// validate reports the first invalid setting of a config with defaults applied.
func (c WorkerConfig) validate() error {
	switch {
	case c.Redis == nil:
		return errors.New("queue: WorkerConfig.Redis is required")
	case c.Handler == nil:
		return errors.New("queue: WorkerConfig.Handler is required")
	case c.Concurrency < 1:
		return fmt.Errorf("queue: Concurrency %d must be at least 1", c.Concurrency)
	case c.Budget != nil && c.Concurrency != c.Budget.Size():
		return fmt.Errorf("queue: Concurrency %d must be the shared Budget's size %d", c.Concurrency, c.Budget.Size())
	case c.Keys.Validate() != nil:
		return fmt.Errorf("queue: WorkerConfig.Keys: %w", c.Keys.Validate())
	case c.Partitions < 1 || c.Keys.Partition+c.Partitions > MaxPartitions:
		return fmt.Errorf("queue: Partitions %d from partition %d: want 1 to %d in all", c.Partitions, c.Keys.Partition, MaxPartitions)
	case c.ClaimIdle < time.Millisecond:
		return fmt.Errorf("queue: ClaimIdle %v must be at least 1ms", c.ClaimIdle)
	case c.MaxDeliveries < 1:
		return fmt.Errorf("queue: MaxDeliveries %d must be at least 1", c.MaxDeliveries)
	case c.Block < time.Millisecond:
		return fmt.Errorf("queue: Block %v must be at least 1ms", c.Block)
	case c.ClaimInterval <= 0:
		return fmt.Errorf("queue: ClaimInterval %v must be positive", c.ClaimInterval)
	case c.RenewInterval >= c.ClaimIdle:
		return fmt.Errorf("queue: RenewInterval %v must be shorter than ClaimIdle %v (or negative to disable renewal)", c.RenewInterval, c.ClaimIdle)
	case c.ShutdownTimeout <= 0:
		return fmt.Errorf("queue: ShutdownTimeout %v must be positive", c.ShutdownTimeout)
	case c.AckBatch < 1:
		return fmt.Errorf("queue: AckBatch %d must be at least 1", c.AckBatch)
	case c.StatsInterval <= 0:
		return fmt.Errorf("queue: StatsInterval %v must be positive", c.StatsInterval)
	case c.RetryBase < 0 || c.RetryMax < c.RetryBase:
		return fmt.Errorf("queue: RetryBase %v must not be negative nor above RetryMax %v", c.RetryBase, c.RetryMax)
	case c.ScheduleInterval < time.Millisecond:
		return fmt.Errorf("queue: ScheduleInterval %v must be at least 1ms", c.ScheduleInterval)
	case c.JobTTL < time.Millisecond:
		return fmt.Errorf("queue: JobTTL %v must be at least 1ms", c.JobTTL)
	case strings.ContainsAny(c.Group, " \t\r\n") || strings.ContainsAny(c.Consumer, " \t\r\n"):
		return fmt.Errorf("queue: group %q and consumer %q must not contain whitespace", c.Group, c.Consumer)
	}
	return c.Keys.Validate()
}

// ConsumerName returns a consumer name unique to this process and call:
// host-pid-random, for example "web-3-41237-9f2c61d0".
func ConsumerName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "host"
	}
	host = strings.Map(func(r rune) rune {
		if r <= ' ' || r > '~' {
			return '_'
		}
		return r
	}, host)
	b := make([]byte, 4)
	_, _ = crand.Read(b)
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b))
}

// ErrWorkerStarted is returned by a second call of Worker.Run.
var ErrWorkerStarted = errors.New("queue: worker already started")

// Worker runs the jobs of one queue, or of some of its partitions (Partitions), with up
// to Concurrency handlers at once; see the package documentation for its loop. Create
// it with NewWorker and call Run once. Its methods are safe for concurrent use.
type Worker struct {
	cfg   WorkerConfig
	parts []*part // the partitions it consumes, in order
	rdb   redis.UniversalClient
	log   *slog.Logger
	m     *workerMetrics

	slots    chan struct{} // one token per busy slot
	jobs     chan delivery // to idle handler goroutines
	idle     atomic.Int64  // handler goroutines waiting on jobs, minus jobs sent
	spawned  atomic.Int64  // handler goroutines started
	handlers sync.WaitGroup
	started  atomic.Bool
	cut      atomic.Bool // the shutdown timeout passed: in-flight handlers are cancelled
	// shared: other readers take from the slots too (another node's reader of this
	// worker, or another worker's on the same Budget), set by readLoop.
	shared atomic.Bool

	ackMu  sync.Mutex
	ackers map[string]*acker // one per node group (nodeGroup.key), started on first use

	mu       sync.Mutex
	inFlight map[entryKey]jobRef // entries whose handler runs, with their job for logs

	// unavailable counts the runs in a row that reported a dependency down, for the
	// hand-back delay; a successful run resets it.
	unavailable atomic.Int64
	// life ends when Run returns: settlements retry until then. Set by Run before any
	// handler starts.
	life context.Context
	// epoch is the current run epoch (epochFor), created under epochMu.
	epoch   atomic.Pointer[runEpoch]
	epochMu sync.Mutex
}

// entryKey names an entry of one of the worker's partitions (entry ids are per stream).
type entryKey struct {
	p  *part
	id string
}

// NewWorker checks cfg, applies its defaults and returns a Worker ready to Run. It
// returns an error naming the first invalid setting. It does not touch Redis.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger.With("queue", cfg.Keys.Name(), "consumer", cfg.Consumer)
	if cfg.Partitions > 1 {
		log = cfg.Logger.With("queue", cfg.Keys.Queue, "partitions",
			fmt.Sprintf("%d-%d", cfg.Keys.Partition, cfg.Keys.Partition+cfg.Partitions-1), "consumer", cfg.Consumer)
	}
	m := newWorkerMetrics(cfg.Registerer, cfg.Keys.Queue)
	slots := make(chan struct{}, cfg.Concurrency)
	if cfg.Budget != nil {
		slots = cfg.Budget.slots
	}
	parts := make([]*part, cfg.Partitions)
	for i := range parts {
		k := cfg.Keys.InPartition(cfg.Keys.Partition + i)
		plog := log
		if cfg.Partitions > 1 {
			plog = cfg.Logger.With("queue", k.Name(), "consumer", cfg.Consumer)
		}
		parts[i] = newPart(k, plog)
	}
	return &Worker{
		cfg: cfg, parts: parts, rdb: cfg.Redis, log: log, m: m,
		slots:    slots,
		jobs:     make(chan delivery, cfg.Concurrency),
		ackers:   make(map[string]*acker),
		inFlight: make(map[entryKey]jobRef),
	}, nil
}

// Consumer returns the worker's consumer name.
func (w *Worker) Consumer() string { return w.cfg.Consumer }

// Run creates the consumer group of each partition if needed and runs jobs until ctx is
// cancelled, then shuts down: it stops reading, waits up to ShutdownTimeout for running
// handlers (then cancels their context and waits a little more), acknowledges the jobs
// that finished, stops renewing leases and returns nil. Unfinished jobs are never
// acknowledged: they stay pending and another worker reclaims them after ClaimIdle.
//
// Redis errors do not stop Run: it logs them, counts them and retries with backoff.
// Run may be called once; a second call returns ErrWorkerStarted.
func (w *Worker) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return ErrWorkerStarted
	}
	defer w.closeAckers() // idempotent; on the normal path they closed below
	if !w.createGroups(ctx, w.parts...) {
		return nil
	}
	w.log.InfoContext(ctx, "worker started", "concurrency", w.cfg.Concurrency, "claim_idle", w.cfg.ClaimIdle,
		"max_deliveries", w.cfg.MaxDeliveries, "renew_interval", w.cfg.RenewInterval)

	// Handlers and the renewer outlive ctx: they stop after the drain, not at the signal.
	life, endLife := context.WithCancel(context.WithoutCancel(ctx))
	defer endLife()
	w.life = life
	hctx, cancelHandlers := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHandlers()
	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	var background sync.WaitGroup
	if w.cfg.RenewInterval > 0 {
		background.Go(func() { w.renewLoop(bg) })
	}
	background.Go(func() { w.maintainLoop(ctx) })
	for _, p := range w.parts {
		background.Go(func() { w.moveLoop(bg, p) })
	}

	// The shutdown timeout counts from the signal, not from the end of the read in
	// progress (up to Block later): a timer started at the signal cuts the handlers.
	var cutOnce sync.Once
	cut := func() {
		cutOnce.Do(func() {
			w.log.Warn("shutdown timeout: cancelling in-flight jobs, which are handed back to the queue at once without spending an attempt", "in_flight", w.inFlightCount())
			w.cut.Store(true)
			cancelHandlers()
		})
	}
	var timer atomic.Pointer[time.Timer]
	stopSignal := context.AfterFunc(ctx, func() { timer.Store(time.AfterFunc(w.cfg.ShutdownTimeout, cut)) })
	defer func() {
		stopSignal()
		if t := timer.Load(); t != nil {
			t.Stop()
		}
	}()
	w.readLoop(ctx, hctx)
	close(w.jobs)

	n := w.inFlightCount()
	w.log.Info("worker stopping: waiting for in-flight jobs", "in_flight", n, "timeout", w.cfg.ShutdownTimeout)
	done := make(chan struct{})
	go func() { w.handlers.Wait(); close(done) }()
	select {
	case <-done:
	case <-hctx.Done(): // the timer cut them: a short grace to return
		if !waitTimeout(&w.handlers, min(w.cfg.ShutdownTimeout, 5*time.Second)) {
			w.log.Error("handlers ignored cancellation; handing their jobs back anyway (another worker runs them; these runs may still complete)", "in_flight", w.inFlightCount())
			w.handBackAbandoned()
		}
	}
	stopBG()
	w.closeAckers()
	background.Wait()
	w.log.Info("worker stopped")
	return nil
}

// recreateGroups creates the consumer groups of parts again after Redis said one is
// missing (someone deleted a stream), for at most recreateTimeout.
func (w *Worker) recreateGroups(parts ...*part) {
	ctx, cancel := context.WithTimeout(context.Background(), recreateTimeout)
	defer cancel()
	w.createGroups(ctx, parts...)
}

// recreateTimeout bounds recreateGroups.
const recreateTimeout = 10 * time.Second

// createGroups creates the consumer group of each of parts, retrying with backoff until
// every one succeeded (true) or ctx is cancelled (false).
func (w *Worker) createGroups(ctx context.Context, parts ...*part) bool {
	var b backoff
	for _, p := range parts {
		for {
			err := CreateGroup(ctx, w.rdb, p.keys, w.cfg.Group)
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return false
			}
			w.m.redisError("group")
			p.log.Warn("cannot create consumer group; retrying", "err", err)
			if !b.sleep(ctx) {
				return false
			}
		}
	}
	return true
}

// admit waits for the Gate, if any, and returns how many jobs it admits (0: no limit);
// ok is false when ctx was cancelled.
func (w *Worker) admit(ctx context.Context) (limit int, ok bool) {
	if w.cfg.Gate == nil {
		return 0, true
	}
	start := time.Now()
	limit, err := w.cfg.Gate.Admit(ctx)
	if err != nil {
		return 0, false
	}
	if held := time.Since(start); held >= time.Second {
		w.log.Info("worker takes work again: the gate held it back while a dependency was down", "held", held.Round(time.Millisecond), "limit", limit)
	}
	return limit, true
}

// acquire waits for a free slot and takes every free slot; it returns how many it took,
// 0 when ctx was cancelled. When the last read was full (a backlog is waiting) and some
// slots are still busy, it waits up to batchWait for them, so that a busy worker reads in
// large batches instead of spending a round trip on every few messages. A reader that
// shares the slots with others (shared) takes one slot per stream it reads, at most,
// when its last read was not full: it would hold them through a blocking read of idle
// streams, while another reader's backlog waits for them.
func (w *Worker) acquire(ctx context.Context, backlog bool, streams int) int {
	select {
	case w.slots <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	if w.shared.Load() && !backlog {
		return 1 + w.takeUpTo(streams-1)
	}
	n := 1 + w.takeFree()
	if !backlog || n == w.cfg.Concurrency {
		return n
	}
	t := time.NewTimer(batchWait)
	defer t.Stop()
	for n < w.cfg.Concurrency {
		select {
		case w.slots <- struct{}{}:
			n += 1 + w.takeFree()
		case <-t.C:
			return n
		case <-ctx.Done():
			return n
		}
	}
	return n
}

// contendedBlock bounds a blocking read that holds the last free slot of a shared
// Budget.
const contendedBlock = 20 * time.Millisecond

// batchWait bounds how long acquire waits for busy slots when a backlog waits.
const batchWait = time.Millisecond

// takeFree takes every slot free right now and returns how many.
func (w *Worker) takeFree() int {
	n := 0
	for {
		select {
		case w.slots <- struct{}{}:
			n++
		default:
			return n
		}
	}
}

// takeUpTo takes up to n slots free right now and returns how many.
func (w *Worker) takeUpTo(n int) int {
	for i := range n {
		select {
		case w.slots <- struct{}{}:
		default:
			return i
		}
	}
	return n
}

func (w *Worker) release(n int) {
	for range n {
		<-w.slots
	}
}

// delivery is one entry of partition p handed to the worker.
type delivery struct {
	p          *part
	id         string
	fields     map[string]any
	deliveries int64
	// started is when its run began (set by process), for the job's history.
	started time.Time
}

// reclaimScript claims idle entries and reads their delivery counts in one step
// (lua/reclaim.lua).
var reclaimScript = scripts.MustScript("lua/reclaim.lua")

// reclaimCall returns the keys and arguments of reclaimScript for up to n entries of p.
func (w *Worker) reclaimCall(p *part, n int) ([]string, []any) {
	return []string{p.stream}, []any{w.cfg.Group, w.cfg.Consumer, w.cfg.ClaimIdle.Milliseconds(), p.cursor, n}
}

// reclaim claims up to n entries of p idle for ClaimIdle with their delivery counts, in
// one round trip (reclaimScript).
func (w *Worker) reclaim(ctx context.Context, p *part, n int) ([]delivery, error) {
	keys, args := w.reclaimCall(p, n)
	res, err := reclaimScript.Run(ctx, w.rdb, keys, args...).Slice()
	if err != nil {
		return nil, w.reclaimFailed(p, err)
	}
	return w.claimed(ctx, p, res)
}

// reclaimFailed counts and returns the error of p's reclaim, recreating its group when
// it is gone.
func (w *Worker) reclaimFailed(p *part, err error) error {
	w.m.redisError("reclaim")
	if isNoGroup(err) {
		w.recreateGroups(p)
	}
	return fmt.Errorf("reclaim idle messages of %s: %w", p.keys.Name(), err)
}

// claimed returns the deliveries of reclaimScript's reply res for p, and moves p's
// cursor on.
func (w *Worker) claimed(ctx context.Context, p *part, res []any) ([]delivery, error) {
	cursor, msgs, deleted, counts, err := parseReclaim(res)
	if err != nil {
		w.m.redisError("reclaim")
		return nil, fmt.Errorf("reclaim idle messages of %s: %w", p.keys.Name(), err)
	}
	p.cursor = cursor
	if cursor == "0-0" {
		p.lastScan = time.Now()
	}
	for _, id := range deleted {
		w.m.deletedPending.Inc()
		p.log.Error("a pending entry was deleted from the stream before it was acknowledged (XDEL or MAXLEN trimming outside the worker); its job is lost", "entry", id)
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	w.m.reclaimed.Add(float64(len(msgs)))
	out := make([]delivery, 0, len(msgs))
	for i, m := range msgs {
		if w.isInFlight(p, m.ID) {
			// Our own run of it is still going (renewal off or late, or the run overran
			// MaxRunTime): do not start a second. Undo the claim's delivery and leave the
			// entry reclaimable, so that another worker may take it over.
			p.log.Warn("reclaimed an entry this worker is still running; not running it twice", append(refOf(m.Values).attrs(), "entry", m.ID)...)
			w.unclaim(ctx, p, m.ID, counts[i]-1)
			continue
		}
		out = append(out, delivery{p: p, id: m.ID, fields: m.Values, deliveries: max(counts[i], 1)})
	}
	return out, nil
}

// unclaim sets entry id back to delivery count count and idle ClaimIdle (reclaimable at
// once), undoing this worker's reclaim of its own in-flight entry.
func (w *Worker) unclaim(ctx context.Context, p *part, id string, count int64) {
	err := w.rdb.Do(ctx, "XCLAIM", p.stream, w.cfg.Group, w.cfg.Consumer, 0, id,
		"IDLE", w.cfg.ClaimIdle.Milliseconds(), "RETRYCOUNT", max(count, 0), "JUSTID").Err()
	if err != nil {
		w.m.redisError("reclaim")
		p.log.Warn("could not undo the reclaim of an in-flight entry; its delivery count stays one higher", "entry", id, "err", err)
	}
}

// parseReclaim decodes reclaimScript's reply.
func parseReclaim(res []any) (cursor string, msgs []redis.XMessage, deleted []string, counts []int64, err error) {
	if len(res) != 4 {
		return "", nil, nil, nil, fmt.Errorf("reclaim reply has %d parts, want 4", len(res))
	}
	cursor, _ = res[0].(string)
	raw, _ := res[1].([]any)
	cs, _ := res[3].([]any)
	if len(cs) != len(raw) {
		return "", nil, nil, nil, fmt.Errorf("reclaim reply has %d entries and %d counts", len(raw), len(cs))
	}
	for i, r := range raw {
		e, _ := r.([]any)
		if len(e) != 2 {
			return "", nil, nil, nil, fmt.Errorf("reclaim reply entry %d is malformed", i)
		}
		id, _ := e[0].(string)
		kv, _ := e[1].([]any)
		values := make(map[string]any, len(kv)/2)
		for j := 0; j+1 < len(kv); j += 2 {
			k, _ := kv[j].(string)
			values[k] = kv[j+1]
		}
		msgs = append(msgs, redis.XMessage{ID: id, Values: values})
		c, _ := cs[i].(int64)
		counts = append(counts, c)
	}
	dl, _ := res[2].([]any)
	for _, d := range dl {
		if id, ok := d.(string); ok {
			deleted = append(deleted, id)
		}
	}
	return cursor, msgs, deleted, counts, nil
}

// deliver counts d and dispatches it.
func (w *Worker) deliver(hctx context.Context, d delivery) {
	w.m.deliveries.Inc()
	if d.deliveries > 1 {
		w.m.redeliveries.Inc()
	}
	w.dispatch(hctx, d)
}

// dispatch hands d to an idle handler goroutine, or starts one. The goroutines stay for
// the next jobs (no goroutine start and stack growth per job), so there are as many as
// the peak number of jobs run at once, at most Concurrency. idle counts goroutines
// waiting for a job minus jobs already sent to them; a delivery is only dispatched while
// its slot is held, so w.jobs (buffered Concurrency) never blocks.
func (w *Worker) dispatch(hctx context.Context, d delivery) {
	if w.idle.Add(-1) >= 0 {
		w.jobs <- d
		return
	}
	w.idle.Add(1)
	w.spawned.Add(1)
	w.handlers.Go(func() {
		returned := false
		defer func() {
			if !returned {
				// A handler ended this goroutine without returning (runtime.Goexit,
				// as t.FailNow in a test's handler): its slot is freed here, and the
				// next delivery starts a goroutine of its own.
				w.release(1)
			}
		}()
		for {
			w.process(hctx, d)
			// Idle before the slot is free: whoever takes the slot finds this
			// goroutine waiting, so there are never more goroutines than slots.
			w.idle.Add(1)
			w.release(1)
			var ok bool
			if d, ok = <-w.jobs; !ok {
				returned = true
				return
			}
		}
	})
}

// errRunTime is the cause of a run's context cancelled after MaxRunTime.
var errRunTime = errors.New("queue: the run exceeded MaxRunTime")

// process decides the fate of one delivery.
func (w *Worker) process(ctx context.Context, d delivery) {
	msg, err := ParseMessage(d.fields)
	if err != nil {
		detail := strings.TrimPrefix(err.Error(), ErrMalformed.Error()+": ")
		w.bury(d, nil, reasonMalformed, "malformed: "+detail, 0)
		return
	}
	run := &runState{job: Job{Message: msg, ID: d.id, Deliveries: int64(msg.Attempts) + d.deliveries}}
	job := &run.job
	started := time.Now()
	d.started = started
	w.track(d.p, d.id, jobRef{jobID: msg.JobID, tenant: msg.Tenant, start: started, deliveries: d.deliveries, run: run, d: d})
	// Tracked until its fate is settled: a reclaim scan in between must not take the
	// entry and run it again while this run still acknowledges, buries or hands it back.
	// A run whose lease was renewed has its start in the runs hash: forget it then.
	defer w.untrackRun(d.p, d.id)
	// Deliveries of this entry before this one never reported (their worker died): each
	// spent an attempt.
	if spent := int64(msg.Attempts) + d.deliveries - 1; spent >= int64(w.cfg.MaxDeliveries) {
		w.exhausted(ctx, d, job, spent, nil)
		return
	}
	// The run's context ends MaxRunTime after it started (to within an epoch: runs that
	// start in one epoch share one context and one watchdog, so a job costs no timer).
	rctx := ctx
	var ep *runEpoch
	if w.cfg.MaxRunTime > 0 {
		ep = w.epochFor(ctx, started)
		rctx = ep.ctx
	}
	outcome, err := w.run(rctx, d.p, job, started)
	overran := ep != nil && errors.Is(context.Cause(ep.ctx), errRunTime)
	if !run.settle.CompareAndSwap(runRunning, runSettling) {
		d.p.log.Warn("an abandoned run returned; its job was already handed on", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id, "err", err)
		return
	}
	var snooze *SnoozeError
	var wait *retry.WaitError
	switch {
	case outcome == outcomeOK:
		w.unavailable.Store(0)
		if !d.p.acks.Load().add(w.ackOf(d, OutcomeSucceeded)) {
			d.p.log.Warn("job finished after shutdown; it stays pending and will run again", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id)
		}
	case outcome == outcomePermanent:
		w.bury(d, &msg, reasonPermanent, "permanent: "+err.Error(), 0)
	case w.cut.Load() && ctx.Err() != nil:
		// Cut by this worker's shutdown (a deploy, a restart): not the job's failure. It
		// goes back to the stream at once for another worker.
		w.handBack(ctx, d, job, 0, "shutdown", err)
	case overran:
		w.retry(ctx, d, job, fmt.Errorf("%w (%v): %w", errRunTime, w.cfg.MaxRunTime, err))
	case errors.As(err, &snooze):
		w.m.snoozed.Inc()
		w.handBack(ctx, d, job, snooze.Delay, "snooze", nil)
	case errors.As(err, &wait):
		// A limiter had no capacity for the job's call (a rate limit, a budget): it waits
		// in the scheduled set, holding no worker, with the reason in its index.
		w.m.snoozed.Inc()
		w.handBackWaiting(d, job, wait)
	case outcome == outcomeUnavailable:
		n := w.unavailable.Add(1)
		w.m.handedBack.Inc()
		w.handBack(ctx, d, job, w.handBackDelay(err, n), "dependency unavailable", err)
	default: // outcomeError, outcomePanic
		w.retry(ctx, d, job, err)
	}
}

// ackOf is the acknowledgement of d, whose run ended with outcome, with its success
// record when RecordSuccesses is set.
func (w *Worker) ackOf(d delivery, outcome string) ack {
	if !w.cfg.RecordSuccesses {
		return ack{p: d.p, id: d.id}
	}
	return ack{p: d.p, id: d.id, history: w.historyOf(d, outcome, "")}
}

// historyOf is the history event of d, whose run ends now with outcome (detail: the
// error, reason or why).
func (w *Worker) historyOf(d delivery, outcome, detail string) string {
	return historyRecord(d, w.cfg.Consumer, outcome, detail, time.Now())
}

// forgetRun deletes entry id of p's start from its runs hash (LongRuns). One round trip,
// for runs long enough to have been renewed only; maintenance deletes what a failure here
// leaves.
func (w *Worker) forgetRun(p *part, id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := w.rdb.HDel(ctx, p.keys.Runs(), id).Err(); err != nil {
		w.m.redisError("renew")
	}
}

// abandonGrace is how long after MaxRunTime a run that ignores its cancelled context is
// abandoned: ClaimIdle/2, at most 10s, so before another worker could reclaim its entry
// (its lease stopped being renewed at MaxRunTime).
func (w *Worker) abandonGrace() time.Duration { return min(w.cfg.ClaimIdle/2, 10*time.Second) }

// handBackMax bounds the wait before a job handed back for a dependency's outage runs
// again (without a Retry-After): while the dependency is down the Gate keeps workers
// from taking it, so a short wait only bounds how late it starts once it is back.
const handBackMax = 10 * time.Second

// handBackDelay is the wait before a job handed back because of err runs again: err's
// Retry-After when it has one, else a full-jitter delay growing with the n-th hand-back
// in a row, at most handBackMax.
func (w *Worker) handBackDelay(err error, n int64) time.Duration {
	if d, ok := retryAfter(err); ok {
		return d
	}
	return retry.FullJitter(nil, w.cfg.RetryBase, min(w.cfg.RetryMax, handBackMax), int(min(n-1, 62)))
}

// retryAfter returns the Retry-After err carries (retry.RetryAfterer anywhere in its
// chain), if any.
func retryAfter(err error) (time.Duration, bool) {
	var ra retry.RetryAfterer
	if errors.As(err, &ra) {
		return ra.RetryAfter()
	}
	return 0, false
}

// retryDelays returns the full-jitter delays before the next attempt after each number
// of attempts already spent (retry.FullJitter), up to the budget, or err's Retry-After.
func (w *Worker) retryDelays(err error) (explicit time.Duration, draws []time.Duration) {
	if d, ok := retryAfter(err); ok {
		return d, nil
	}
	n := min(w.cfg.MaxDeliveries, 64)
	draws = make([]time.Duration, n)
	for i := range draws {
		draws[i] = retry.FullJitter(nil, w.cfg.RetryBase, w.cfg.RetryMax, i)
	}
	return -1, draws
}

// retry settles a failed run: the job spends an attempt (and those of unreported
// deliveries) and is scheduled for its next attempt, or, when that was its last,
// dead-lettered (unless it completed).
func (w *Worker) retry(ctx context.Context, d delivery, job *Job, cause error) {
	delay, draws := w.retryDelays(cause)
	msg := clipTo(cause.Error(), maxLastErrorLen)
	s := settlement{spend: d.deliveries, budget: int64(w.cfg.MaxDeliveries), lastError: msg, delay: delay, delays: draws,
		history: w.historyOf(d, OutcomeRetry, msg)}
	res, ok := w.settle(d, job, s)
	switch {
	case !ok:
		return
	case res.exhausted:
		w.exhausted(ctx, d, job, res.attempts, cause)
		return
	}
	w.m.retries.Inc()
	d.p.log.Warn("job failed; its next attempt is scheduled", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id,
		"in", res.delay, "attempts_spent_now", d.deliveries, "max_attempts", w.cfg.MaxDeliveries, "err", cause)
}

// handBack settles a run that did not fail on the job (a shutdown, a snooze, a
// dependency down): the job runs again after delay, spending only the attempts of its
// unreported deliveries.
func (w *Worker) handBack(ctx context.Context, d delivery, job *Job, delay time.Duration, why string, cause error) {
	w.handBackSpending(ctx, d, job, d.deliveries-1, delay, why, cause)
}

// handBackWaiting settles a run whose call a limiter put off (a *retry.WaitError): the
// job runs again after the wait, spending only the attempts of its unreported
// deliveries, with the wait's reason in its index. Logged at debug level: a limiter
// under load puts off many jobs, and its metrics count them.
func (w *Worker) handBackWaiting(d delivery, job *Job, wait *retry.WaitError) {
	res, ok := w.settle(d, job, settlement{spend: max(d.deliveries-1, 0), delay: max(wait.Delay, 0), waiting: wait.Reason,
		history: w.historyOf(d, OutcomeWaiting, wait.Reason)})
	if ok {
		d.p.log.Debug("job waits for capacity without spending an attempt", "job_id", job.JobID, "tenant", job.Tenant,
			"entry", d.id, "in", res.delay, "reason", wait.Reason)
	}
}

// handBackSpending is handBack recording spend attempts (those the settlement found
// spent, for a job whose completion is unknown).
func (w *Worker) handBackSpending(ctx context.Context, d delivery, job *Job, spend int64, delay time.Duration, why string, cause error) {
	detail := why
	if cause != nil {
		detail += ": " + cause.Error()
	}
	res, ok := w.settle(d, job, settlement{spend: max(spend, 0), delay: max(delay, 0),
		history: w.historyOf(d, OutcomeHandedBack, detail)})
	if !ok {
		return
	}
	attrs := []any{"job_id", job.JobID, "tenant", job.Tenant, "entry", d.id, "why", why, "in", res.delay}
	if cause != nil {
		attrs = append(attrs, "err", cause)
	}
	d.p.log.Info("job handed back without spending an attempt", attrs...)
}

// settle runs scheduleScript for d, retrying Redis errors with a backoff of at most a
// second for as long as the worker runs (the entry stays this worker's meanwhile, and
// its slot busy: a Redis outage, however long, spends no attempt, and the settlement
// lands within a second of Redis' return, before other workers' breakers let them
// reclaim). ok is false when it did not land or the entry was no longer this worker's;
// both are logged.
func (w *Worker) settle(d delivery, job *Job, s settlement) (res settleResult, ok bool) {
	return w.settleWithin(w.life, d, job, s)
}

// settleWithin is settle, retrying until ctx ends.
func (w *Worker) settleWithin(ctx context.Context, d delivery, job *Job, s settlement) (res settleResult, ok bool) {
	for n := 0; ; n++ {
		actx, acancel := context.WithTimeout(ctx, 5*time.Second)
		var err error
		reach("settle.before")
		res, err = settle(actx, w.rdb, d.p.keys, w.cfg.Group, w.cfg.Consumer, d.id, &job.Message, s)
		acancel()
		if err == nil {
			reach("settle.after")
			break
		}
		w.m.redisError("hand_back")
		if n == 0 {
			d.p.log.Warn("settling a job failed; retrying until Redis answers", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id, "err", err)
		}
		t := time.NewTimer(min(100*time.Millisecond<<min(n, 4), time.Second))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			d.p.log.Error("settling a job failed; it stays pending and is reclaimed after ClaimIdle", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id, "err", err)
			return res, false
		}
	}
	switch {
	case !res.owned:
		d.p.log.Warn("not settling an entry another worker now owns", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id)
		return res, false
	case res.gone:
		w.m.deletedPending.Inc()
		d.p.log.Error("a pending entry was deleted from the stream (XDEL or MAXLEN trimming outside the worker); its job is lost", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id)
		return res, false
	}
	if res.delay > 0 {
		w.wakeMover(d.p, res.delay)
	}
	return res, true
}

// exhausted handles a job whose budget is spent (attempts of them): it asks the
// handler whether the job completed anyway (Completer), and acknowledges it if so;
// else it dead-letters it. When the handler cannot tell (its store is down), the job is
// handed back rather than buried on a guess.
func (w *Worker) exhausted(ctx context.Context, d delivery, job *Job, attempts int64, cause error) {
	if c, ok := w.cfg.Handler.(Completer); ok {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		done, err := c.Completed(cctx, job)
		cancel()
		switch {
		case err != nil:
			// Every attempt it spent is recorded (the failure that spent the last one
			// included), so the job does not run again: its next delivery asks again.
			n := w.unavailable.Add(1)
			d.p.log.Warn("a job's budget is spent but whether it completed is unknown; handing it back", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id, "err", err)
			w.handBackSpending(ctx, d, job, attempts-int64(job.Attempts), w.handBackDelay(err, n), "completion unknown", err)
			return
		case done:
			w.m.completedNotBuried.Inc()
			d.p.log.Warn("a job whose budget is spent had completed; acknowledged, not dead-lettered", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id, "attempts", attempts)
			if !d.p.acks.Load().add(w.ackOf(d, OutcomeCompleted)) {
				d.p.log.Warn("job finished after shutdown; it stays pending and will run again", "job_id", job.JobID, "tenant", job.Tenant, "entry", d.id)
			}
			return
		}
	}
	reason := fmt.Sprintf("failed %d attempts", attempts)
	if cause != nil {
		reason += "; last error: " + cause.Error()
	} else {
		reason += " (the last never reported: its worker died)" + w.lastError(d.p, job.JobID)
	}
	w.bury(d, &job.Message, reasonMaxDeliveries, reason, attempts)
}

// maxLastErrorLen bounds the error kept in the index, in bytes.
const maxLastErrorLen = 512

// maxReasonLen bounds a dead-letter reason, in bytes: it is stored in the dead letter
// and the job index, returned by JobState and logged.
const maxReasonLen = 2 * maxLastErrorLen

// lastError returns "; last error: ..." with the error p's index keeps for the job's
// last failed attempt, or "" when there is none.
func (w *Worker) lastError(p *part, jobID string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	v, err := w.rdb.HGet(ctx, p.keys.Job(jobID), "last_error").Result()
	if err != nil || v == "" {
		return ""
	}
	return "; last error: " + v
}

// run calls the handler on job of p, turning a panic into an error; start is when the
// run began.
func (w *Worker) run(ctx context.Context, p *part, job *Job, start time.Time) (outcome string, err error) {
	w.m.inFlight.Inc()
	defer func() {
		if v := recover(); v != nil {
			outcome, err = outcomePanic, fmt.Errorf("handler panic: %v", v)
			p.log.Error("job handler panicked", "job_id", job.JobID, "tenant", job.Tenant, "entry", job.ID,
				"panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		} else if outcome == "" {
			// Neither a return nor a panic: the handler called runtime.Goexit. Its
			// goroutine ends after this; the job stays pending and is reclaimed.
			outcome = outcomePanic
			p.log.Error("job handler ended its goroutine without returning (runtime.Goexit, as t.FailNow does); the job stays pending until it is reclaimed",
				"job_id", job.JobID, "tenant", job.Tenant, "entry", job.ID)
		}
		w.m.inFlight.Dec()
		w.m.handlerDuration[outcome].Observe(time.Since(start).Seconds())
	}()
	err = w.cfg.Handler.Handle(ctx, job)
	switch {
	case err == nil:
		return outcomeOK, nil
	case errors.Is(err, ErrPermanent):
		return outcomePermanent, err
	case errors.Is(err, ErrUnavailable):
		return outcomeUnavailable, err
	case errors.As(err, new(*SnoozeError)), errors.Is(err, retry.ErrWaiting):
		return outcomeSnoozed, err
	default:
		return outcomeError, err
	}
}

// bury moves d to the dead-letter stream, recording attempts (0: the entry's delivery
// count). On a Redis error the entry stays pending and is buried on a later delivery.
func (w *Worker) bury(d delivery, msg *Message, label, reason string, attempts int64) {
	reason = clipTo(reason, maxReasonLen)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	deadID, ok, err := deadLetter(ctx, w.rdb, d.p.keys, w.cfg.Group, w.cfg.Consumer, d.id, d.fields, msg, reason, attempts, time.Now(),
		w.historyOf(d, OutcomeDeadLettered, reason))
	job := refOf(d.fields).attrs()
	switch {
	case err != nil:
		w.m.redisError("dead_letter")
		d.p.log.Error("dead-lettering failed; the entry stays pending and is retried after ClaimIdle", append(job, "entry", d.id, "reason", reason, "err", err)...)
	case !ok:
		d.p.log.Warn("not dead-lettering an entry another worker now owns", append(job, "entry", d.id, "reason", reason)...)
	default:
		w.m.deadLettered[label].Inc()
		d.p.log.Warn("job dead-lettered", append(job, "entry", d.id, "dead_id", deadID, "deliveries", d.deliveries, "reason", reason)...)
	}
}

// handBackAbandoned hands back, at once and without spending an attempt, the jobs
// whose handlers ignored the shutdown's cancellation. Their runs may still complete
// before the process exits: the handler's idempotency absorbs the second run.
func (w *Worker) handBackAbandoned() {
	w.mu.Lock()
	refs := make(map[entryKey]jobRef, len(w.inFlight))
	maps.Copy(refs, w.inFlight)
	w.mu.Unlock()
	// In parallel and bounded: during a Redis outage each would wait for Redis.
	ctx, cancel := context.WithTimeout(context.Background(), abandonTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for key, ref := range refs {
		wg.Go(func() {
			id := key.id
			d := delivery{p: key.p, id: id, deliveries: ref.deliveries, started: ref.start}
			job := &Job{Message: Message{JobID: ref.jobID, Tenant: ref.tenant}, ID: id, Deliveries: ref.deliveries}
			hist := w.historyOf(d, OutcomeHandedBack, "shutdown (handler ignored cancellation)")
			if _, ok := w.settleWithin(ctx, d, job, settlement{spend: max(ref.deliveries-1, 0), history: hist}); ok {
				key.p.log.Info("job handed back without spending an attempt", "job_id", job.JobID, "tenant", job.Tenant, "entry", id, "why", "shutdown (handler ignored cancellation)")
			}
		})
	}
	wg.Wait()
}

// abandonTimeout bounds the hand-back of the jobs whose handlers ignored the shutdown.
const abandonTimeout = 5 * time.Second

// wakeMover tells p's mover that a job of p this worker scheduled is due in d.
func (w *Worker) wakeMover(p *part, d time.Duration) {
	at := time.Now().Add(d).UnixNano()
	for {
		cur := p.wakeAt.Load()
		if cur != 0 && cur <= at {
			return
		}
		if p.wakeAt.CompareAndSwap(cur, at) {
			break
		}
	}
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// moveLoop moves due scheduled jobs of p to its stream until ctx is cancelled: it waits
// until the earliest scheduled job is due, at most ScheduleInterval, or until this
// worker schedules one due sooner.
func (w *Worker) moveLoop(ctx context.Context, p *part) {
	var b backoff
	t := time.NewTimer(time.Duration(rand.Int64N(int64(w.cfg.ScheduleInterval))) + 1) // #nosec G404 -- spreads workers' polls, not a secret
	defer t.Stop()
	for {
		woken := false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.wake:
			t.Stop()
			woken = true
		}
		wait := w.cfg.ScheduleInterval
		if at := p.wakeAt.Load(); at != 0 {
			until := time.Until(time.Unix(0, at))
			switch {
			case until <= 0:
				p.wakeAt.Store(0)
			case woken:
				// This worker scheduled a job due later: wait for it, at most
				// ScheduleInterval. The timer's own expiry always polls, so a job that
				// another process schedules, or makes due sooner, is moved within
				// ScheduleInterval however late this worker's own are.
				t.Reset(min(wait, until))
				continue
			}
		}
		mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		moved, next, err := MoveDue(mctx, w.rdb, p.keys, moveBatch)
		cancel()
		if err != nil {
			w.m.redisError("move")
			p.log.Warn("moving due scheduled jobs failed; retrying", "err", err)
			if !b.sleep(ctx) {
				return
			}
			t.Reset(0)
			continue
		}
		b.reset()
		w.m.moved.Add(float64(moved))
		if next >= 0 {
			wait = min(wait, next)
		}
		if at := p.wakeAt.Load(); at != 0 {
			wait = min(wait, max(time.Until(time.Unix(0, at)), 0))
		}
		t.Reset(wait)
	}
}

// jobRef names the job of an in-flight entry in logs, with when its run started and
// its delivery count.
type jobRef struct {
	jobID, tenant string
	start         time.Time
	deliveries    int64
	// run and d are the run's (nil and zero for a reference read from fields).
	run *runState
	d   delivery
	// renewed: the lease renewer renewed it, so its start is in the runs hash.
	renewed bool
}

// runState is one run: its Job, and whether it is still running, allocated together.
type runState struct {
	job    Job
	settle atomic.Int32 // runRunning, runSettling or runAbandoned
}

// The states of runState.settle: whichever of the run's end and the epoch's watchdog moves
// it from running first settles the entry.
const (
	runRunning int32 = iota
	runSettling
	runAbandoned
)

// runEpoch is the shared deadline of the runs that start within one epoch:
// epochLen(MaxRunTime) from start.
type runEpoch struct {
	start time.Time
	ctx   context.Context
}

// epochLen is how long one run epoch lasts: a second, at most a quarter of MaxRunTime.
func (w *Worker) epochLen() time.Duration {
	return min(time.Second, max(w.cfg.MaxRunTime/4, time.Millisecond))
}

// epochFor returns the epoch of a run that starts at t under parent (the handlers'
// context), creating it when t is past the current one: its context ends with cause
// errRunTime MaxRunTime after the epoch's end (so every run of the epoch gets at least
// MaxRunTime, at most an epoch more), and its watchdog abandons, abandonGrace later,
// the runs of the epoch that have not returned.
func (w *Worker) epochFor(parent context.Context, t time.Time) *runEpoch {
	if e := w.epoch.Load(); e != nil && t.Sub(e.start) < w.epochLen() && !t.Before(e.start) {
		return e
	}
	w.epochMu.Lock()
	defer w.epochMu.Unlock()
	if e := w.epoch.Load(); e != nil && t.Sub(e.start) < w.epochLen() && !t.Before(e.start) {
		return e
	}
	end := t.Add(w.epochLen())
	ctx, cancel := context.WithDeadlineCause(parent, end.Add(w.cfg.MaxRunTime), errRunTime)
	e := &runEpoch{start: t, ctx: ctx}
	time.AfterFunc(time.Until(end.Add(w.cfg.MaxRunTime+w.abandonGrace())), func() {
		cancel() // long past its deadline: releases it
		w.abandon(e.start, end)
	})
	w.epoch.Store(e)
	return e
}

// abandon gives up the runs that started in [from, to) and have not returned: each is
// settled as a failed attempt (its job's next attempt scheduled), though its handler
// may still complete (and its idempotency absorb it).
func (w *Worker) abandon(from, to time.Time) {
	var refs []jobRef
	w.mu.Lock()
	for _, ref := range w.inFlight {
		if ref.run == nil || ref.start.Before(from) || !ref.start.Before(to) || !ref.run.settle.CompareAndSwap(runRunning, runAbandoned) {
			continue
		}
		refs = append(refs, ref)
	}
	w.mu.Unlock()
	for _, ref := range refs {
		ref.d.p.log.Error("a run ignored the end of its MaxRunTime; abandoning it: its job's next attempt is scheduled (the handler may still complete, and its idempotency absorb it)",
			"job_id", ref.jobID, "tenant", ref.tenant, "entry", ref.d.id, "max_run_time", w.cfg.MaxRunTime)
		w.retry(w.life, ref.d, &ref.run.job, fmt.Errorf("%w (%v), and the handler did not return", errRunTime, w.cfg.MaxRunTime))
	}
}

// refOf reads the job id and tenant of an entry's raw fields, clipped (they may be
// malformed).
func refOf(fields map[string]any) jobRef {
	id, _ := fields[fieldJobID].(string)
	tenant, _ := fields[fieldTenant].(string)
	return jobRef{jobID: clip(id), tenant: clip(tenant)}
}

// attrs returns the job_id and tenant log attributes.
func (j jobRef) attrs() []any { return []any{"job_id", j.jobID, "tenant", j.tenant} }

func (w *Worker) track(p *part, id string, job jobRef) {
	w.mu.Lock()
	w.inFlight[entryKey{p, id}] = job
	w.mu.Unlock()
}

// untrackRun untracks entry id of p and, when its lease was renewed, deletes its start
// from the runs hash.
func (w *Worker) untrackRun(p *part, id string) {
	w.mu.Lock()
	ref := w.inFlight[entryKey{p, id}]
	delete(w.inFlight, entryKey{p, id})
	w.mu.Unlock()
	if ref.renewed {
		w.forgetRun(p, id)
	}
}

func (w *Worker) isInFlight(p *part, id string) bool {
	_, ok := w.inFlightJob(p, id)
	return ok
}

func (w *Worker) inFlightJob(p *part, id string) (jobRef, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	j, ok := w.inFlight[entryKey{p, id}]
	return j, ok
}

func (w *Worker) inFlightCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.inFlight)
}

// leases are the in-flight entries of one partition whose lease the renewer renews, with
// their runs' starts.
type leases struct {
	ids    []string
	starts []time.Time
}

// renewable returns, by partition, the in-flight entries whose lease is renewed: all of
// them, but for runs older than MaxRunTime, whose lease is let go so that another worker
// takes the job over after ClaimIdle even when its handler ignores its context.
func (w *Worker) renewable() map[*part]*leases {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[*part]*leases)
	now := time.Now()
	for k, j := range w.inFlight {
		if w.cfg.MaxRunTime > 0 && now.Sub(j.start) > w.cfg.MaxRunTime {
			continue
		}
		l := out[k.p]
		if l == nil {
			l = &leases{}
			out[k.p] = l
		}
		l.ids = append(l.ids, k.id)
		l.starts = append(l.starts, j.start)
		if !j.renewed {
			j.renewed = true
			w.inFlight[k] = j
		}
	}
	return out
}

// renewLoop resets the idle time of in-flight entries every RenewInterval until ctx is
// cancelled.
func (w *Worker) renewLoop(ctx context.Context) {
	t := time.NewTicker(w.cfg.RenewInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for p, l := range w.renewable() {
			ids, starts := l.ids, l.starts
			for len(ids) > 0 {
				n := min(len(ids), renewChunk)
				w.renewChunk(ctx, p, ids[:n], starts[:n])
				ids, starts = ids[n:], starts[n:]
			}
		}
	}
}

func (w *Worker) renewChunk(ctx context.Context, p *part, ids []string, starts []time.Time) {
	rctx, cancel := context.WithTimeout(ctx, w.cfg.RenewInterval)
	defer cancel()
	lost, deleted, err := renew(rctx, w.rdb, p.keys, w.cfg.Group, w.cfg.Consumer, ids, starts)
	if err != nil {
		w.m.redisError("renew")
		p.log.Warn("lease renewal failed", "entries", len(ids), "err", err)
		return
	}
	w.m.leaseRenewals.Add(float64(len(ids) - len(lost) - len(deleted)))
	for _, id := range lost {
		if job, ok := w.inFlightJob(p, id); ok { // else it finished and was acknowledged meanwhile
			w.m.leasesLost.Inc()
			p.log.Warn("lease lost: an entry this worker is still running is no longer pending to it (another worker reclaimed or acknowledged it); both runs may complete", append(job.attrs(), "entry", id)...)
		}
	}
	for _, id := range deleted {
		w.m.deletedPending.Inc()
		job, _ := w.inFlightJob(p, id)
		p.log.Error("an in-flight entry was deleted from the stream (XDEL or MAXLEN trimming outside the worker)", append(job.attrs(), "entry", id)...)
	}
}

// maintainLoop trims the stream, deletes idle consumers and samples gauges until ctx is
// cancelled. The first run of each comes after a random part of its interval, so
// workers started together do not act in step.
func (w *Worker) maintainLoop(ctx context.Context) {
	var trim, stats <-chan time.Time
	if w.cfg.TrimInterval > 0 {
		t := newJitterTicker(w.cfg.TrimInterval)
		defer t.Stop()
		trim = t.C
	}
	if w.cfg.Registerer != nil {
		t := newJitterTicker(w.cfg.StatsInterval)
		defer t.Stop()
		stats = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-trim:
			w.maintain(ctx)
		case <-stats:
			w.sample(ctx)
		}
	}
}

// maintain trims acknowledged entries and expired dead letters and deletes idle
// consumers, of each partition in turn.
func (w *Worker) maintain(ctx context.Context) {
	for _, p := range w.parts {
		if ctx.Err() != nil {
			return
		}
		w.maintainPart(ctx, p)
	}
}

// maintainPart is maintain for partition p.
func (w *Worker) maintainPart(ctx context.Context, p *part) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n, err := Trim(ctx, w.rdb, p.keys, w.cfg.JobTTL)
	if err != nil {
		w.m.redisError("trim")
		p.log.Warn("trim failed", "err", err)
	} else if n > 0 {
		w.m.trimmed.Add(float64(n))
		p.log.Debug("trimmed acknowledged entries", "entries", n)
	}
	if w.cfg.DeadLetterRetention > 0 {
		n, err := TrimDead(ctx, w.rdb, p.keys, time.Now().Add(-w.cfg.DeadLetterRetention), w.cfg.JobTTL)
		w.m.deadTrimmed.Add(float64(n))
		if err != nil {
			w.m.redisError("trim_dead")
			p.log.Warn("trimming old dead letters failed", "err", err)
		} else if n > 0 {
			p.log.Info("deleted dead letters older than the retention", "dead_letters", n, "retention", w.cfg.DeadLetterRetention)
		}
	}
	if _, err := forgetRuns(ctx, w.rdb, p.keys, w.cfg.Group); err != nil {
		w.m.redisError("trim")
		p.log.Warn("deleting the starts of finished runs failed", "err", err)
	}
	if w.cfg.ConsumerMaxIdle < 0 {
		return
	}
	names, err := DeleteIdleConsumers(ctx, w.rdb, p.keys, w.cfg.Group, w.cfg.Consumer, w.cfg.ConsumerMaxIdle)
	if err != nil {
		w.m.redisError("consumers")
		p.log.Warn("deleting idle consumers failed", "err", err)
		return
	}
	w.m.consumersDeleted.Add(float64(len(names)))
	for _, n := range names {
		p.log.Info("deleted idle consumer with no pending entries", "deleted", n, "idle_over", w.cfg.ConsumerMaxIdle)
	}
}

// sample sets the stream gauges.
func (w *Worker) sample(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	keys := make([]Keys, len(w.parts))
	for i, p := range w.parts {
		keys[i] = p.keys
	}
	s, err := ReadStatsOf(ctx, w.rdb, keys, w.cfg.Group)
	if err != nil {
		w.m.redisError("stats")
		w.log.Debug("sampling queue stats failed", "err", err)
		return
	}
	if w.cfg.Budget != nil {
		s = w.cfg.Budget.report(w.cfg.Keys.Partition, s)
	}
	w.m.streamLength.Set(float64(s.Length))
	w.m.pending.Set(float64(s.Pending))
	w.m.oldestPendingIdle.Set(s.OldestPendingIdle.Seconds())
	w.m.deadLetters.Set(float64(s.Dead))
	w.m.scheduled.Set(float64(s.Scheduled))
}

// jitterTicker ticks every d, the first time after a random fraction of d.
type jitterTicker struct {
	C    <-chan time.Time
	stop chan struct{}
}

func newJitterTicker(d time.Duration) *jitterTicker {
	c := make(chan time.Time, 1)
	t := &jitterTicker{C: c, stop: make(chan struct{})}
	go func() {
		timer := time.NewTimer(time.Duration(rand.Int64N(int64(d))) + 1) // #nosec G404 -- a random first tick spreads workers' scans, not a secret
		defer timer.Stop()
		for {
			select {
			case <-t.stop:
				return
			case now := <-timer.C:
				select {
				case c <- now:
				default:
				}
				timer.Reset(d)
			}
		}
	}()
	return t
}

func (t *jitterTicker) Stop() { close(t.stop) }

// backoff sleeps 100ms, 200ms, ... up to 5s, with jitter, between failed attempts.
type backoff struct{ n int }

func (b *backoff) reset() { b.n = 0 }

// sleep waits for the next backoff step; it reports false when ctx was cancelled.
func (b *backoff) sleep(ctx context.Context) bool {
	d := min(100*time.Millisecond<<min(b.n, 6), 5*time.Second)
	b.n++
	d = d/2 + time.Duration(rand.Int64N(int64(d/2)+1)) // #nosec G404 -- backoff jitter, not a secret
	return sleepFor(ctx, d)
}

// sleepFor waits d, or returns false when ctx ends first.
func sleepFor(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// waitTimeout waits for wg up to d and reports whether it finished.
func waitTimeout(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

// ValidEntryID reports whether id is a stream entry id ("ms-seq", as dead letters'
// DeadLetter.ID), for code that takes one from outside (a form, a flag).
func ValidEntryID(id string) bool {
	_, _, ok := splitID(id)
	return ok
}

// CompareEntryIDs orders two stream entry ids as the stream does: -1, 0 or +1.
func CompareEntryIDs(a, b string) int { return compareIDs(a, b) }

// compareIDs orders two stream ids (ms-seq).
func compareIDs(a, b string) int {
	am, as, _ := splitID(a)
	bm, bs, _ := splitID(b)
	if c := cmp.Compare(am, bm); c != 0 {
		return c
	}
	return cmp.Compare(as, bs)
}

// splitID splits a stream entry id "ms-seq", reporting whether it is one (zeros when
// not).
func splitID(id string) (ms, seq uint64, ok bool) {
	m, q, found := strings.Cut(id, "-")
	ms, err1 := strconv.ParseUint(m, 10, 64)
	seq, err2 := strconv.ParseUint(q, 10, 64)
	return ms, seq, found && err1 == nil && err2 == nil
}
