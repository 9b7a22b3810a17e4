package onceflow

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// redisUnreachable tells Redis's outages from failing commands, on errors produced by a
// real server: stopped, turned into a replica (READONLY, MASTERDOWN), out of memory
// (OOM), killing the client's connection, and commands that fail on their own account.
func TestRedisUnreachableClassifiesRealErrors(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv := testenv.PrivateRedis(t)
	open := func() *redis.Client {
		t.Helper()
		rdb, err := NewRedis(testenv.RedisURLOf(srv))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rdb.Close() })
		return rdb
	}
	rdb, admin := open(), open()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	type row struct {
		name string
		err  error
		want bool
	}
	var rows []row
	add := func(name string, err error, want bool) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: no error", name)
		}
		rows = append(rows, row{name, err, want})
	}
	keys := queue.Keys{Prefix: "t", Queue: "q"}
	enqueue := func(c *redis.Client) error {
		_, err := queue.Enqueue(ctx, c, keys, queue.Message{JobID: "j", Kind: "k", Payload: []byte(`{}`), EnqueuedAt: time.Now()})
		return err
	}

	// Commands that fail on their own account.
	must(rdb.Set(ctx, "str", "x", 0).Err())
	add("wrong type", rdb.LPush(ctx, "str", "x").Err(), false)
	add("script error", rdb.Eval(ctx, `return redis.error_reply('boom')`, nil).Err(), false)
	add("unknown command", rdb.Do(ctx, "NOSUCHCOMMAND").Err(), false)
	add("no script", rdb.EvalSha(ctx, "0000000000000000000000000000000000000000", nil).Err(), false)
	done, stop := context.WithCancel(ctx)
	stop()
	add("the caller's cancel", rdb.Ping(done).Err(), false)
	closed := open()
	must(closed.Close())
	add("a closed client", closed.Ping(ctx).Err(), false)

	// Redis cannot take writes: a replica of a master that is down, out of memory.
	must(admin.Do(ctx, "REPLICAOF", "127.0.0.1", testenv.FreePort(t)).Err())
	add("READONLY", enqueue(rdb), true)
	must(admin.ConfigSet(ctx, "replica-serve-stale-data", "no").Err())
	add("MASTERDOWN", rdb.Get(ctx, "str").Err(), true)
	must(admin.ConfigSet(ctx, "replica-serve-stale-data", "yes").Err())
	must(admin.Do(ctx, "REPLICAOF", "NO", "ONE").Err())
	must(admin.ConfigSet(ctx, "maxmemory", "1").Err())
	add("OOM", enqueue(rdb), true)
	must(admin.ConfigSet(ctx, "maxmemory", "0").Err())

	// The server drops the connection, then stops.
	blocked := make(chan error, 1)
	go func() { blocked <- rdb.BLPop(ctx, 30*time.Second, "nothing").Err() }()
	testenv.WaitFor(t, 10*time.Second, "the blocked client", func() bool {
		n, err := admin.Info(ctx, "clients").Result()
		return err == nil && strings.Contains(n, "blocked_clients:1")
	})
	must(admin.ClientKillByFilter(ctx, "TYPE", "normal", "SKIPME", "yes").Err())
	add("connection killed mid-command", <-blocked, true)
	srv.Stop()
	add("server stopped, pooled connection", enqueue(admin), true)
	add("server stopped, new connection", enqueue(open()), true)
	add("server stopped, keyed accept", func() error {
		c, err := NewClient(Config{Redis: open(), Prefix: "t", Logger: testenv.Logger(t)})
		must(err)
		_, err = c.Enqueue(ctx, sortArgs{}, &EnqueueOpts{Key: "key-1"})
		return err
	}(), true)
	srv.Start()

	for _, r := range rows {
		t.Logf("%s: %T: %v", r.name, r.err, r.err)
		if got := redisUnreachable(r.err); got != r.want {
			t.Errorf("%s: redisUnreachable(%T %v) = %v, want %v", r.name, r.err, r.err, got, r.want)
		}
	}
	if redisUnreachable(nil) {
		t.Error("nil is an outage")
	}
}

// sendEnqueue marks a Redis outage Unavailable for the relay, once, and leaves a
// permanent verdict as it is.
func TestSendEnqueueMarksRedisOutagesUnavailable(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := NewRedis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	c, err := NewClient(Config{Redis: rdb, Prefix: "t", Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	row := func(key string) outbox.Message {
		return outbox.Message{Topic: TopicEnqueue, DedupeKey: "enqueue:j", Payload: []byte(
			`{"queue":"default","key":"` + key + `","job_id":"00000000-0000-4000-8000-000000000001","kind":"k","args":"{}","enqueued_at":1}`)}
	}
	ctx := context.Background()
	srv.Stop()
	for _, key := range []string{"", "key-1"} {
		err := c.sendEnqueue(ctx, row(key))
		if !errors.Is(err, outbox.ErrUnavailable) || retry.IsPermanent(err) {
			t.Errorf("key %q, Redis stopped: %v, want Unavailable", key, err)
		}
		var once interface{ Unwrap() error }
		if errors.As(err, &once) && errors.Is(once.Unwrap(), outbox.ErrUnavailable) {
			t.Errorf("key %q: %v marked Unavailable twice", key, err)
		}
	}
	if err := c.sendEnqueue(ctx, outbox.Message{Topic: TopicEnqueue, Payload: []byte(`not json`)}); !retry.IsPermanent(err) || errors.Is(err, outbox.ErrUnavailable) {
		t.Errorf("undecodable row with Redis stopped: %v, want permanent only", err)
	}
}

// sortArgs is a job kind for the tests of this package.
type sortArgs struct{}

func (sortArgs) Kind() string { return "sort" }
