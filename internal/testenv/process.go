package testenv

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildOnce sync.Once
	buildPath string
	buildErr  error
)

// TestTags is the build tag of the test aids in ./cmd/onceflow (`work --test-handler`):
// Binary builds with it, the production build (`make build`) without.
const TestTags = "onceflowtest"

// BinaryEnv names the variable that gives Binary a binary built already: `make test`
// builds ./cmd/onceflow with -tags TestTags before the tests start, so that no test
// package links it while the others run (a link of a few seconds on an idle machine
// took a minute amid the test binaries).
const BinaryEnv = "ONCEFLOW_TEST_BINARY"

// Binary builds ./cmd/onceflow with the test aids (-tags TestTags) once per test binary
// and returns its path, for tests that run real processes (kill -9, signals, concurrent
// migrate). The binary lives in a directory of the checkout's own under the temporary
// directory, shared by every test binary of the checkout: go build leaves an up-to-date
// binary as it is (a fraction of a second, against several of linking it again), and a
// file lock keeps two test binaries from building it at once. With BinaryEnv set, it
// is that file, built by the caller from the same checkout.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		if bin := os.Getenv(BinaryEnv); bin != "" {
			buildPath, buildErr = prebuilt(BinaryEnv, bin)
			return
		}
		root, err := ModuleRoot()
		if err != nil {
			buildErr = err
			return
		}
		buildPath, buildErr = buildShared(root, "onceflow-testbin-", "./cmd/onceflow", TestTags)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildPath
}

// ProductionBinaryEnv names the variable that gives ProductionBinary a binary built
// already, as BinaryEnv does Binary's.
const ProductionBinaryEnv = "ONCEFLOW_TEST_PRODUCTION_BINARY"

// ProductionBinary returns ./cmd/onceflow built as `make build` builds it, without the
// test aids: the file ProductionBinaryEnv names, or else a build of its own in t's
// temporary directory.
func ProductionBinary(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv(ProductionBinaryEnv); bin != "" {
		bin, err := prebuilt(ProductionBinaryEnv, bin)
		if err != nil {
			t.Fatal(err)
		}
		return bin
	}
	root, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "onceflow")
	build := exec.Command("go", "build", "-o", bin, "./cmd/onceflow") // #nosec G204 -- a path of our own
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/onceflow: %v\n%s", err, out)
	}
	return bin
}

// prebuilt returns bin, named by the variable name, once it is sure it is an
// executable file.
func prebuilt(name, bin string) (string, error) {
	st, err := os.Stat(bin) // #nosec G703 -- a test aid's path named by the test run's caller (make test), only checked here
	switch {
	case err != nil:
		return "", fmt.Errorf("%s: %w", name, err)
	case !st.Mode().IsRegular() || st.Mode().Perm()&0o100 == 0:
		return "", fmt.Errorf("%s: %s is not an executable file", name, bin)
	}
	return bin, nil
}

// buildShared builds pkg of the module at root with tags into a directory of the
// checkout's own (prefix and a digest of root, under the temporary directory), holding
// an exclusive lock on a file beside it while it builds, and returns the binary's path.
func buildShared(root, prefix, pkg, tags string) (string, error) {
	sum := sha256.Sum256([]byte(root + "\x00" + pkg + "\x00" + tags))
	dir, err := ownDir(filepath.Join(os.TempDir(), prefix+hex.EncodeToString(sum[:8])))
	if err != nil {
		return "", err
	}
	lock, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o600) // #nosec G304 -- a path of our own under the temporary directory
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil { // #nosec G115 -- a file descriptor
		return "", fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) // #nosec G115 -- a file descriptor
	out := filepath.Join(dir, path.Base(pkg))
	cmd := exec.Command("go", "build", "-tags", tags, "-o", out, pkg) // #nosec G204 -- a path of our own
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build -tags %s %s: %v\n%s", tags, pkg, err, b)
	}
	return out, nil
}

