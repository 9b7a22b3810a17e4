package testenv

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/migrations"
)

// Server is a Redis or PostgreSQL server of one test's own, on a free port (see
// cluster.Server). Stop, Kill and Start may be called in any order; cleanup kills it and
// removes its data. Its methods fail the test on error.
type Server struct {
	t testing.TB
	s *cluster.Server
}

// Port returns the server's TCP port on 127.0.0.1.
func (s *Server) Port() int { return s.s.Port }

// Start starts the server (again) and waits until it answers.
func (s *Server) Start() {
	s.t.Helper()
	if err := s.s.Up(); err != nil {
		s.t.Fatal(err)
	}
}

// Stop shuts the server down cleanly (SIGTERM for Redis, fast mode for PostgreSQL).
func (s *Server) Stop() { s.s.Down() }

// Kill sends SIGKILL, the crash a power cut or the OOM killer would cause.
func (s *Server) Kill() { s.s.Kill() }

// Pause stops (SIGSTOP) a PostgreSQL server (found by its -p port) and its
// backends, the way a hung host or a network partition without resets looks to a
// client: connections stay open and nothing answers. It returns the resume func
// (SIGCONT), also run at cleanup.
func (s *Server) Pause() (resume func()) {
	s.t.Helper()
	want := []byte("\x00-p\x00" + strconv.Itoa(s.Port()) + "\x00")
	proc, err := os.OpenRoot("/proc")
	if err != nil {
		s.t.Fatalf("open /proc: %v", err)
	}
	defer proc.Close()
	var parent int
	dirs, _ := fs.Glob(proc.FS(), "[0-9]*")
	for _, d := range dirs {
		cmd, err := proc.ReadFile(d + "/cmdline")
		if err == nil && bytes.Contains(cmd, want) {
			parent, _ = strconv.Atoi(d)
		}
	}
	if parent == 0 {
		s.t.Fatalf("no server process with -p %d", s.Port())
	}
	pids := []int{parent}
	for _, d := range dirs {
		stat, err := proc.ReadFile(d + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(parent) {
			pid, _ := strconv.Atoi(d)
			pids = append(pids, pid)
		}
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGSTOP)
	}
	var once sync.Once
	resume = func() {
		once.Do(func() {
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGCONT)
			}
		})
	}
	s.t.Cleanup(resume)
	return resume
}

// PrivateRedis starts a redis-server of this test's own on a free port, with AOF on and
// appendfsync always like the dev server, and returns it running. Its URL is
// RedisURLOf(s).
func PrivateRedis(t testing.TB) *Server {
	t.Helper()
	return private(t, "redis", func(dir string) (*cluster.Server, error) { return cluster.NewRedis(dir, "always") })
}

// PrivateRedisCluster starts a Redis Cluster of this test's own on loopback (see
// cluster.NewRedisCluster): primaries primaries with replicas replicas each, AOF on
// with appendfsync always, a node timeout of 2 s; it returns it running and created.
// Cleanup kills every node and removes their data.
func PrivateRedisCluster(t testing.TB, primaries, replicas int) *cluster.RedisCluster {
	t.Helper()
	dir, err := os.MkdirTemp("", "onceflow-redis-cluster-")
	if err != nil {
		t.Fatal(err)
	}
	c, err := cluster.NewRedisCluster(dir, primaries, replicas, "always", 0)
	if err != nil {
		t.Fatalf("private redis cluster: %v (run `make test`, which installs what it needs)", err)
	}
	t.Cleanup(func() { c.Kill(); _ = os.RemoveAll(dir) })
	if err := c.Up(); err != nil {
		t.Fatalf("private redis cluster: %v", err)
	}
	return c
}

// RedisURLOf returns the redis:// URL of a server started by PrivateRedis.
func RedisURLOf(s *Server) string { return s.s.URL }

// PrivatePostgres initialises and starts a PostgreSQL server of this test's own on a free
// port, with a database "onceflow" owned by the superuser "onceflow", and returns it
// running. Its URL is PostgresURLOf(s). initdb takes a second or two.
func PrivatePostgres(t testing.TB) *Server {
	t.Helper()
	return private(t, "postgres", cluster.NewPostgres)
}

// PostgresURLOf returns the postgres:// URL of a server started by PrivatePostgres.
func PostgresURLOf(s *Server) string { return s.s.URL }

func private(t testing.TB, name string, prepare func(dir string) (*cluster.Server, error)) *Server {
	t.Helper()
	// Not t.TempDir(): as root PostgreSQL runs as another user, who cannot enter a 0700
	// folder.
	dir, err := os.MkdirTemp("", "onceflow-"+name+"-")
	if err != nil {
		t.Fatal(err)
	}
	// #nosec G302 -- a private PostgreSQL under it runs as the postgres user, which must enter it
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cs, err := prepare(dir)
	if err != nil {
		t.Fatalf("private %s: %v (run `make test`, which installs what it needs)", name, err)
	}
	s := &Server{t: t, s: cs}
	t.Cleanup(func() { cs.Kill(); _ = os.RemoveAll(dir) })
	s.Start()
	return s
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	p, err := cluster.FreePort()
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	return p
}

// MigratedPrivatePostgres is PrivatePostgres with onceflow's schema applied: it returns
// the server, its URL with params appended ("&connect_timeout=1", or "") and a pool on it,
// closed at cleanup.
func MigratedPrivatePostgres(t testing.TB, params string) (*Server, string, *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := PrivatePostgres(t)
	url := PostgresURLOf(s) + params
	if _, err := migrations.Up(ctx, url, discardLogger()); err != nil {
		t.Fatalf("migrate the private postgres: %v", err)
	}
	pool, err := connect.Postgres(ctx, url, nil)
	if err != nil {
		t.Fatalf("private postgres pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return s, url, pool
}

// MainWithLocalCluster is a TestMain body for the suites that also run on a Redis
// Cluster: with ONCEFLOW_TEST_REDIS_CLUSTER set to "local" (`make test` runs them so a
// second time) it starts a local cluster (3 primaries on loopback), names it in
// ONCEFLOW_TEST_REDIS_CLUSTER for QueueRedis, runs m and removes the cluster; otherwise
// it runs m. It returns m's exit code.
func MainWithLocalCluster(m *testing.M) int {
	if os.Getenv("ONCEFLOW_TEST_REDIS_CLUSTER") != "local" {
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "onceflow-suite-cluster-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	c, err := cluster.NewRedisCluster(dir, 3, 0, "always", 0)
	if err == nil {
		err = c.Up()
	}
	if c != nil {
		defer c.Kill()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "local redis cluster:", err)
		return 1
	}
	if err := os.Setenv("ONCEFLOW_TEST_REDIS_CLUSTER", strings.Join(c.Addrs(), ",")); err != nil {
		fmt.Fprintln(os.Stderr, "local redis cluster:", err)
		return 1
	}
	return m.Run()
}
