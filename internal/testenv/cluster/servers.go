package cluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
)

// Server is a Redis or PostgreSQL server process of one's own, on a free port, for tests
// and the chaos suite that stop, crash and restart it. Up starts it and waits until it
// answers; Down stops it cleanly; Kill crashes it (SIGKILL); Crash is PostgreSQL's
// immediate shutdown (SIGQUIT: no checkpoint, WAL replay at the next start).
type Server struct {
	*Proc
	// Port is the TCP port on 127.0.0.1.
	Port int
	// URL is the server's redis:// or postgres:// URL (the onceflow database).
	URL string

	stopSig syscall.Signal
	timeout time.Duration
	ready   func(ctx context.Context) error
}

// Up starts the server and waits until it answers (after a crash Redis first replays its
// AOF and PostgreSQL its WAL).
func (s *Server) Up() error {
	if err := s.Start(); err != nil {
		return err
	}
	deadline := time.Now().Add(s.timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := s.ready(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if !s.Running() {
			return fmt.Errorf("%s exited at start; see %s", s.Name, s.LogPath())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v: %v; see %s", s.Name, s.timeout, err, s.LogPath())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Down stops the server cleanly (SIGTERM for Redis; SIGINT, the fast mode, for
// PostgreSQL, which would otherwise wait for its clients to leave).
func (s *Server) Down() { s.Signal(s.stopSig, 60*time.Second) }

// Crash shuts the server down the hardest way it survives by design: PostgreSQL's
// immediate mode (SIGQUIT), or SIGKILL for Redis.
func (s *Server) Crash() {
	if s.stopSig == syscall.SIGINT {
		s.Signal(syscall.SIGQUIT, 60*time.Second)
		return
	}
	s.Kill()
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	ports, err := FreePorts(1)
	if err != nil {
		return 0, err
	}
	return ports[0], nil
}

// FreePorts returns n distinct TCP ports on 127.0.0.1 that were free a moment ago: each
// is held until all are found, so that two calls of FreePort in a row cannot return the
// same port (the kernel may hand a port just closed out again).
func FreePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// NewRedis prepares (does not start) a redis-server on a free port with its data in
// dir/redis: AOF on with the given appendfsync ("always", "everysec", "no"), no RDB
// snapshots. Call Up to start it.
func NewRedis(dir, appendfsync string) (*Server, error) {
	// The name redis-server is kept: Debian's is a symlink to redis-check-rdb, which
	// chooses its behaviour by the name it was started as.
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not found: run scripts/dev-services up, which installs it")
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	return newRedisOn(bin, dir, appendfsync, port)
}

// newRedisOn prepares a redis-server (bin) on port, as NewRedis does.
func newRedisOn(bin, dir, appendfsync string, port int) (*Server, error) {
	data := filepath.Join(dir, "redis")
	if err := os.MkdirAll(data, 0o750); err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	return &Server{
		Proc: &Proc{Name: "redis-server", Bin: bin, LogDir: dir, Args: []string{
			"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", data,
			"--appendonly", "yes", "--appendfsync", appendfsync, "--save", "", "--daemonize", "no",
		}},
		Port: port, URL: "redis://" + addr + "/0", stopSig: syscall.SIGTERM, timeout: 30 * time.Second,
		ready: func(ctx context.Context) error {
			c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
			defer c.Close()
			return c.Ping(ctx).Err()
		},
	}, nil
}

// NewPostgres initialises (a copy of initdbTemplate) and prepares, without starting, a
// PostgreSQL server on a free port with its data under dir/pg, a superuser "onceflow" and,
// once Up, a database "onceflow". As root it runs as the "postgres" user, since PostgreSQL
// refuses to run as root: dir must then be reachable by that user (not inside a 0700
// folder).
func NewPostgres(dir string) (*Server, error) {
	initdb, err := LookPostgres("initdb")
	if err != nil {
		return nil, err
	}
	var cred *syscall.Credential
	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs a postgres user to run PostgreSQL: %w", err)
		}
		uid, err = strconv.Atoi(u.Uid)
		if err != nil || uid < 0 || uid > math.MaxUint32 {
			return nil, fmt.Errorf("postgres user: uid %q", u.Uid)
		}
		gid, err = strconv.Atoi(u.Gid)
		if err != nil || gid < 0 || gid > math.MaxUint32 {
			return nil, fmt.Errorf("postgres user: gid %q", u.Gid)
		}
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)} // #nosec G115 -- both checked just above
	}
	home := filepath.Join(dir, "pg")
	// #nosec G301 -- handed to the postgres user right below (Chown); its parent must stay enterable
	if err := os.MkdirAll(home, 0o755); err != nil {
		return nil, err
	}
	if uid >= 0 {
		if err := os.Chown(home, uid, gid); err != nil {
			return nil, err
		}
	}
	data := filepath.Join(home, "data")
	template, err := initdbTemplate(initdb, cred)
	if err != nil {
		return nil, err
	}
	// #nosec G204 -- cp with this package's own paths
	if out, err := exec.Command("cp", "-a", template, data).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("copy the initdb template: %v\n%s", err, out)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	admin := fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", port)
	s := &Server{
		Proc: &Proc{Name: "postgres", Bin: filepath.Join(filepath.Dir(initdb), "postgres"), LogDir: dir,
			Dir: "/", Credential: cred, Args: []string{"-D", data, "-p", strconv.Itoa(port), "-k", home,
				"-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200"}},
		Port: port, URL: fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/onceflow?sslmode=disable", port),
		stopSig: syscall.SIGINT, timeout: 60 * time.Second,
	}
	created := false
	s.ready = func(ctx context.Context) error {
		c, err := pgx.Connect(ctx, admin)
		if err != nil {
			return err
		}
		defer c.Close(ctx)
		if !created {
			// A probe's context may end while the server is still creating the database (a
			// loaded machine takes over the probe's second): the next probe then finds it made.
			var pgErr *pgconn.PgError
			if _, err := c.Exec(ctx, "CREATE DATABASE onceflow"); err != nil &&
				!(errors.As(err, &pgErr) && pgErr.Code == "42P04" /* duplicate_database */) {
				return err
			}
			created = true
		}
		return nil
	}
	return s, nil
}

