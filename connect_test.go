package onceflow_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
)

func TestRedisOptionsDefaults(t *testing.T) {
	t.Parallel()
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

// CheckRedis accepts the clients NewRedis and NewRedisCluster build (the failover client
// of a Sentinel URL too), and refuses go-redis's defaults, which go-redis normalises
// when it builds the client: on a *redis.Client MaxRetries 0 becomes 3 and -1 becomes 0;
// on a *redis.ClusterClient MaxRetries 0 becomes -1 (the nodes do not retry) but
// MaxRedirects 0 becomes 3, and the cluster client's redirect loop also re-sends a
// command after a network error. A Sentinel URL that sets max_retries=3 is refused as a
// plain one is.
func TestCheckRedisAcceptsWhatNewRedisBuildsAndRefusesDefaults(t *testing.T) {
	t.Parallel()
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
	ourSentinel, err := onceflow.NewRedis("redis://" + addr + "?master_name=m")
	if err != nil {
		t.Fatal(err)
	}
	retriesInSentinelURL, err := onceflow.NewRedis("redis://" + addr + "?master_name=m&max_retries=3")
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
		{"NewRedis, a Sentinel URL", ourSentinel, true},
		{"NewClusterClient(RedisClusterOptions)", redis.NewClusterClient(mustCluster(onceflow.RedisClusterOptions("redis://" + addr))), true},
		{"hand-built, no retries", redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, MaxRetries: -1}), true},
		{"hand-built cluster, no retries", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}, ContextTimeoutEnabled: true, MaxRedirects: -1}), true},

		{"go-redis defaults", redis.NewClient(&redis.Options{Addr: addr}), false},
		{"context timeout, default retries", redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true}), false},
		{"no retries, no context timeout", redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1}), false},
		{"max_retries in the URL", redis.NewClient(retriesInURL), false},
		{"max_retries in a Sentinel URL", retriesInSentinelURL, false},
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

// A Sentinel URL whose client would talk to a replica (replica_only=true, or
// use_disconnected_replicas=true: options redis.ParseFailoverURL accepts) is refused
// before it is used, like max_retries=3: PING would answer, so /readyz and the breakers
// would report Redis healthy while every write failed with READONLY.
func TestNewRedisRefusesReplicaSentinelURLs(t *testing.T) {
	t.Parallel()
	for _, option := range []string{"replica_only=true", "use_disconnected_replicas=true"} {
		rdb, err := onceflow.NewRedis("redis://127.0.0.1:26379?master_name=m&" + option)
		if err != nil {
			continue // refused when the URL is read
		}
		err = onceflow.CheckRedis(rdb)
		_ = rdb.Close()
		if !errors.Is(err, onceflow.ErrRedisOptions) {
			t.Errorf("%s: accepted by NewRedis and CheckRedis (%v)", option, err)
		}
	}
}

// PingRedis checks every primary a client talks to: its error names each node that did
// not answer, and matches ErrSomeRedisNodesDown only when others did (which /readyz
// reports as degraded, not down).
func TestPingRedisNamesEachNodeThatDoesNotAnswer(t *testing.T) {
	t.Parallel()
	// A plain client whose Redis is down: an error, not ErrSomeRedisNodesDown.
	t.Run("a plain client whose Redis is down", func(t *testing.T) {
		t.Parallel()
		rdb, err := onceflow.NewRedis(fmt.Sprintf("redis://127.0.0.1:%d/0", testenv.FreePort(t)))
		if err != nil {
			t.Fatal(err)
		}
		defer rdb.Close()
		err = onceflow.PingRedis(context.Background(), rdb)
		if err == nil || errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
			t.Fatalf("PingRedis = %v, want an error that is not ErrSomeRedisNodesDown", err)
		}
	})
	// A cluster client whose slot map cannot load (no seed answers): an error, not
	// ErrSomeRedisNodesDown.
	t.Run("a cluster whose slot map cannot load", func(t *testing.T) {
		t.Parallel()
		rdb, err := onceflow.NewRedisCluster(fmt.Sprintf("redis://127.0.0.1:%d", testenv.FreePort(t)))
		if err != nil {
			t.Fatal(err)
		}
		defer rdb.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		err = onceflow.PingRedis(ctx, rdb)
		if err == nil || errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
			t.Fatalf("PingRedis = %v, want an error that is not ErrSomeRedisNodesDown", err)
		}
	})
	// A cluster of 3 primaries (no replica to take over): all up is nil; one killed is
	// an error naming it, and only it, that matches ErrSomeRedisNodesDown, since the other
	// primaries' partitions still work; every one killed after the client loaded its slot
	// map is an error naming each that does not (/readyz 503, breaker open).
	t.Run("a cluster's primaries going down one, then all", func(t *testing.T) {
		t.Parallel()
		c := testenv.PrivateRedisCluster(t, 3, 0)
		rdb, err := onceflow.NewRedisCluster("redis://" + c.Addrs()[0])
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rdb.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := onceflow.PingRedis(ctx, rdb); err != nil {
			t.Fatalf("every primary up: %v", err)
		}
		c.Nodes[2].Kill()
		err = onceflow.PingRedis(ctx, rdb)
		if !errors.Is(err, onceflow.ErrSomeRedisNodesDown) || !strings.Contains(err.Error(), c.Addrs()[2]) {
			t.Fatalf("one primary killed: %v, want ErrSomeRedisNodesDown naming %s", err, c.Addrs()[2])
		}
		for _, n := range c.Addrs()[:2] {
			if strings.Contains(err.Error(), n) {
				t.Fatalf("%v names %s, which answers", err, n)
			}
		}
		for _, n := range c.Nodes[:2] {
			n.Kill()
		}
		err = onceflow.PingRedis(ctx, rdb)
		if err == nil || errors.Is(err, onceflow.ErrSomeRedisNodesDown) {
			t.Fatalf("all killed: PingRedis = %v, want an error that is not ErrSomeRedisNodesDown", err)
		}
		for _, a := range c.Addrs() {
			if !strings.Contains(err.Error(), a) {
				t.Errorf("error %v does not name %s", err, a)
			}
		}
	})
}

