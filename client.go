package onceflow

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// Client enqueues jobs, runs the workers of its queues and the relay of their effects,
// and reads jobs' states. Create it with NewClient; its methods are safe for concurrent
// use.
type Client struct {
	cfg     Config
	log     *slog.Logger
	rdb     redis.UniversalClient
	store   *redisstore.Store
	workers map[string]*kindWorker
	queues  map[string]QueueConfig

	// enqueued counts the jobs added to the queues (onceflow_queue_enqueued_total).
	enqueued *prometheus.CounterVec
	// elsewhere are the queues, other than those it works, that this Client enqueued to
	// or routes to (queue name -> struct{}): JobState looks in them too.
	elsewhere sync.Map
	// known caches knownPartitions' answer per queue name.
	known sync.Map
	// registered has the queues whose partitions enqueueKeys recorded.
	registered sync.Map

	// background are the parts Run runs besides the queue workers (the outbox relay,
	// the ledger's purge), added by the features NewClient sets up.
	background []func(context.Context) error
	// steps is the job_steps table of recorded steps (Do, Job.Tool); nil without
	// Config.DB.
	steps *stepStore
	// model is the machinery of Job.Complete and Job.Stream (setupModel); nil without
	// Config.Model.
	model *model
	// redisBreaker and pgBreaker are the circuit breakers of Redis and PostgreSQL
	// (setupBreakers; pgBreaker nil without Config.DB).
	redisBreaker, pgBreaker *breaker.Breaker
	// router sends the outbox's topics: Config.Senders and EnqueueTx's (senders.go).
	router *outbox.Router
	// relay is the outbox relay Run and RunRelay run; nil without Config.DB.
	relay *outbox.Relay
	// shadows are Config.Shadows by step; nil without any.
	shadows *shadows
	// gates are Config.Gates by step; nil without any.
	gates *gates
	// batch is the batch lane (Config.Batch); nil without it.
	batch *batchLane

	runMu   sync.Mutex
	running bool
}

