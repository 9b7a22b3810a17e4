package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// ---------------------------------------------------------------- asynq

// asynqSystem runs hibiken/asynq v0.26 as its README recommends for throughput: one
// server with a high Concurrency on one queue, a short TaskCheckInterval so an idle
// processor picks up new tasks quickly, tasks enqueued with Client.Enqueue (asynq has no
// batch enqueue) from several goroutines.
type asynqSystem struct {
	redisAddr   string
	concurrency int
	client      *asynq.Client
	rdb         *redis.Client
}

func (s *asynqSystem) name() string { return "asynq" }

func (s *asynqSystem) prepare(ctx context.Context) error {
	if s.rdb == nil {
		s.rdb = redis.NewClient(&redis.Options{Addr: s.redisAddr, PoolSize: 64})
		s.client = asynq.NewClientFromRedisClient(s.rdb)
	}
	return s.rdb.FlushAll(ctx).Err()
}

func (s *asynqSystem) enqueue(ctx context.Context, ids []int) error {
	return parallel(ctx, ids, 16, func(ctx context.Context, id int) error {
		_, err := s.client.EnqueueContext(ctx, asynq.NewTask("bench", []byte(strconv.Itoa(id))),
			asynq.MaxRetry(0), asynq.Retention(0))
		return err
	})
}

func (s *asynqSystem) start(_ context.Context, h handlerFunc) (func(), error) {
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: s.redisAddr, PoolSize: s.concurrency + 16}, asynq.Config{
		Concurrency:       s.concurrency,
		TaskCheckInterval: 10 * time.Millisecond,
		LogLevel:          asynq.ErrorLevel,
	})
	mux := asynq.NewServeMux()
	mux.HandleFunc("bench", func(ctx context.Context, t *asynq.Task) error {
		id, err := strconv.Atoi(string(t.Payload()))
		if err != nil {
			return err
		}
		return h(ctx, id)
	})
	if err := srv.Start(mux); err != nil {
		return nil, err
	}
	return srv.Shutdown, nil
}

func (s *asynqSystem) close() {
	if s.client != nil {
		_ = s.client.Close()
	}
}

// ---------------------------------------------------------------- River

// riverSystem runs riverqueue/river v0.51 on riverpgxv5 with the settings its docs give
// for throughput: many workers on one queue, FetchCooldown at its 1 ms minimum and a short
// FetchPollInterval, jobs inserted with InsertManyFast (River's bulk COPY path), completed
// jobs not retained.
type riverSystem struct {
	pool    *pgxpool.Pool
	schema  string
	workers int
	ins     *river.Client[pgx.Tx] // insert-only client
}

type riverArgs struct {
	ID int `json:"id"`
}

func (riverArgs) Kind() string { return "bench" }

type riverWorker struct {
	river.WorkerDefaults[riverArgs]
	h handlerFunc
}

func (w *riverWorker) Work(ctx context.Context, job *river.Job[riverArgs]) error {
	return w.h(ctx, job.Args.ID)
}

func (s *riverSystem) name() string { return "river" }

func (s *riverSystem) prepare(ctx context.Context) error {
	if _, err := s.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s.schema+" CASCADE; CREATE SCHEMA "+s.schema); err != nil {
		return err
	}
	m, err := rivermigrate.New(riverpgxv5.New(s.pool), &rivermigrate.Config{Schema: s.schema})
	if err != nil {
		return err
	}
	if _, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return err
	}
	s.ins, err = river.NewClient(riverpgxv5.New(s.pool), &river.Config{Schema: s.schema, Logger: quietLogger()})
	return err
}

func (s *riverSystem) client(h handlerFunc) (*river.Client[pgx.Tx], error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &riverWorker{h: h})
	return river.NewClient(riverpgxv5.New(s.pool), &river.Config{
		Schema:                      s.schema,
		Queues:                      map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: s.workers}},
		Workers:                     workers,
		FetchCooldown:               river.FetchCooldownMin,
		FetchPollInterval:           10 * time.Millisecond,
		CompletedJobRetentionPeriod: time.Second,
		Logger:                      quietLogger(),
	})
}

func (s *riverSystem) enqueue(ctx context.Context, ids []int) error {
	c := s.ins
	params := make([]river.InsertManyParams, 0, 1000)
	flush := func() error {
		if len(params) == 0 {
			return nil
		}
		_, err := c.InsertManyFast(ctx, params)
		params = params[:0]
		return err
	}
	for _, id := range ids {
		params = append(params, river.InsertManyParams{Args: riverArgs{ID: id}, InsertOpts: &river.InsertOpts{MaxAttempts: 1}})
		if len(params) == cap(params) {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

func (s *riverSystem) start(ctx context.Context, h handlerFunc) (func(), error) {
	c, err := s.client(h)
	if err != nil {
		return nil, err
	}
	if err := c.Start(ctx); err != nil {
		return nil, err
	}
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = c.Stop(sctx)
	}, nil
}

func (s *riverSystem) close() {}

func schemaName(prefix string) string { return fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1e9) }
