package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a Redis Cluster of one's own on loopback, for tests, the demo and the
// chaos suite: primaries and replicas, each a redis-server on a free port with
// cluster-enabled and its data under its own folder, created with
// `redis-cli --cluster create` (what an operator runs). Its nodes may be stopped, killed
// and restarted one at a time like any Server.
type RedisCluster struct {
	// Nodes are the servers, the first Primaries of them created as primaries, the rest
	// as their replicas (which primary each follows is redis-cli's choice).
	Nodes     []*Server
	Primaries int
	// NodeTimeout is the cluster-node-timeout: how long a primary may be unreachable
	// before its replica is promoted.
	NodeTimeout time.Duration

	// node prepares node i on port and bus port.
	node func(i, port, bus int) (*Server, error)
	// formed says the cluster was created: its nodes' addresses are in its config.
	formed bool
}

// NewRedisCluster prepares (does not start) a cluster of primaries primaries with
// replicas replicas each, its nodes' data under dir/node-N, AOF on with appendfsync,
// and a node timeout of nodeTimeout (default 2s: failovers in tests take seconds, not
// the 15 s of Redis's default). Call Up to start and create it.
func NewRedisCluster(dir string, primaries, replicas int, appendfsync string, nodeTimeout time.Duration) (*RedisCluster, error) {
	if primaries < 3 {
		return nil, errors.New("cluster: a Redis Cluster needs at least 3 primaries")
	}
	if nodeTimeout <= 0 {
		nodeTimeout = 2 * time.Second
	}
	c := &RedisCluster{Primaries: primaries, NodeTimeout: nodeTimeout}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not found: run scripts/dev-services up, which installs it")
	}
	nodes := primaries * (1 + replicas)
	// Every node's port and bus port, all distinct. The bus port is a free one of its
	// own: by default it is the port plus 10000, which may be taken, or past 65535 for a
	// port from the upper ephemeral range.
	ports, err := FreePorts(2 * nodes)
	if err != nil {
		return nil, err
	}
	c.node = func(i, port, bus int) (*Server, error) {
		s, err := newRedisOn(bin, filepath.Join(dir, "node-"+strconv.Itoa(i)), appendfsync, port)
		if err != nil {
			return nil, err
		}
		s.Name = "redis-node-" + strconv.Itoa(i)
		s.Args = append(s.Args, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-port", strconv.Itoa(bus),
			"--cluster-node-timeout", strconv.FormatInt(nodeTimeout.Milliseconds(), 10),
			// A replica of a primary that was down takes over even if it lagged: the
			// loss window of asynchronous replication is what the tests measure.
			"--cluster-replica-validity-factor", "0")
		return s, nil
	}
	for i := range nodes {
		s, err := c.node(i, ports[2*i], ports[2*i+1])
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, s)
	}
	return c, nil
}

// Addrs returns every node's host:port.
func (c *RedisCluster) Addrs() []string {
	out := make([]string, len(c.Nodes))
	for i, s := range c.Nodes {
		out[i] = "127.0.0.1:" + strconv.Itoa(s.Port)
	}
	return out
}

// Up starts every node and, the first time, creates the cluster (redis-cli --cluster
// create); then it waits until every node reports cluster_state:ok.
func (c *RedisCluster) Up() error {
	for i, s := range c.Nodes {
		err := s.Up()
		// Before the cluster is formed, a node that could not start (its port taken by
		// another process since it was chosen) gets new ports.
		for try := 0; err != nil && !c.formed && c.node != nil && try < 3; try++ {
			ports, perr := FreePorts(2)
			if perr != nil {
				return perr
			}
			if s, perr = c.node(i, ports[0], ports[1]); perr != nil {
				return perr
			}
			c.Nodes[i] = s
			err = s.Up()
		}
		if err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	created, err := c.created(ctx)
	if err != nil {
		return err
	}
	if !created {
		args := append([]string{"--cluster", "create"}, c.Addrs()...)
		args = append(args, "--cluster-replicas", strconv.Itoa(len(c.Nodes)/c.Primaries-1), "--cluster-yes")
		out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput() // #nosec G204 -- our own loopback addresses
		if err != nil {
			return fmt.Errorf("redis-cli --cluster create: %v: %s", err, out)
		}
	}
	c.formed = true
	return c.WaitOK(ctx)
}

// created reports whether the nodes already form a cluster (a restart of Up).
func (c *RedisCluster) created(ctx context.Context) (bool, error) {
	info, err := c.info(ctx, c.Nodes[0])
	if err != nil {
		return false, err
	}
	return !strings.Contains(info, "cluster_known_nodes:1\r\n"), nil
}

func (c *RedisCluster) info(ctx context.Context, s *Server) (string, error) {
	cl := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(s.Port), MaxRetries: -1})
	defer cl.Close()
	return cl.ClusterInfo(ctx).Result()
}