// NewClient checks cfg, applies its defaults and returns a Client. It does not touch
// Redis or PostgreSQL. Its errors name the first invalid setting.
func NewClient(cfg Config) (*Client, error) {
	if cfg.Redis == nil {
		return nil, errors.New("onceflow: Config.Redis is required")
	}
	if err := CheckRedis(cfg.Redis); err != nil {
		return nil, err
	}
	cfg.Prefix = cmp.Or(cfg.Prefix, DefaultPrefix)
	cfg.JobBudget = cmp.Or(cfg.JobBudget, DefaultJobBudget)
	cfg.ResultTTL = cmp.Or(cfg.ResultTTL, DefaultResultTTL)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.TraceParent == nil {
		cfg.TraceParent = func(context.Context) string { return "" }
	}
	explicit := len(cfg.Queues) > 0
	var self *Client // for the shadow worker, set once built
	shadows, err := setupShadows(&cfg, &self)
	if err != nil {
		return nil, err
	}
	gates, err := setupGates(&cfg)
	if err != nil {
		return nil, err
	}
	batch, err := setupBatch(&cfg)
	if err != nil {
		return nil, err
	}
	if err := mergeWorkflows(&cfg); err != nil {
		return nil, err
	}
	if !explicit {
		// Every queue a registered kind's jobs go to: a worker registered for a kind is a
		// worker its jobs reach, whatever queues the workflows declared settings for.
		queues := maps.Clone(cfg.Queues)
		if queues == nil {
			queues = map[string]QueueConfig{}
		}
		for _, kw := range cfg.Workers.snapshot() {
			if q := cmp.Or(kw.queue, DefaultQueue); !hasQueue(queues, q) {
				queues[q] = QueueConfig{}
			}
		}
		if len(queues) == 0 {
			queues[DefaultQueue] = QueueConfig{}
		}
		cfg.Queues = queues
	}
	// QueueDefaults.Partitions also holds for the queues the Client only enqueues to.
	if p := cfg.QueueDefaults.Partitions; p < 0 || p > queue.MaxPartitions {
		return nil, fmt.Errorf("onceflow: QueueDefaults.Partitions %d: want 1 to %d (0: 1)", p, queue.MaxPartitions)
	}
	for name, qc := range cfg.Queues {
		cfg.Queues[name] = qc.withDefaults(cfg.QueueDefaults)
	}
	c := &Client{cfg: cfg, log: cfg.Logger, rdb: cfg.Redis, workers: cfg.Workers.snapshot(), queues: maps.Clone(cfg.Queues), shadows: shadows, gates: gates, batch: batch}
	self = c
	if batch != nil {
		batch.c = c
	}
	store, err := redisstore.New(cfg.Redis, redisstore.Config{Prefix: cfg.Prefix, ResultTTL: cfg.ResultTTL, Logger: cfg.Logger,
		WaitReplicas: cfg.WaitReplicas, WaitTimeout: cfg.WaitTimeout})
	if err != nil {
		return nil, fmt.Errorf("onceflow: %w", err)
	}
	c.store = store
	c.enqueued = newEnqueuedCounter(cfg.Registerer, c.queueNames())
	for name, qc := range c.queues {
		if err := c.keys(name).Validate(); err != nil {
			return nil, fmt.Errorf("onceflow: queue %q: %w", name, err)
		}
		if qc.Partitions < 1 || qc.Partitions > queue.MaxPartitions {
			return nil, fmt.Errorf("onceflow: queue %q: Partitions %d: want 1 to %d", name, qc.Partitions, queue.MaxPartitions)
		}
		if qc.DefaultKind != "" && !queue.ValidKind(qc.DefaultKind) {
			return nil, fmt.Errorf("onceflow: queue %q: DefaultKind %q is not a valid kind", name, qc.DefaultKind)
		}
	}
	if cfg.JobBudget < 0 || cfg.ResultTTL < 0 {
		return nil, errors.New("onceflow: JobBudget and ResultTTL must not be negative")
	}
	if cfg.AuditMaxAge < 0 {
		return nil, fmt.Errorf("onceflow: Config.AuditMaxAge %v must not be negative", cfg.AuditMaxAge)
	}
	for _, setup := range []func() error{c.setupBreakers, c.setupModel, c.setupOutbox, c.setupSteps} {
		if err := setup(); err != nil {
			return nil, err
		}
	}
	gate := breaker.Set(c.Breakers())
	for name, qc := range c.queues {
		if qc.Gate == nil {
			qc.Gate = gate
			c.queues[name] = qc
		}
	}
	return c, nil
}

// hasQueue reports whether queues has name.
func hasQueue(queues map[string]QueueConfig, name string) bool { _, ok := queues[name]; return ok }

// withDefaults returns qc with its zero settings taken from d (Config.QueueDefaults).
func (qc QueueConfig) withDefaults(d QueueConfig) QueueConfig {
	qc.Concurrency = cmp.Or(qc.Concurrency, d.Concurrency)
	qc.ClaimIdle = cmp.Or(qc.ClaimIdle, d.ClaimIdle)
	qc.MaxDeliveries = cmp.Or(qc.MaxDeliveries, d.MaxDeliveries)
	qc.ShutdownTimeout = cmp.Or(qc.ShutdownTimeout, d.ShutdownTimeout)
	qc.StatsInterval = cmp.Or(qc.StatsInterval, d.StatsInterval)
	qc.DeadLetterRetention = cmp.Or(qc.DeadLetterRetention, d.DeadLetterRetention)
	qc.RetryBase = cmp.Or(qc.RetryBase, d.RetryBase)
	qc.RetryMax = cmp.Or(qc.RetryMax, d.RetryMax)
	qc.MaxRunTime = cmp.Or(qc.MaxRunTime, d.MaxRunTime)
	qc.RecordSuccesses = qc.RecordSuccesses || d.RecordSuccesses
	qc.Partitions = cmp.Or(qc.Partitions, d.Partitions, 1)
	return qc
}

// keys names the Redis keys of queue name (its partition 0).
func (c *Client) keys(name string) queue.Keys { return queue.Keys{Prefix: c.cfg.Prefix, Queue: name} }