// ownDir returns dir, made (0700) when missing, once it is sure the folder is this
// user's own: a real folder, not a symlink, owned by the effective user, that no one else
// may write. Its name under the shared temporary directory is predictable, so another
// local user could make it first and swap the binary between its build and its run: such
// a folder is an error naming it, never used.
func ownDir(dir string) (string, error) {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", err
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return "", err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir() || fi.Mode()&fs.ModeSymlink != 0:
		return "", fmt.Errorf("%s is not a folder of this user's own (a symlink or a file): remove it", dir)
	case !ok || int(st.Uid) != os.Geteuid():
		return "", fmt.Errorf("%s belongs to another user: remove it", dir)
	case fi.Mode().Perm()&0o022 != 0:
		return "", fmt.Errorf("%s may be written by other users (mode %v): remove it", dir, fi.Mode().Perm())
	}
	return dir, nil
}

// Process is a subprocess of a test, with its stderr (the JSON log) captured.
type Process struct {
	t    testing.TB
	cmd  *exec.Cmd
	done chan struct{}
	err  error // set before done closes

	mu     sync.Mutex
	stderr bytes.Buffer
	stdout bytes.Buffer
	lines  []map[string]any
}

// Start runs bin with args and env (added to a minimal environment) and returns at once.
// The process is killed at cleanup if still running.
func Start(t testing.TB, bin string, env []string, args ...string) *Process {
	t.Helper()
	cmd := exec.Command(bin, args...) // #nosec G204 -- tests run the binary they built, with their own arguments
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir()}, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p := &Process{t: t, cmd: cmd, done: make(chan struct{})}
	errPipe, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = &lockedWriter{mu: &p.mu, w: &p.stdout}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() {
		sc := bufio.NewScanner(errPipe)
		sc.Buffer(make([]byte, 64*1024), 1<<20)
		for sc.Scan() {
			line := sc.Bytes()
			p.mu.Lock()
			p.stderr.Write(line)
			p.stderr.WriteByte('\n')
			var m map[string]any
			if json.Unmarshal(line, &m) == nil {
				p.lines = append(p.lines, m)
			}
			p.mu.Unlock()
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s %s stderr:\n%s", filepath.Base(bin), strings.Join(args, " "), p.Stderr())
		}
	})
	return p
}

// Pid returns the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig to the process.
func (p *Process) Signal(sig syscall.Signal) {
	_ = p.cmd.Process.Signal(sig)
}

// Kill sends SIGKILL (kill -9) and waits for the process to be gone.
func (p *Process) Kill() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// Wait waits up to timeout for the process to exit and returns its exit code, failing the
// test when it does not exit.
func (p *Process) Wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.t.Fatalf("process %d did not exit within %v; stderr:\n%s", p.Pid(), timeout, p.Stderr())
	}
	return p.cmd.ProcessState.ExitCode()
}

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stderr returns everything the process wrote to stderr so far.
func (p *Process) Stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

// Stdout returns everything the process wrote to stdout so far.
func (p *Process) Stdout() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stdout.String()
}

// Logs returns the JSON lines the process logged so far whose "msg" is msg, in order.
func (p *Process) Logs(msg string) []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []map[string]any
	for _, l := range p.lines {
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// WaitLog waits until the process logs a JSON line whose "msg" is msg and returns it.
func (p *Process) WaitLog(ctx context.Context, msg string) map[string]any {
	p.t.Helper()
	exited := false
	for {
		p.mu.Lock()
		for _, l := range p.lines {
			if l["msg"] == msg {
				p.mu.Unlock()
				return l
			}
		}
		p.mu.Unlock()
		if exited {
			p.t.Fatalf("process exited before logging %q; stderr:\n%s", msg, p.Stderr())
		}
		select {
		case <-ctx.Done():
			p.t.Fatalf("no log line %q: %v; stderr:\n%s", msg, ctx.Err(), p.Stderr())
		case <-p.done:
			exited = true // look once more: the last lines arrive before done closes
		case <-time.After(20 * time.Millisecond):
		}
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// ModuleRoot returns the directory of the onceflow module the test builds against: the
// checkout, for the root module's tests and the lab's (which replaces the module with
// it). It asks the go command from the test's directory, so it holds under -trimpath,
// where source file names are not the checkout's.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/onceflow/onceflow").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("go list -m github.com/onceflow/onceflow: %w: %s", err, ee.Stderr)
		}
		return "", fmt.Errorf("go list -m github.com/onceflow/onceflow: %w", err)
	}
	root := strings.TrimSpace(string(out))
	if root == "" {
		return "", errors.New("go list -m github.com/onceflow/onceflow: no directory (is the module replaced by a checkout?)")
	}
	return root, nil
}
