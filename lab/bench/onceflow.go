package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// onceflowSystem runs onceflow's queue.Worker with its defaults except Concurrency; jobs
// are enqueued with queue.Enqueue (one script call each: XADD plus the job index) from
// 16 goroutines, like asynq's.
type onceflowSystem struct {
	redisAddr   string
	concurrency int
	rdb         *redis.Client
	keys        queue.Keys
	n           int
}

func newOnceflowSystem(redisAddr string, concurrency int) system {
	return &onceflowSystem{redisAddr: redisAddr, concurrency: concurrency}
}

func (s *onceflowSystem) name() string { return "onceflow" }

func (s *onceflowSystem) prepare(ctx context.Context) error {
	if s.rdb == nil {
		// The same client settings onceflow's service uses (internal/connect), spelled
		// out since this module cannot import internal packages.
		s.rdb = redis.NewClient(&redis.Options{Addr: s.redisAddr, ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 64})
	}
	s.n++
	s.keys = queue.Keys{Prefix: fmt.Sprintf("bench%d", s.n), Queue: "bench"}
	return s.rdb.FlushAll(ctx).Err()
}

func jobID(id int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", id) }

func (s *onceflowSystem) enqueue(ctx context.Context, ids []int) error {
	now := time.Now()
	return parallel(ctx, ids, 16, func(ctx context.Context, id int) error {
		_, err := queue.Enqueue(ctx, s.rdb, s.keys, queue.Message{
			JobID: jobID(id), Tenant: "bench", Payload: json.RawMessage(`{"id":` + strconv.Itoa(id) + `}`), EnqueuedAt: now,
		})
		return err
	})
}

func (s *onceflowSystem) start(ctx context.Context, h handlerFunc) (func(), error) {
	w, err := queue.NewWorker(queue.WorkerConfig{
		Redis: s.rdb, Keys: s.keys, Concurrency: s.concurrency, Logger: quietLogger(),
		Handler: queue.HandlerFunc(func(ctx context.Context, job *queue.Job) error {
			var p struct {
				ID int `json:"id"`
			}
			if err := json.Unmarshal(job.Payload, &p); err != nil {
				return retry.Permanent(err)
			}
			return h(ctx, p.ID)
		}),
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = w.Run(ctx) })
	return func() { cancel(); wg.Wait() }, nil
}

func (s *onceflowSystem) close() {
	if s.rdb != nil {
		_ = s.rdb.Close()
	}
}
