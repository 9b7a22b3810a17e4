package onceflowtest

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

var builds sync.Map // package path -> *build

type build struct {
	once sync.Once
	path string
	err  error
}

// Build compiles the main package pkg ("." for the package under test, as Go's
// command line names packages, relative to the test's directory) once per test binary
// and returns the executable's path, for a test that runs it as a real process (to
// kill it with SIGKILL).
func Build(t testing.TB, pkg string) string {
	t.Helper()
	v, _ := builds.LoadOrStore(pkg, &build{})
	b := v.(*build)
	b.once.Do(func() {
		dir, err := testenv.BinDir("onceflowtest-bin-")
		if err != nil {
			b.err = err
			return
		}
		b.path = filepath.Join(dir, "app")
		cmd := exec.Command("go", "build", "-o", b.path, pkg) // #nosec G204 -- the test's own package, into a temporary path
		if out, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// Process is a program a test runs, with its stderr (a JSON log, one object a line)
// captured.
type Process struct {
	p *testenv.Process
}

// Start runs bin with args, its environment only PATH, HOME and env ("NAME=value"),
// and returns at once. It is killed at cleanup if still running; when the test failed
// its stderr is logged.
func Start(t testing.TB, bin string, env []string, args ...string) *Process {
	t.Helper()
	return &Process{p: testenv.Start(t, bin, env, args...)}
}

// Kill sends SIGKILL (kill -9) to the process and its children and waits until it is
// gone: the crash a power cut or the OOM killer causes, with no deferred code run.
func (p *Process) Kill() { p.p.Kill() }

// Signal sends sig (syscall.SIGTERM for a graceful stop).
func (p *Process) Signal(sig syscall.Signal) { p.p.Signal(sig) }

// Wait waits up to timeout for the process to exit and returns its exit code, failing
// the test when it does not.
func (p *Process) Wait(timeout time.Duration) int { return p.p.Wait(timeout) }

// WaitLog waits until the process logs a JSON line whose "msg" is msg and returns the
// line, failing the test when ctx ends or the process exits first.
func (p *Process) WaitLog(ctx context.Context, msg string) map[string]any {
	return p.p.WaitLog(ctx, msg)
}

// Stderr returns what the process wrote to stderr so far.
func (p *Process) Stderr() string { return p.p.Stderr() }

// RedisServer is a redis-server of one test's own, for tests that stop or pause it
// (the shared test Redis must not be paused under other tests).
type RedisServer struct {
	// URL is its redis:// URL.
	URL string
	// Client is a client of it (onceflow's settings), closed at cleanup.
	Client *redis.Client

	s *testenv.Server
}

// PrivateRedis starts a redis-server (found on PATH) of this test's own on a free port,
// killed and removed at cleanup.
func PrivateRedis(t testing.TB) *RedisServer {
	t.Helper()
	s := testenv.PrivateRedis(t)
	url := testenv.RedisURLOf(s)
	c, err := onceflow.NewRedis(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return &RedisServer{URL: url, Client: c, s: s}
}

// PauseWrites makes the server hold every write command (CLIENT PAUSE WRITE) until
// the returned func is called (or the test ends): a worker that committed its job to
// PostgreSQL then blocks on its acknowledgement, for a test to kill it between the two.
func (r *RedisServer) PauseWrites(t testing.TB) (resume func()) {
	t.Helper()
	ctx := context.Background()
	if err := r.Client.Do(ctx, "CLIENT", "PAUSE", "120000", "WRITE").Err(); err != nil {
		t.Fatalf("CLIENT PAUSE: %v", err)
	}
	var once sync.Once
	resume = func() {
		once.Do(func() {
			if err := r.Client.Do(ctx, "CLIENT", "UNPAUSE").Err(); err != nil {
				t.Errorf("CLIENT UNPAUSE: %v", err)
			}
		})
	}
	t.Cleanup(resume)
	return resume
}

// Stdout returns what the process wrote to stdout so far.
func (p *Process) Stdout() string { return p.p.Stdout() }
