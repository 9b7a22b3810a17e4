package onceflow_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

func TestRedisOptionsDefaults(t *testing.T) {
	opt, err := onceflow.RedisOptions("redis://127.0.0.1:16379/0")
	if err != nil {
		t.Fatal(err)
	}
	if !opt.ContextTimeoutEnabled || opt.MaxRetries != -1 || opt.DialTimeout != onceflow.DefaultRedisDialTimeout ||
		opt.ReadTimeout != onceflow.DefaultRedisIOTimeout || opt.WriteTimeout != onceflow.DefaultRedisIOTimeout {
		t.Fatalf("options: context timeout %v, max retries %d, dial %v, read %v, write %v",
			opt.ContextTimeoutEnabled, opt.MaxRetries, opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout)
	}
	opt, err = onceflow.RedisOptions("redis://127.0.0.1:16379/0?dial_timeout=7s&pool_size=3")
	if err != nil {
		t.Fatal(err)
	}
	if opt.DialTimeout != 7*time.Second || opt.PoolSize != 3 {
		t.Fatalf("URL options not kept: dial %v pool %d", opt.DialTimeout, opt.PoolSize)
	}
	_, err = onceflow.RedisOptions("redis://:hunter2secret@127.0.0.1:16379/notadb")
	if err == nil || strings.Contains(err.Error(), "hunter2secret") {
		t.Fatalf("bad URL error %v leaks the password or is missing", err)
	}

	copt, err := onceflow.RedisClusterOptions("redis://10.0.0.1:7000?addr=10.0.0.2:7000&addr=10.0.0.3:7000")
	if err != nil {
		t.Fatal(err)
	}
	if len(copt.Addrs) != 3 || !copt.ContextTimeoutEnabled || copt.MaxRetries != -1 || copt.MaxRedirects != -1 ||
		copt.DialTimeout != onceflow.DefaultRedisDialTimeout || copt.ReadTimeout != onceflow.DefaultRedisIOTimeout {
		t.Fatalf("cluster options: addrs %v, context timeout %v, max retries %d, max redirects %d, dial %v, read %v",
			copt.Addrs, copt.ContextTimeoutEnabled, copt.MaxRetries, copt.MaxRedirects, copt.DialTimeout, copt.ReadTimeout)
	}
	_, err = onceflow.RedisClusterOptions("redis://:hunter2secret@10.0.0.1:7000?nonsense=1")
	if err == nil || strings.Contains(err.Error(), "hunter2secret") {
		t.Fatalf("bad cluster URL error %v leaks the password or is missing", err)
	}
}

// CheckRedis accepts the clients NewRedis and NewRedisCluster build, and refuses
// go-redis's defaults, which go-redis normalises when it builds the client: on a
// *redis.Client MaxRetries 0 becomes 3 and -1 becomes 0; on a *redis.ClusterClient
// MaxRetries 0 becomes -1 (the nodes do not retry) but MaxRedirects 0 becomes 3, and the
// cluster client's redirect loop also re-sends a command after a network error.
func TestCheckRedisAcceptsWhatNewRedisBuildsAndRefusesDefaults(t *testing.T) {
	const addr = "127.0.0.1:1" // nothing connects: options are checked, not dialled
	mustOptions := func(o *redis.Options, err error) *redis.Options {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	mustCluster := func(o *redis.ClusterOptions, err error) *redis.ClusterOptions {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	retriesInURL := mustOptions(onceflow.RedisOptions("redis://" + addr + "?max_retries=2"))
	redirectsInURL := mustCluster(onceflow.RedisClusterOptions("redis://" + addr + "?max_redirects=3"))
	ours, err := onceflow.NewRedis("redis://" + addr)
	if err != nil {
		t.Fatal(err)
	}
	ourCluster, err := onceflow.NewRedisCluster("redis://" + addr)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		rdb  redis.UniversalClient
		ok   bool
	}{
		{"NewRedis", ours, true},
		{"NewClient(RedisOptions)", redis.NewClient(mustOptions(onceflow.RedisOptions("redis://" + addr))), true},
		{"NewRedisCluster", ourCluster, true},
		{"NewClusterClient(RedisClusterOptions)", redis.NewClusterClient(mustCluster(onceflow.RedisClusterOptions("redis://" + addr))), true},
		{"hand-built, no retries", redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, MaxRetries: -1}), true},
		{"hand-built cluster, no retries", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}, ContextTimeoutEnabled: true, MaxRedirects: -1}), true},

		{"go-redis defaults", redis.NewClient(&redis.Options{Addr: addr}), false},
		{"context timeout, default retries", redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true}), false},
		{"no retries, no context timeout", redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1}), false},
		{"max_retries in the URL", redis.NewClient(retriesInURL), false},
		{"universal client defaults", redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{addr}}), false},
		{"cluster defaults", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}}), false},
		{"cluster, context timeout, default redirects", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}, ContextTimeoutEnabled: true}), false},
		{"cluster, node retries", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}, ContextTimeoutEnabled: true, MaxRedirects: -1, MaxRetries: 2}), false},
		{"max_redirects in the URL", redis.NewClusterClient(redirectsInURL), false},
	}
	for _, tc := range cases {
		err := onceflow.CheckRedis(tc.rdb)
		_ = tc.rdb.Close()
		switch {
		case tc.ok && err != nil:
			t.Errorf("%s: refused: %v", tc.name, err)
		case !tc.ok && !errors.Is(err, onceflow.ErrRedisOptions):
			t.Errorf("%s: CheckRedis = %v, want ErrRedisOptions", tc.name, err)
		}
		if !tc.ok {
			if _, err := onceflow.NewClient(onceflow.Config{Redis: tc.rdb}); !errors.Is(err, onceflow.ErrRedisOptions) {
				t.Errorf("%s: NewClient = %v, want ErrRedisOptions", tc.name, err)
			}
		}
	}
}

