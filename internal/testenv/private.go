package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// PrivateRedis starts a redis-server of this test's own on a free port, with AOF on and
// appendfsync always like the dev server, and returns it running. Its URL is
// RedisURLOf(s).
func PrivateRedis(t testing.TB) *Server {
	t.Helper()
	bin, err := LookBinary("redis-server")
	if err != nil {
		t.Fatalf("%v: run `make test`, which installs it", err)
	}
	dir := serverDir(t, "redis", nil)
	port := FreePort(t)
	s := &Server{
		t: t, name: "redis", port: port, dir: dir, log: filepath.Join(dir, "redis.log"),
		argv: []string{bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
			"--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"},
	}
	s.ready = func(ctx context.Context) error {
		c := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), MaxRetries: -1})
		defer c.Close()
		return c.Ping(ctx).Err()
	}
	t.Cleanup(func() { s.Kill(); _ = os.RemoveAll(dir) })
	s.Start()
	return s
}

// RedisURLOf returns the redis:// URL of a server started by PrivateRedis.
func RedisURLOf(s *Server) string { return fmt.Sprintf("redis://127.0.0.1:%d/0", s.port) }

// PrivatePostgres initialises and starts a PostgreSQL server of this test's own on a free
// port, with a database "onceflow" owned by the superuser "onceflow", and returns it
// running. Its URL is PostgresURLOf(s). As root it runs as the "postgres" user, since
// PostgreSQL refuses to run as root. initdb takes a second or two.
func PrivatePostgres(t testing.TB) *Server {
	t.Helper()
	globs := []string{"/usr/lib/postgresql/*/bin"}
	initdb, err := LookBinary("initdb", globs...)
	if err != nil {
		t.Fatal(err)
	}
	real, err := filepath.EvalSymlinks(initdb) // /usr/local/bin/initdb may link into the bin folder
	if err != nil {
		t.Fatal(err)
	}
	bindir := filepath.Dir(real)
	var owner *user.User
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		if owner, err = user.Lookup("postgres"); err != nil {
			t.Fatalf("running as root needs a postgres user to run PostgreSQL: %v", err)
		}
		uid, _ := strconv.Atoi(owner.Uid)
		gid, _ := strconv.Atoi(owner.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	dir := serverDir(t, "postgres", owner)
	data := filepath.Join(dir, "data")
	init := exec.Command(initdb, "-D", data, "-U", "onceflow", "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync")
	init.Dir = dir
	init.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := init.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	port := FreePort(t)
	s := &Server{
		t: t, name: "postgres", port: port, dir: dir, cred: cred, log: filepath.Join(dir, "postgres.log"),
		argv: []string{filepath.Join(bindir, "postgres"), "-D", data, "-p", strconv.Itoa(port),
			"-k", dir, "-c", "listen_addresses=127.0.0.1"},
	}
	admin := fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=1", port)
	s.ready = func(ctx context.Context) error {
		c, err := pgx.Connect(ctx, admin)
		if err != nil {
			return err
		}
		return c.Close(ctx)
	}
	t.Cleanup(func() { s.Kill(); _ = os.RemoveAll(dir) })
	s.Start()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, "CREATE DATABASE onceflow"); err != nil {
		t.Fatalf("create database: %v", err)
	}
	return s
}

// PostgresURLOf returns the postgres:// URL of a server started by PrivatePostgres.
func PostgresURLOf(s *Server) string {
	return fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/onceflow?sslmode=disable", s.port)
}