// WaitOK waits until every running node reports cluster_state:ok and knows every node
// and, when every node runs, every replica is connected to its primary (so that WAIT
// can be answered), until ctx ends.
func (c *RedisCluster) WaitOK(ctx context.Context) error {
	want := "cluster_known_nodes:" + strconv.Itoa(len(c.Nodes)) + "\r\n"
	for {
		ok, all := true, true
		var last string
		replicas := 0
		for _, s := range c.Nodes {
			if !s.Running() {
				all = false
				continue
			}
			info, err := c.info(ctx, s)
			if err != nil || !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, want) {
				ok, last = false, fmt.Sprintf("%s: %v %q", s.Name, err, firstLine(info))
				break
			}
			replicas += c.connectedReplicas(ctx, s)
		}
		if ok && all && replicas < len(c.Nodes)-c.Primaries {
			ok, last = false, fmt.Sprintf("%d of %d replicas connected", replicas, len(c.Nodes)-c.Primaries)
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not ok: %s: %w", last, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\r\n")
	return line
}

// Kill kills every node.
func (c *RedisCluster) Kill() {
	for _, s := range c.Nodes {
		s.Kill()
	}
}

// connectedReplicas returns how many replicas a primary lists as connected (ROLE); 0
// for a replica.
func (c *RedisCluster) connectedReplicas(ctx context.Context, s *Server) int {
	cl := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(s.Port), MaxRetries: -1})
	defer cl.Close()
	role, err := cl.Do(ctx, "ROLE").Slice()
	if err != nil || len(role) < 3 || role[0] != "master" {
		return 0
	}
	list, _ := role[2].([]any)
	return len(list)
}

// MoveSlot migrates hash slot slot, with its keys, to the primary at to (host:port), the
// way `redis-cli --cluster reshard` moves each slot: the target marks it IMPORTING and
// the source MIGRATING, the keys move in batches with MIGRATE (meanwhile a command for a
// key already moved is answered ASK, one for several keys split across the two
// TRYAGAIN), and then every primary learns the slot's new owner. It returns the number
// of keys moved.
func (c *RedisCluster) MoveSlot(ctx context.Context, slot int, to string) (int, error) {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRedirects: -1})
	defer cc.Close()
	var src, dst *redis.Client
	var srcID, dstID string
	var masters []*redis.Client
	defer func() {
		for _, m := range masters {
			_ = m.Close()
		}
	}()
	shards, err := cc.ClusterShards(ctx).Result()
	if err != nil {
		return 0, err
	}
	for _, sh := range shards {
		for _, n := range sh.Nodes {
			if n.Role != "master" || n.Health != "online" {
				continue
			}
			addr := net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10))
			m := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
			masters = append(masters, m)
			for _, r := range sh.Slots {
				if int64(slot) >= r.Start && int64(slot) <= r.End {
					src, srcID = m, n.ID
				}
			}
			if addr == to {
				dst, dstID = m, n.ID
			}
		}
	}
	switch {
	case src == nil || dst == nil:
		return 0, fmt.Errorf("move slot %d to %s: no such primaries", slot, to)
	case srcID == dstID:
		return 0, nil
	}
	if err := dst.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", srcID).Err(); err != nil {
		return 0, fmt.Errorf("move slot %d: importing: %w", slot, err)
	}
	if err := src.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", dstID).Err(); err != nil {
		return 0, fmt.Errorf("move slot %d: migrating: %w", slot, err)
	}
	host, port, err := net.SplitHostPort(to)
	if err != nil {
		return 0, err
	}
	moved := 0
	for {
		keys, err := src.ClusterGetKeysInSlot(ctx, slot, 100).Result()
		if err != nil {
			return moved, fmt.Errorf("move slot %d: keys: %w", slot, err)
		}
		if len(keys) == 0 {
			break
		}
		args := []any{"MIGRATE", host, port, "", 0, 10000, "KEYS"}
		for _, k := range keys {
			args = append(args, k)
		}
		if err := src.Do(ctx, args...).Err(); err != nil {
			return moved, fmt.Errorf("move slot %d: migrate: %w", slot, err)
		}
		moved += len(keys)
	}
	// The target first, then the source, then the others (as redis-cli does).
	for _, m := range append([]*redis.Client{dst, src}, masters...) {
		if err := m.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", dstID).Err(); err != nil {
			return moved, fmt.Errorf("move slot %d: assign: %w", slot, err)
		}
	}
	return moved, nil
}