// partitions returns the partitions jobs of queue name are enqueued to: its
// QueueConfig's, or QueueDefaults' for a queue the Client does not work.
func (c *Client) partitions(name string) int {
	if qc, ok := c.queues[name]; ok {
		return qc.Partitions
	}
	return max(c.cfg.QueueDefaults.Partitions, 1)
}

// jobKeys names the Redis keys of the partition of queue name that job id is enqueued
// to.
func (c *Client) jobKeys(name, id string) queue.Keys {
	return c.keys(name).InPartition(queue.PartitionOf(id, c.partitions(name)))
}

// enqueueKeys is jobKeys for an enqueue: a Client that enqueues to several partitions
// first records them (queue.RegisterPartitions, once per queue and process), so that
// the workers of a process configured with fewer still consume them.
func (c *Client) enqueueKeys(ctx context.Context, name, id string) (queue.Keys, error) {
	keys := c.jobKeys(name, id)
	n := c.partitions(name)
	if n == 1 {
		return keys, nil
	}
	if _, done := c.registered.Load(name); done {
		return keys, nil
	}
	if _, err := queue.RegisterPartitions(ctx, c.rdb, keys, n); err != nil {
		return keys, err
	}
	c.registered.Store(name, true)
	return keys, nil
}

// noteQueue records that the Client enqueues to queue name, for JobState.
func (c *Client) noteQueue(name string) {
	if _, works := c.queues[name]; !works {
		c.elsewhere.LoadOrStore(name, struct{}{})
	}
}

// stateQueues are the queues JobState looks in: those the Client works, then those it
// enqueued to or routes to, sorted.
func (c *Client) stateQueues() []string {
	out := c.queueNames()
	var more []string
	c.elsewhere.Range(func(k, _ any) bool { more = append(more, k.(string)); return true })
	slices.Sort(more)
	return append(out, more...)
}

// Run works every configured queue until ctx is cancelled, then drains each within its
// ShutdownTimeout and returns nil. Redis and PostgreSQL errors do not stop it (its parts
// log, count and retry them). A second concurrent call returns ErrClientRunning.
func (c *Client) Run(ctx context.Context) error {
	c.runMu.Lock()
	if c.running {
		c.runMu.Unlock()
		return ErrClientRunning
	}
	c.running = true
	c.runMu.Unlock()
	defer func() {
		c.runMu.Lock()
		c.running = false
		c.runMu.Unlock()
	}()
	var parts []func(context.Context) error
	for _, name := range c.queueNames() {
		run, err := c.queueRunner(ctx, name)
		if err != nil {
			return err
		}
		parts = append(parts, run)
	}
	parts = append(parts, c.watchers()...)
	if c.steps != nil {
		parts = append(parts, c.steps.run)
	}
	if c.shadows != nil {
		parts = append(parts, c.shadows.run)
	}
	if c.batch != nil {
		parts = append(parts, c.batch.run)
	}
	return runParts(ctx, append(parts, c.background...))
}

// queueRunner returns the part of Run that works queue name: one queue worker over its
// partitions (queue.WorkerConfig.Partitions: it reads the partitions one Redis node
// holds in one round trip), running the registered workers. It consumes the partitions a
// higher count recorded before (queue.RegisterPartitions), and every partitionsCheck
// looks again, so that partitions recorded later (by a process configured with more, or
// while Redis did not answer at start) get a worker too, sharing the first one's budget
// of Concurrency when it has several partitions.
func (c *Client) queueRunner(ctx context.Context, name string) (func(context.Context) error, error) {
	qc := c.queues[name]
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	n, err := queue.RegisterPartitions(rctx, c.rdb, c.keys(name), qc.Partitions)
	cancel()
	if err != nil {
		c.log.WarnContext(ctx, "onceflow: cannot read the partitions recorded for the queue: consuming the configured ones, and looking again", "queue", name, "partitions", qc.Partitions, "err", err)
		n = qc.Partitions
	}
	q := &queueRun{c: c, name: name, qc: qc, h: c.handler(name, qc)}
	if n > 1 {
		q.budget = queue.NewBudget(cmp.Or(qc.Concurrency, queue.DefaultConcurrency))
	}
	w, err := q.worker(0, n)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error { return q.run(ctx, w, n) }, nil
}

// partitionsCheck is how often a running queue looks for partitions recorded since it
// started.
var partitionsCheck = 5 * time.Second

