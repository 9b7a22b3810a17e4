package redisstore

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// On a server without replicas, WaitReplicas 1 cannot be met: the accept writes (the
// job is on the primary) and answers ErrNotReplicated after WaitTimeout, and so does a
// retry, which replays without a second enqueue.
func TestAcceptWithoutEnoughReplicasIsNotConfirmed(t *testing.T) {
	t.Parallel()
	f, _ := newAcceptFixture(t, Config{WaitReplicas: 1, WaitTimeout: 50 * time.Millisecond})
	ctx := context.Background()
	for range 2 {
		_, _, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1))
		if !errors.Is(err, ErrNotReplicated) {
			t.Fatalf("accept with no replica: %v, want ErrNotReplicated", err)
		}
	}
	if n := f.xlen(t); n != 1 {
		t.Fatalf("%d entries, want the one write", n)
	}
}

// On a Redis Cluster with a replica per primary, an accept through a client seeded
// with any node waits for the replica of its slot's primary and is confirmed; once the
// replicas are down, it is not.
func TestAcceptWaitsForTheReplicaOnACluster(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rdb, err := connect.RedisCluster("redis://" + c.Addrs()[len(c.Addrs())-1])
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	s, err := New(rdb, Config{Prefix: testenv.Prefix(t), WaitReplicas: 1, WaitTimeout: 2 * time.Second}) // 200ms was not always enough for a live replica under make test's load
	if err != nil {
		t.Fatal(err)
	}
	f := &acceptFixture{s: s, stream: s.cfg.Prefix + ":{summaries}:stream", index: s.cfg.Prefix + ":{summaries}:job:11111111-2222-5333-8444-555555555555"}
	if _, replayed, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1)); err != nil || replayed {
		t.Fatalf("accept with its replica up: replayed %v, %v", replayed, err)
	}
	if _, replayed, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1)); err != nil || !replayed {
		t.Fatalf("replay with its replica up: replayed %v, %v", replayed, err)
	}
	// Replicas that stop acknowledging (SIGSTOP: connected, silent) hold back a replay
	// too, although it writes nothing: the record it reads may be on the primary alone.
	// (Debian's Redis 7.0 makes WAIT cover the offset at the connection's last command
	// of any kind, so this holds there without the marker key too; servers that count
	// only the connection's own writes need the marker runAccept writes.)
	replicas := c.Nodes[c.Primaries:]
	signal := func(sig syscall.Signal) {
		for _, n := range replicas {
			if err := syscall.Kill(n.Pid(), sig); err != nil {
				t.Fatal(err)
			}
		}
	}
	signal(syscall.SIGSTOP)
	freshClient := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1})
	defer freshClient.Close()
	fresh, err := New(freshClient, Config{Prefix: s.cfg.Prefix, WaitReplicas: 1, WaitTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ff := &acceptFixture{s: fresh, stream: f.stream, index: f.index}
	if _, _, err := ff.s.Accept(ctx, testScope, testFP, accepted(), ff.enqueue(body1)); !errors.Is(err, ErrNotReplicated) {
		signal(syscall.SIGCONT)
		t.Fatalf("replay on a fresh connection with the replicas stopped: %v, want ErrNotReplicated", err)
	}
	signal(syscall.SIGCONT)
	testenv.WaitFor(t, 10*time.Second, "the replay confirmed again", func() bool {
		_, replayed, err := ff.s.Accept(ctx, testScope, testFP, accepted(), ff.enqueue(body1))
		return err == nil && replayed
	})
	for _, n := range replicas {
		n.Crash()
	}
	scope := testScope
	scope.Key = "another-key-0001"
	if _, _, err := f.s.Accept(ctx, scope, testFP, accepted(), f.enqueue(body1)); !errors.Is(err, ErrNotReplicated) {
		t.Fatalf("accept with the replicas down: %v, want ErrNotReplicated", err)
	}
}