// nodeUp reads onceflow_redis_node_up from reg: node address -> value.
func nodeUp(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "onceflow_redis_node_up" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "node" {
					out[l.GetValue()] = m.GetGauge().GetValue()
				}
			}
		}
	}
	return out
}

// onceflow_redis_node_up on a cluster of 3 primaries with a replica each: 1 for each
// primary; a primary killed is 0 until its replica takes over, and then the old
// primary's series is dropped and the promoted replica's is 1.
func TestRedisNodeUpGaugeFollowsFailover(t *testing.T) {
	testenv.Long(t) // a Redis Cluster of six processes and a failover
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 1)
	rdb, err := onceflow.NewRedisCluster("redis://" + c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	e := newDBEnv(t)
	reg := prometheus.NewRegistry()
	var runs atomic.Int64
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: e.pool, Prefix: testenv.Prefix(t), Logger: testenv.Logger(t),
		Workers: refundWorkers(&runs), Registerer: reg, HealthInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, cl)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var primaries []string
	for ctx.Err() == nil {
		up := nodeUp(t, reg)
		n := 0
		for _, v := range up {
			if v == 1 {
				n++
			}
		}
		if n == 3 && len(up) == 3 {
			for a := range up {
				primaries = append(primaries, a)
			}
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(primaries) != 3 {
		t.Fatalf("node_up never showed 3 primaries up: %v", nodeUp(t, reg))
	}
	victim := primaries[0]
	killed := false
	for i, n := range c.Nodes {
		if c.Addrs()[i] == victim {
			n.Kill()
			killed = true
		}
	}
	if !killed {
		t.Fatalf("no node at %s among %v", victim, c.Addrs())
	}
	sawZero := false
	for ctx.Err() == nil {
		up := nodeUp(t, reg)
		if v, ok := up[victim]; ok && v == 0 {
			sawZero = true
		}
		ones := 0
		for _, v := range up {
			if v == 1 {
				ones++
			}
		}
		if _, ok := up[victim]; !ok && ones == 3 && len(up) == 3 {
			if !sawZero {
				t.Logf("the killed primary's 0 was never seen (failover faster than 100ms polls)")
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("after failover node_up = %v; want the killed %s dropped and 3 primaries at 1 (saw 0: %v)", nodeUp(t, reg), victim, sawZero)
}

// A Sentinel-managed primary (ONCEFLOW_REDIS_URL with master_name: go-redis's failover
// client) killed with SIGKILL while keyed jobs are accepted with WaitReplicas 1: the
// sentinels promote the replica, the restarted old primary becomes its replica, and
// every job the client saw accepted (each retried with its key until it was) runs and
// commits once: no accepted job lost, no effect twice.
func TestSentinelFailoverLosesNoAcceptedJob(t *testing.T) {
	testenv.Long(t) // Redis primaries, replicas and sentinels as processes, and a failover
	t.Parallel()
	dir, err := os.MkdirTemp("", "onceflow-sentinel-")
	if err != nil {
		t.Fatal(err)
	}
	s, err := cluster.NewRedisSentinel(dir, 1, 3, "always")
	if err != nil {
		t.Fatalf("sentinel: %v (run `make test`, which installs what it needs)", err)
	}
	t.Cleanup(func() { s.Kill(); _ = os.RemoveAll(dir) })
	if err := s.Up(); err != nil {
		t.Fatal(err)
	}
	rdb, err := onceflow.NewRedis(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	e := newDBEnv(t)
	var runs atomic.Int64
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: e.pool, Prefix: testenv.Prefix(t), Logger: testenv.Logger(t),
		Workers: refundWorkers(&runs), WaitReplicas: 1, WaitTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	ctx := context.Background()
	first, err := s.PrimaryAddr(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const jobs = 60
	accepted := map[string]bool{}
	retries := 0
	restarted := make(chan error, 1)
	var promoted string // the primary the sentinels promoted, as first seen
	for i := range jobs {
		if i == jobs/3 {
			s.Primary.Kill()
			// Once the sentinels have promoted the replica, the old primary comes back
			// and they make it the new primary's replica: WAIT 1 can be met again.
			// Meanwhile accepts answer "not replicated" and are retried.
			go func() {
				for {
					if now, err := s.PrimaryAddr(ctx); err == nil && now != first {
						promoted = now
						restarted <- s.Primary.Up()
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}()
		}
		key := "refund-" + strconv.Itoa(i)
		deadline := time.Now().Add(60 * time.Second)
		for {
			res, err := c.Enqueue(ctx, refundArgs{OrderID: key, AmountCents: 100 + i}, &onceflow.EnqueueOpts{Tenant: "acme", Key: key})
			if err == nil {
				accepted[res.JobID] = true
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("job %d not accepted within 60s of retries: %v", i, err)
			}
			retries++
			time.Sleep(100 * time.Millisecond)
		}
	}
	select {
	case err := <-restarted:
		if err != nil {
			t.Fatalf("restarting the old primary: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("no failover within a minute")
	}
	// The failover is the one the goroutine saw (read after its send on restarted):
	// the sentinels may move the primary again once the old one is back, so reading it
	// now would say nothing about whether the accepts went through a failover.
	if promoted == "" || promoted == first {
		t.Fatalf("the primary %s was never replaced (promoted %q): no failover happened", first, promoted)
	}
	testenv.WaitFor(t, 60*time.Second, "every accepted job committed", func() bool {
		return e.count(`SELECT count(*) FROM refunds`) == len(accepted)
	})
	for id := range accepted {
		if completions, refunds, _ := e.effects(id); completions != 1 || refunds != 1 {
			t.Fatalf("job %s: %d completions, %d refunds; want 1 and 1", id, completions, refunds)
		}
	}
	if n := e.count(`SELECT count(*) FROM refunds`); n != jobs {
		t.Fatalf("%d refunds for %d keys", n, jobs)
	}
	t.Logf("failover %s -> %s; %d accepts retried; %d runs for %d jobs", first, promoted, retries, runs.Load(), jobs)
}

func TestPostgresConfigDefaults(t *testing.T) {
	t.Parallel()
	cfg, err := onceflow.PostgresConfig("postgres://u:pw@127.0.0.1:5432/db")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxConns != onceflow.DefaultPostgresMaxConns || cfg.ConnConfig.ConnectTimeout != onceflow.DefaultPostgresConnectTimeout {
		t.Fatalf("max conns %d, connect timeout %v", cfg.MaxConns, cfg.ConnConfig.ConnectTimeout)
	}
	cfg, err = onceflow.PostgresConfig("postgres://u:pw@127.0.0.1:5432/db?pool_max_conns=4&connect_timeout=9")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxConns != 4 || cfg.ConnConfig.ConnectTimeout != 9*time.Second {
		t.Fatalf("URL settings not kept: max conns %d, connect timeout %v", cfg.MaxConns, cfg.ConnConfig.ConnectTimeout)
	}
	_, err = onceflow.PostgresConfig("postgres://u:hunter2secret@127.0.0.1:5432/db?pool_max_conns=many")
	if err == nil || strings.Contains(err.Error(), "hunter2secret") {
		t.Fatalf("bad URL error %v leaks the password or is missing", err)
	}
}

// Every session gets a statement timeout (so a stuck statement cannot hold a job for
// ever), unless the URL sets its own.
func TestPostgresSessionsHaveStatementTimeouts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	show := func(url, setting string) string {
		t.Helper()
		pool, err := onceflow.NewPostgres(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		var v string
		if err := pool.QueryRow(ctx, "SHOW "+setting).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	url := testenv.DatabaseURL(t)
	if got := show(url, "statement_timeout"); got != "30s" {
		t.Errorf("statement_timeout = %q, want 30s", got)
	}
	if got := show(url, "idle_in_transaction_session_timeout"); got != "1min" {
		t.Errorf("idle_in_transaction_session_timeout = %q, want 1min", got)
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	if got := show(url+sep+"statement_timeout=5000", "statement_timeout"); got != "5s" {
		t.Errorf("statement_timeout with the URL's 5000 = %q, want 5s", got)
	}
}

func TestNewPostgresConnects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := onceflow.NewPostgres(ctx, testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if got := pool.Config().MaxConns; got != onceflow.DefaultPostgresMaxConns {
		t.Fatalf("MaxConns = %d", got)
	}
	var one int
	if err := pool.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1 = %d, %v", one, err)
	}
}
