package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMaster is the name the sentinels of NewRedisSentinel monitor their primary by.
const SentinelMaster = "onceflow"

// RedisSentinel is a Sentinel-managed Redis on loopback: a primary, its replicas and
// the sentinels that monitor it and promote a replica when it fails (down after 1 s,
// quorum 2). Create it with NewRedisSentinel, start it with Up.
type RedisSentinel struct {
	// Primary is the primary it started with; after a failover, a replica is primary
	// (PrimaryAddr).
	Primary   *Server
	Replicas  []*Server
	Sentinels []*Server
}

// NewRedisSentinel prepares (does not start) a primary with replicas replicas and
// sentinels sentinels (at least 2, for the quorum), their data under dir, AOF on with
// appendfsync.
func NewRedisSentinel(dir string, replicas, sentinels int, appendfsync string) (*RedisSentinel, error) {
	if sentinels < 2 {
		return nil, errors.New("cluster: a quorum of 2 needs at least 2 sentinels")
	}
	s := &RedisSentinel{}
	primary, err := NewRedis(filepath.Join(dir, "primary"), appendfsync)
	if err != nil {
		return nil, err
	}
	primary.Name = "redis-primary"
	s.Primary = primary
	for i := range replicas {
		r, err := NewRedis(filepath.Join(dir, "replica-"+strconv.Itoa(i)), appendfsync)
		if err != nil {
			return nil, err
		}
		r.Name = "redis-replica-" + strconv.Itoa(i)
		r.Args = append(r.Args, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
		s.Replicas = append(s.Replicas, r)
	}
	for i := range sentinels {
		sdir := filepath.Join(dir, "sentinel-"+strconv.Itoa(i))
		if err := os.MkdirAll(sdir, 0o750); err != nil {
			return nil, err
		}
		port, err := FreePort()
		if err != nil {
			return nil, err
		}
		// Sentinel rewrites its configuration file as it learns: it must be its own.
		conf := filepath.Join(sdir, "sentinel.conf")
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %d 2\n"+
			"sentinel down-after-milliseconds %[3]s 1000\nsentinel failover-timeout %[3]s 5000\nsentinel parallel-syncs %[3]s 1\n",
			port, sdir, SentinelMaster, primary.Port)
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			return nil, err
		}
		addr := "127.0.0.1:" + strconv.Itoa(port)
		s.Sentinels = append(s.Sentinels, &Server{
			Proc: &Proc{Name: "redis-sentinel-" + strconv.Itoa(i), Bin: primary.Bin, LogDir: sdir, Args: []string{conf, "--sentinel"}},
			Port: port, URL: "redis://" + addr, stopSig: syscall.SIGTERM, timeout: 30 * time.Second,
			ready: func(ctx context.Context) error {
				c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
				defer c.Close()
				return c.Ping(ctx).Err()
			},
		})
	}
	return s, nil
}

// Up starts the primary, the replicas and the sentinels, and waits until every replica
// is connected and every sentinel sees the primary.
func (s *RedisSentinel) Up() error {
	for _, srv := range append(append([]*Server{s.Primary}, s.Replicas...), s.Sentinels...) {
		if err := srv.Up(); err != nil {
			s.Kill()
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := redis.NewClient(&redis.Options{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Primary.Port)), MaxRetries: -1})
	defer c.Close()
	for {
		info, err := c.Info(ctx, "replication").Result()
		if err == nil && strings.Contains(info, "connected_slaves:"+strconv.Itoa(len(s.Replicas))) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sentinel: the replicas did not connect: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// URL returns the redis:// URL of the sentinels and the master name, as
// onceflow.NewRedis takes it (a Sentinel-managed primary).
func (s *RedisSentinel) URL() string {
	u := "redis://127.0.0.1:" + strconv.Itoa(s.Sentinels[0].Port) + "?master_name=" + SentinelMaster
	for _, srv := range s.Sentinels[1:] {
		u += "&addr=127.0.0.1:" + strconv.Itoa(srv.Port)
	}
	return u
}

// PrimaryAddr asks the first sentinel that answers which node is primary now.
func (s *RedisSentinel) PrimaryAddr(ctx context.Context) (string, error) {
	var last error
	for _, srv := range s.Sentinels {
		c := redis.NewSentinelClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(srv.Port), MaxRetries: -1})
		addr, err := c.GetMasterAddrByName(ctx, SentinelMaster).Result()
		_ = c.Close()
		if err == nil && len(addr) == 2 {
			return net.JoinHostPort(addr[0], addr[1]), nil
		}
		last = err
	}
	return "", fmt.Errorf("sentinel: no sentinel names the primary: %v", last)
}

// Kill kills every process (SIGKILL).
func (s *RedisSentinel) Kill() {
	for _, srv := range append(append([]*Server{s.Primary}, s.Replicas...), s.Sentinels...) {
		if srv.Running() {
			srv.Kill()
		}
	}
}