// queueRun is one queue's workers under Run.
type queueRun struct {
	c      *Client
	name   string
	qc     QueueConfig
	h      queue.Handler
	budget *queue.Budget // shared by the queue's workers; nil for one partition
}

// worker returns the worker of partitions from to to-1.
func (q *queueRun) worker(from, to int) (*queue.Worker, error) {
	qc := q.qc
	w, err := queue.NewWorker(queue.WorkerConfig{
		Redis: q.c.rdb, Keys: q.c.keys(q.name).InPartition(from), Partitions: to - from, Handler: q.h, Budget: q.budget,
		Concurrency: qc.Concurrency, ClaimIdle: qc.ClaimIdle, MaxDeliveries: qc.MaxDeliveries,
		ShutdownTimeout: qc.ShutdownTimeout, StatsInterval: qc.StatsInterval, Gate: qc.Gate,
		JobTTL: q.c.cfg.ResultTTL, DeadLetterRetention: qc.DeadLetterRetention,
		RetryBase: qc.RetryBase, RetryMax: qc.RetryMax, MaxRunTime: qc.MaxRunTime, RecordSuccesses: qc.RecordSuccesses,
		Logger: q.c.log, Registerer: q.c.cfg.Registerer,
	})
	if err != nil {
		return nil, fmt.Errorf("onceflow: queue %q: %w", q.name, err)
	}
	return w, nil
}

// run runs w (of partitions 0 to n-1), and a worker of the partitions recorded later,
// until ctx ends; it returns the first worker's error.
func (q *queueRun) run(ctx context.Context, w *queue.Worker, n int) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	start := func(w *queue.Worker) {
		wg.Go(func() {
			if err := w.Run(ctx); err != nil {
				mu.Lock()
				first = cmp.Or(first, err)
				mu.Unlock()
				cancel()
			}
		})
	}
	start(w)
	t := time.NewTicker(partitionsCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return first
		case <-t.C:
		}
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		got, err := queue.RegisterPartitions(rctx, q.c.rdb, q.c.keys(q.name), q.qc.Partitions)
		rcancel()
		if err != nil || got <= n {
			continue
		}
		if q.budget == nil {
			// Partition 0's worker has slots of its own: until a restart, the new
			// partitions share a budget of their own, as large.
			q.budget = queue.NewBudget(cmp.Or(q.qc.Concurrency, queue.DefaultConcurrency))
			q.c.log.WarnContext(ctx, "onceflow: the queue has more partitions than when this process started: working them with a second budget of Concurrency until a restart", "queue", q.name, "partitions", got)
		} else {
			q.c.log.InfoContext(ctx, "onceflow: the queue has more partitions than when this process started: working them too", "queue", q.name, "partitions", got)
		}
		more, err := q.worker(n, got)
		if err != nil {
			q.c.log.ErrorContext(ctx, "onceflow: cannot work the queue's new partitions", "queue", q.name, "err", err)
			continue
		}
		start(more)
		n = got
	}
}

func (c *Client) handler(name string, qc QueueConfig) queue.Handler {
	var run JobFunc = func(ctx context.Context, info *JobInfo) error {
		if err := c.storeDown(); err != nil {
			return err // read just before its breaker opened: handed back, not run
		}
		kw := c.workers[info.Kind]
		if kw == nil {
			// Not permanent: in a rolling deploy a job of a new kind may reach a worker
			// of the previous version first; retried after ClaimIdle, a worker that
			// knows the kind may take it. A kind no worker knows is dead-lettered after
			// MaxDeliveries, the reason naming it.
			return fmt.Errorf("%w %q on queue %q: no worker registered in this process", ErrUnknownKind, info.Kind, name)
		}
		return kw.run(ctx, info.rt, info.msg, info.Delivery)
	}
	for i := len(c.cfg.Middleware) - 1; i >= 0; i-- {
		run = c.cfg.Middleware[i](run)
	}
	return &queueHandler{c: c, run: func(ctx context.Context, j *queue.Job) error {
		kind := cmp.Or(j.Kind, qc.DefaultKind)
		info := &JobInfo{
			ID: j.JobID, Kind: kind, Queue: name, Tenant: j.Tenant, Delivery: int(j.Deliveries), EntryID: j.ID,
			Args: j.Payload, TraceParent: j.TraceParent,
			msg: j.Message,
			rt:  &runtime{client: c, queue: name, delivery: j, deadline: retry.After(c.cfg.JobBudget)},
		}
		// A Worker that panics still has its step's answers recorded (the queue
		// recovers the panic): the next delivery replays them instead of asking again.
		defer info.rt.flushAnswers(ctx)
		err := run(withRuntime(ctx, info.rt), info)
		c.observeJob(err)
		return err
	}}
}

