package main

import (
	"context"
	"fmt"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
)

// benchArgs is the typed job of the onceflow-api system.
type benchArgs struct {
	ID int `json:"id"`
}

func (benchArgs) Kind() string { return "bench" }

// onceflowAPISystem runs the same jobs as onceflowSystem through the public API: typed
// arguments, a Worker[benchArgs] routed by kind, Client.Enqueue with an explicit job id
// (one script call each, as queue.Enqueue). Its ratio to "onceflow" is what typed
// decoding and routing cost.
type onceflowAPISystem struct {
	redisAddr   string
	concurrency int
	rdb         *redis.Client
	prefix      string
	n           int
	h           handlerFunc
	client      *onceflow.Client
}

func newOnceflowAPISystem(redisAddr string, concurrency int) system {
	return &onceflowAPISystem{redisAddr: redisAddr, concurrency: concurrency}
}

func (s *onceflowAPISystem) name() string { return "onceflow-api" }

func (s *onceflowAPISystem) prepare(ctx context.Context) error {
	if s.rdb == nil {
		opts, err := onceflow.RedisOptions("redis://" + s.redisAddr)
		if err != nil {
			return err
		}
		opts.PoolSize = 64
		s.rdb = redis.NewClient(opts)
	}
	s.n++
	s.prefix = fmt.Sprintf("benchapi%d", s.n)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[benchArgs](func(ctx context.Context, j *onceflow.Job[benchArgs]) error {
		return s.h(ctx, j.Args.ID)
	}))
	c, err := onceflow.NewClient(onceflow.Config{
		Redis: s.rdb, Prefix: s.prefix, Workers: ws, Logger: quietLogger(),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {Concurrency: s.concurrency}},
	})
	if err != nil {
		return err
	}
	s.client = c
	return s.rdb.FlushAll(ctx).Err()
}

func (s *onceflowAPISystem) enqueue(ctx context.Context, ids []int) error {
	return parallel(ctx, ids, 16, func(ctx context.Context, id int) error {
		_, err := s.client.Enqueue(ctx, benchArgs{ID: id}, &onceflow.EnqueueOpts{JobID: jobID(id), Tenant: "bench"})
		return err
	})
}

func (s *onceflowAPISystem) start(ctx context.Context, h handlerFunc) (func(), error) {
	s.h = h
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = s.client.Run(ctx) })
	return func() { cancel(); wg.Wait() }, nil
}

func (s *onceflowAPISystem) close() {
	if s.rdb != nil {
		_ = s.rdb.Close()
	}
}