// initdbArgs are initdb's arguments but the data directory.
var initdbArgs = []string{"-U", "onceflow", "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"}

// initdbTemplate returns a data directory initdb made with initdbArgs, run as cred, for
// NewPostgres to copy (a copy takes a tenth of initdb's second or two). It is made once
// per machine, in the temporary directory under a name that digests the binary (path,
// size, time), the user and the arguments, and renamed into place when complete, so
// concurrent test processes share it and a killed one leaves no half-made template.
//
// The template's name is predictable, so another local user could make it first with a
// configuration of their own (an archive_command, say) for the server to run: a template
// that is not a real folder owned by the user PostgreSQL runs as, closed to everyone
// else, is an error naming it.
func initdbTemplate(initdb string, cred *syscall.Credential) (string, error) {
	dir, err := templatePath(initdb, cred)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err == nil {
		return dir, ownTemplate(dir, cred)
	}
	tmp, err := os.MkdirTemp(os.TempDir(), "onceflow-initdb-new-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if cred != nil {
		if err := os.Chown(tmp, int(cred.Uid), int(cred.Gid)); err != nil {
			return "", err
		}
	}
	made := filepath.Join(tmp, "data")
	// #nosec G204 -- initdb found by LookPostgres, with this package's own arguments
	init := exec.Command(initdb, append([]string{"-D", made}, initdbArgs...)...)
	init.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	init.Dir = "/"
	if out, err := init.CombinedOutput(); err != nil {
		return "", fmt.Errorf("initdb: %v\n%s", err, out)
	}
	if err := os.Rename(made, dir); err != nil {
		if _, serr := os.Stat(filepath.Join(dir, "PG_VERSION")); serr == nil {
			return dir, ownTemplate(dir, cred) // another process made it first
		}
		return "", fmt.Errorf("keep the initdb template: %w", err)
	}
	return dir, nil
}

// templatePath returns the name of the initdb template of initdb run as cred: under the
// temporary directory, a digest of the binary (path, size, time), the user and
// initdbArgs.
func templatePath(initdb string, cred *syscall.Credential) (string, error) {
	st, err := os.Stat(initdb)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s %d %d %v %v", initdb, st.Size(), st.ModTime().UnixNano(), cred, initdbArgs)
	return filepath.Join(os.TempDir(), "onceflow-initdb-"+hex.EncodeToString(h.Sum(nil))[:16]), nil
}

// ownTemplate returns nil when dir is a real folder (not a symlink) owned by the user
// PostgreSQL runs as (cred's, else this process's), that no other user may enter.
func ownTemplate(dir string, cred *syscall.Credential) error {
	uid := os.Geteuid()
	if cred != nil {
		uid = int(cred.Uid)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.IsDir() || !ok || int(st.Uid) != uid || fi.Mode().Perm()&0o077 != 0 {
		return fmt.Errorf("the initdb template %s is not a private folder of uid %d (mode %v): remove it", dir, uid, fi.Mode())
	}
	return nil
}

// LookPostgres finds a PostgreSQL binary: in /usr/lib/postgresql/*/bin (Debian's layout,
// newest version first), else on PATH, resolving a symlink into the real bin folder (which
// holds the other server binaries) unless it leads to a wrapper of another name (Debian's
// pg_wrapper, which chooses what to run by the name it was called as).
func LookPostgres(name string) (string, error) {
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	slices.SortFunc(matches, func(a, b string) int { return versionOf(a) - versionOf(b) })
	if len(matches) > 0 {
		return matches[len(matches)-1], nil
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%s not found in /usr/lib/postgresql/*/bin or on PATH", name)
	}
	if r, err := filepath.EvalSymlinks(p); err == nil && filepath.Base(r) == name {
		return r, nil
	}
	return p, nil
}

// versionOf reads the major version from /usr/lib/postgresql/VERSION/bin/NAME.
func versionOf(path string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(path))))
	return v
}
