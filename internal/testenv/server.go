package testenv

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
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Server is a Redis or PostgreSQL server process of one test's own, on a free port.
// Stop, Kill and Start may be called in any order; cleanup kills it and removes its data.
type Server struct {
	t    testing.TB
	name string
	port int
	dir  string
	argv []string
	cred *syscall.Credential
	log  string
	// ready reports whether the server answers.
	ready func(ctx context.Context) error

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd has exited
}

// Port returns the server's TCP port on 127.0.0.1.
func (s *Server) Port() int { return s.port }

// Dir returns the folder holding the server's data and log.
func (s *Server) Dir() string { return s.dir }

// Start starts the server (again) and waits until it answers.
func (s *Server) Start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.t.Fatalf("%s already running", s.name)
	}
	logf, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o666)
	if err != nil {
		s.t.Fatalf("%s log: %v", s.name, err)
	}
	cmd := exec.Command(s.argv[0], s.argv[1:]...)
	cmd.Dir = s.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		s.t.Fatalf("start %s: %v", s.name, err)
	}
	logf.Close()
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.cmd, s.exited = cmd, exited
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := s.ready(ctx)
		cancel()
		if err == nil {
			return
		}
		select {
		case <-exited:
			s.t.Fatalf("%s exited at start; log %s:\n%s", s.name, s.log, tail(s.log))
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s not ready after 30s: %v; log %s:\n%s", s.name, err, s.log, tail(s.log))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop asks the server to shut down cleanly (SIGTERM for Redis, SIGINT, PostgreSQL's
// fast mode, for PostgreSQL) and waits for it to exit.
func (s *Server) Stop() { s.signal(s.stopSignal()) }

// Kill sends SIGKILL, the crash a power cut or the OOM killer would cause, and waits.
func (s *Server) Kill() { s.signal(syscall.SIGKILL) }

func (s *Server) stopSignal() syscall.Signal {
	if s.name == "postgres" {
		return syscall.SIGINT
	}
	return syscall.SIGTERM
}

func (s *Server) signal(sig syscall.Signal) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	// The whole process group: PostgreSQL's children must die with the postmaster. They
	// run in process groups of their own (PostgreSQL calls setsid in every child), so
	// a SIGKILL also goes to each child by pid.
	var children []int
	if sig == syscall.SIGKILL {
		children = childrenOf(s.cmd.Process.Pid)
		for _, pid := range children {
			_ = syscall.Kill(pid, sig)
		}
	}
	_ = syscall.Kill(-s.cmd.Process.Pid, sig)
	deadline := time.Now().Add(30 * time.Second)
	select {
	case <-s.exited:
	case <-time.After(30 * time.Second):
		s.t.Fatalf("%s did not exit on %v", s.name, sig)
	}
	if sig == syscall.SIGKILL {
		// Wait for the orphaned backends to go too, or a restart finds shared memory in use.
		for syscall.Kill(-s.cmd.Process.Pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		for _, pid := range children {
			for alive(pid) && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
	s.cmd = nil
}

// childrenOf returns the pids of parent's children, from /proc (Linux).
func childrenOf(parent int) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, ok := procStat(pid); ok && ppid == parent {
			pids = append(pids, pid)
		}
	}
	return pids
}

// alive reports whether pid still runs (a zombie, which holds no memory, does not).
func alive(pid int) bool {
	_, state, ok := procStat(pid)
	return ok && state != 'Z' && state != 'X'
}

// procStat reads the parent pid and state of pid from /proc/PID/stat.
func procStat(pid int) (ppid int, state byte, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// pid (comm) state ppid ...; comm may contain spaces and parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+4 > len(b) {
		return 0, 0, false
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 2 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(fields[1])
	return ppid, fields[0][0], err == nil
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// serverDir makes a folder for a private server that owner can write, even when the test
// runs as root and t.TempDir() is mode 0700.
func serverDir(t testing.TB, name string, owner *user.User) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "onceflow-"+name+"-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if owner != nil {
		uid, _ := strconv.Atoi(owner.Uid)
		gid, _ := strconv.Atoi(owner.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// LookBinary finds a server binary on PATH or in extra folders (glob patterns), the
// newest folder first.
func LookBinary(name string, globs ...string) (string, error) {
	// Symlinks are kept: Debian's redis-server is a link to redis-check-rdb, which
	// chooses its behaviour by the name it was started as.
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, g := range globs {
		matches, _ := filepath.Glob(g)
		slices.Sort(matches)
		slices.Reverse(matches)
		for _, m := range matches {
			p := filepath.Join(m, name)
			if _, err := os.Stat(p); err == nil {
				return p, nil
			}
		}
	}
	return "", fmt.Errorf("%s not found on PATH or in %s", name, strings.Join(globs, ", "))
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}