// queueHandler is the queue.Handler of a queue: it runs jobs, and answers the worker's
// question whether a job whose budget is spent completed (queue.Completer) from the
// completion records.
type queueHandler struct {
	c   *Client
	run func(context.Context, *queue.Job) error
}

// Handle runs j.
func (h *queueHandler) Handle(ctx context.Context, j *queue.Job) error { return h.run(ctx, j) }

// Completed reports whether j has a completion record of its own tenant (a job of
// another tenant's that completed with this id does not make this one done). Without
// Config.DB nothing records completions: false.
func (h *queueHandler) Completed(ctx context.Context, j *queue.Job) (bool, error) {
	if h.c.cfg.DB == nil {
		return false, nil
	}
	_, err := h.c.completed(ctx, j.Tenant, j.JobID)
	switch {
	case errors.Is(err, ErrJobNotFound):
		return false, nil
	case err != nil:
		err = PostgresError(err)
		h.c.observeJob(err) // PostgreSQL unreachable: counts toward its breaker
		return false, err
	}
	h.c.postgresWorked()
	return true, nil
}

// runParts runs every part until ctx is cancelled or one of them fails, and returns the
// first failure.
func runParts(ctx context.Context, parts []func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(parts))
	for _, p := range parts {
		go func() { errs <- p(ctx) }()
	}
	var first error
	for range parts {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}

// RunWorkers is the worker half of Run, for processes that run the parts separately
// (`onceflow work --queue` and `onceflow relay`): it works the named queues, all of the
// client's when none is named, purges the model ledger's expired rows when the client
// has a Model, and checks Redis and PostgreSQL for their breakers (Inspector.Breakers),
// until ctx is cancelled; then it drains each queue within its
// ShutdownTimeout and returns nil. It does not run the outbox relay (RunRelay does). A
// name the client does not know is an error wrapping ErrUnknownQueue, before anything
// runs. Unlike Run it may be called concurrently with RunRelay.
func (c *Client) RunWorkers(ctx context.Context, queues ...string) error {
	if len(queues) == 0 {
		queues = c.queueNames()
	}
	var parts []func(context.Context) error
	seen := map[string]bool{}
	for _, name := range queues {
		if _, ok := c.queues[name]; !ok {
			return fmt.Errorf("%w %q (the client's queues: %v)", ErrUnknownQueue, name, c.queueNames())
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		run, err := c.queueRunner(ctx, name)
		if err != nil {
			return err
		}
		parts = append(parts, run)
	}
	if c.model != nil {
		parts = append(parts, c.model.ledger.Run)
		if c.model.limiter != nil {
			parts = append(parts, c.model.limiter.Run)
		}
	}
	if c.steps != nil {
		parts = append(parts, c.steps.run)
	}
	if c.shadows != nil {
		parts = append(parts, c.shadows.run)
	}
	if c.batch != nil {
		parts = append(parts, c.batch.run)
	}
	return runParts(ctx, append(parts, c.watchers()...))
}

// RunRelay is the relay half of Run: it runs the outbox relay, which hands the effects
// of committed jobs to Config.Senders by topic (and sends EnqueueTx's jobs), until ctx is
// cancelled, and returns nil. It needs Config.DB. It may run in a process of its own,
// several at once (they never send the same row at once), or beside RunWorkers.
func (c *Client) RunRelay(ctx context.Context) error {
	if c.relay == nil {
		return errors.New("onceflow: RunRelay: Config.DB is required (the outbox is in PostgreSQL)")
	}
	return c.relay.Run(ctx)
}