// What the check protects, against a real Redis: a connection that breaks after XADD
// reached Redis and before its reply came back. A client with go-redis's retries sends
// the XADD again on a new connection, and the stream gets two entries; the clients
// NewRedis and RedisClusterOptions build report the failure, and the stream has one.
// (The cluster client runs against the plain test Redis as a one-node cluster, all
// slots on it, through ClusterSlots.)
func TestNoHiddenRetryOfXADDAfterABrokenConnection(t *testing.T) {
	t.Parallel()
	admin, prefix := testenv.Redis(t)
	url := testenv.RedisURL(t)
	base, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	oneNode := func(addr string) func(context.Context) ([]redis.ClusterSlot, error) {
		return func(context.Context) ([]redis.ClusterSlot, error) {
			return []redis.ClusterSlot{{Start: 0, End: 16383, Nodes: []redis.ClusterNode{{Addr: addr}}}}, nil
		}
	}
	cases := []struct {
		name    string
		client  func(addr string) redis.UniversalClient
		entries int64
	}{
		{"go-redis retries", func(addr string) redis.UniversalClient {
			o := *base
			o.Addr, o.ContextTimeoutEnabled = addr, true
			return redis.NewClient(&o)
		}, 2},
		{"NewRedis", func(addr string) redis.UniversalClient {
			c, err := onceflow.NewRedis(strings.Replace(url, base.Addr, addr, 1))
			if err != nil {
				t.Fatal(err)
			}
			return c
		}, 1},
		{"cluster redirect loop", func(addr string) redis.UniversalClient {
			return redis.NewClusterClient(&redis.ClusterOptions{ClusterSlots: oneNode(addr), ContextTimeoutEnabled: true})
		}, 2},
		{"RedisClusterOptions", func(addr string) redis.UniversalClient {
			o, err := onceflow.RedisClusterOptions("redis://" + addr)
			if err != nil {
				t.Fatal(err)
			}
			o.ClusterSlots = oneNode(addr)
			return redis.NewClusterClient(o)
		}, 1},
	}
	for i, tc := range cases {
		p := newCutProxy(t, base.Addr)
		rdb := tc.client(p.addr())
		stream := prefix + ":{q" + string(rune('a'+i)) + "}:stream"
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"job_id", "j1"}}).Err()
		cancel()
		_ = rdb.Close()
		if p.cuts.Load() != 1 {
			t.Fatalf("%s: the proxy cut %d connections, want 1 (err %v)", tc.name, p.cuts.Load(), err)
		}
		n, xerr := admin.XLen(context.Background(), stream).Result()
		if xerr != nil {
			t.Fatal(xerr)
		}
		if n != tc.entries {
			t.Errorf("%s: XADD err %v, %d stream entries, want %d", tc.name, err, n, tc.entries)
		}
		if tc.entries == 1 && err == nil {
			t.Errorf("%s: the broken connection was not reported", tc.name)
		}
	}
}

// cutProxy forwards TCP connections to a Redis server, and once breaks one: the first
// reply that follows an XADD is not forwarded, and the connection is closed, as when the
// network fails after the command reached Redis.
type cutProxy struct {
	ln       net.Listener
	upstream string
	armed    atomic.Bool // an XADD went through and no connection was cut yet
	cuts     atomic.Int32
	wg       sync.WaitGroup
}

func newCutProxy(t *testing.T, upstream string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, upstream: upstream}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(func() { _ = ln.Close(); p.wg.Wait() })
	return p
}

func (p *cutProxy) addr() string { return p.ln.Addr().String() }

func (p *cutProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.upstream)
		if err != nil {
			_ = c.Close()
			continue
		}
		closeBoth := func() { _ = c.Close(); _ = u.Close() }
		p.wg.Add(2)
		go func() { // client to Redis: arm the cut before Redis can answer the XADD
			defer p.wg.Done()
			defer closeBoth()
			buf := make([]byte, 32<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if p.cuts.Load() == 0 && bytes.Contains(bytes.ToLower(buf[:n]), []byte("xadd")) {
						p.armed.Store(true)
					}
					if _, werr := u.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
		go func() { // Redis to client: drop the reply to the XADD and break the connection
			defer p.wg.Done()
			defer closeBoth()
			buf := make([]byte, 32<<10)
			for {
				n, err := u.Read(buf)
				if n > 0 {
					if p.armed.CompareAndSwap(true, false) {
						p.cuts.Add(1)
						return
					}
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}
