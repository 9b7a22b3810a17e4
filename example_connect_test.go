package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
)

// A Redis client with the settings onceflow's guarantees depend on: calls end at their
// context's deadline, and go-redis never re-sends a command on its own.
func ExampleNewRedis() {
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL")) // redis://host:6379/0
	if err != nil {
		panic(err)
	}
	defer rdb.Close()

	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb})
	if err != nil {
		panic(err)
	}
	fmt.Println(client.Inspector().Queues(), rdb.Ping(context.Background()).Val())
	// Output: [default] PONG
}

// Tune the client (here its pool size) from onceflow's options rather than go-redis's
// defaults, which NewClient refuses.
func ExampleRedisOptions() {
	opt, err := onceflow.RedisOptions(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	opt.PoolSize = 100
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	fmt.Println("onceflow's options:", onceflow.CheckRedis(rdb))

	plain := redis.NewClient(&redis.Options{Addr: opt.Addr}) // go-redis defaults: 3 retries
	defer plain.Close()
	_, err = onceflow.NewClient(onceflow.Config{Redis: plain})
	fmt.Println("go-redis defaults refused:", errors.Is(err, onceflow.ErrRedisOptions))
	// Output:
	// onceflow's options: <nil>
	// go-redis defaults refused: true
}

// A Redis Cluster client: no command is re-sent by go-redis, not even by the redirect
// loop of the cluster client. Building it does not connect.
func ExampleRedisClusterOptions() {
	opt, err := onceflow.RedisClusterOptions("redis://10.0.0.1:7000?addr=10.0.0.2:7000&addr=10.0.0.3:7000")
	if err != nil {
		panic(err)
	}
	fmt.Println(opt.Addrs, opt.ContextTimeoutEnabled, opt.MaxRetries, opt.MaxRedirects)
	rdb := redis.NewClusterClient(opt)
	defer rdb.Close()
	fmt.Println(onceflow.CheckRedis(rdb))
	// Output:
	// [10.0.0.1:7000 10.0.0.2:7000 10.0.0.3:7000] true -1 -1
	// <nil>
}

// A PostgreSQL pool for Config.DB, connecting lazily.
func ExampleNewPostgres() {
	ctx := context.Background()
	pool, err := onceflow.NewPostgres(ctx, os.Getenv("ONCEFLOW_DATABASE_URL")) // postgres://user:pw@host/db
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	fmt.Println(pool.Config().MaxConns, pool.Ping(ctx))
	// Output: 32 <nil>
}

// CheckRedis names the setting that breaks a guarantee.
func ExampleCheckRedis() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true})
	defer rdb.Close()
	fmt.Println(onceflow.CheckRedis(rdb))
	// Output: onceflow: unsafe Redis client options: MaxRetries: the client re-sends commands 3 times on its own (go-redis's default, 0, means 3); set MaxRetries to -1, or build the client with onceflow.NewRedis
}

// A cluster client from a URL listing the seed nodes.
func ExampleNewRedisCluster() {
	rdb, err := onceflow.NewRedisCluster("redis://10.0.0.1:7000?addr=10.0.0.2:7000")
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	_, err = onceflow.NewClient(onceflow.Config{Redis: rdb})
	fmt.Println(err)
	// Output: <nil>
}

// Change the pool's configuration before opening it, here its size.
func ExamplePostgresConfig() {
	cfg, err := onceflow.PostgresConfig(os.Getenv("ONCEFLOW_DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	fmt.Println(pool.Config().MaxConns, pool.Config().ConnConfig.ConnectTimeout)
	// Output: 8 3s
}

// A Worker that reads its own tables returns their errors through PostgresError: a
// database that does not answer hands the job back without spending a delivery, a
// failing statement does not.
func ExamplePostgresError() {
	_, _, db, done := exampleStores(`CREATE TABLE tickets (id text PRIMARY KEY)`)
	defer done()
	ctx := context.Background()

	_, err := db.Exec(ctx, `INSERT INTO no_such_table VALUES (1)`)
	fmt.Println("failing statement, unavailable:", errors.Is(onceflow.PostgresError(err), onceflow.ErrUnavailable))

	down, _ := onceflow.NewPostgres(ctx, "postgres://app@127.0.0.1:1/app?connect_timeout=1") // nothing listens
	defer down.Close()
	_, err = down.Exec(ctx, `SELECT 1`)
	fmt.Println("database down, unavailable:", errors.Is(onceflow.PostgresError(err), onceflow.ErrUnavailable))
	// Output:
	// failing statement, unavailable: false
	// database down, unavailable: true
}
