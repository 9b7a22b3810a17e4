package chaos

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/cluster"
)

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// redisServer is the run's own redis-server: AOF on, appendfsync always, so a kill -9
// loses nothing that was acknowledged.
type redisServer struct {
	*cluster.Proc
	port int
}

func startRedis(dir string) (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not found: run scripts/dev-services up, which installs it")
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	data := filepath.Join(dir, "redis")
	if err := os.MkdirAll(data, 0o755); err != nil {
		return nil, err
	}
	s := &redisServer{port: port, Proc: &cluster.Proc{Name: "redis-server", Bin: bin, LogDir: dir, Args: []string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", data,
		"--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
	}}}
	return s, s.start()
}

func (s *redisServer) url() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", s.port) }

// start starts the server and waits until it answers PING (after a crash it first
// replays its AOF).
func (s *redisServer) start() error {
	if err := s.Start(); err != nil {
		return err
	}
	c := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", s.port), MaxRetries: -1})
	defer c.Close()
	return waitFor(30*time.Second, s.Proc, func(ctx context.Context) error { return c.Ping(ctx).Err() })
}

// pgServer is the run's own PostgreSQL, so that it can be restarted in immediate mode
// (a crash: no checkpoint, WAL replay at start) without touching anyone else's.
type pgServer struct {
	*cluster.Proc
	port int
}

func startPostgres(dir string) (*pgServer, error) {
	initdb, err := lookPG("initdb")
	if err != nil {
		return nil, err
	}
	bindir := filepath.Dir(initdb)
	var cred *syscall.Credential
	var uid, gid int = -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs a postgres user to run PostgreSQL: %w", err)
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	home := filepath.Join(dir, "pg")
	if err := os.MkdirAll(home, 0o755); err != nil {
		return nil, err
	}
	if uid >= 0 {
		if err := os.Chown(home, uid, gid); err != nil {
			return nil, err
		}
	}
	data := filepath.Join(home, "data")
	init := exec.Command(initdb, "-D", data, "-U", "onceflow", "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8")
	init.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	init.Dir = "/"
	if out, err := init.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb: %v\n%s", err, out)
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &pgServer{port: port, Proc: &cluster.Proc{Name: "postgres", Bin: filepath.Join(bindir, "postgres"), LogDir: dir,
		Dir: "/", Credential: cred, Args: []string{"-D", data, "-p", strconv.Itoa(port), "-k", home,
			"-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200"}}}
	if err := s.start(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, s.admin())
	if err != nil {
		return nil, err
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, "CREATE DATABASE onceflow"); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *pgServer) admin() string {
	return fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", s.port)
}

func (s *pgServer) url() string {
	return fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/onceflow?sslmode=disable", s.port)
}

// start starts the server and waits until it accepts connections (after an immediate
// shutdown it first replays its WAL).
func (s *pgServer) start() error {
	if err := s.Start(); err != nil {
		return err
	}
	return waitFor(60*time.Second, s.Proc, func(ctx context.Context) error {
		c, err := pgx.Connect(ctx, s.admin())
		if err != nil {
			return err
		}
		return c.Close(ctx)
	})
}

// lookPG finds a PostgreSQL server binary on PATH (resolving symlinks into the real bin
// folder) or in /usr/lib/postgresql/*/bin, newest first.
func lookPG(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return filepath.EvalSymlinks(p)
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	slices.Sort(matches)
	if len(matches) == 0 {
		return "", fmt.Errorf("%s not found on PATH or in /usr/lib/postgresql/*/bin", name)
	}
	return matches[len(matches)-1], nil
}

// waitFor polls ready until it succeeds, the process exits or timeout passes.
func waitFor(timeout time.Duration, p *cluster.Proc, ready func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := ready(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if !p.Running() {
			return fmt.Errorf("%s exited at start; see %s", p.Name, p.LogPath())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v: %v; see %s", p.Name, timeout, err, p.LogPath())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
