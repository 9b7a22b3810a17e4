// Package cluster runs onceflow's processes (and its fakes) as real subprocesses for the
// demo and the chaos suite: start with an environment, find the address a process
// logged, stop with SIGTERM, crash with SIGKILL, restart. Each process's stderr (its
// JSON log) goes to a file of its own, appended across restarts.
package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Proc is one subprocess. Set the exported fields, then Start; Start again after Stop or
// Kill restarts it with the same command line. Methods are safe for concurrent use.
type Proc struct {
	// Name names the process in logs and its log file (LogDir/Name.log).
	Name string
	// Bin and Args are the command line.
	Bin  string
	Args []string
	// Env is added to a minimal environment (PATH, HOME).
	Env []string
	// LogDir holds the log files. Required.
	LogDir string
	// Dir is the working directory; empty means the caller's.
	Dir string
	// Credential, when set, runs the process as another user (PostgreSQL refuses to
	// run as root).
	Credential *syscall.Credential

	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	offset int64 // log file size when the current run started
	starts int
}

// LogPath returns the process's log file.
func (p *Proc) LogPath() string { return filepath.Join(p.LogDir, p.Name+".log") }

// Start starts the process. It fails if it is already running.
func (p *Proc) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return fmt.Errorf("%s: already running", p.Name)
	}
	// #nosec G301 -- the folder holds a private PostgreSQL's data, which runs as the postgres user when we are root: it must be able to enter it.
	if err := os.MkdirAll(p.LogDir, 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(p.LogPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	cmd := exec.Command(p.Bin, p.Args...) // #nosec G204 -- test and demo harness: the caller names its own server binary and arguments
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir()}, p.Env...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Dir = p.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: p.Credential}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p.cmd, p.done, p.offset = cmd, done, st.Size()
	p.starts++
	return nil
}

// Starts returns how many times the process was started.
func (p *Proc) Starts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.starts
}

// Running reports whether the process runs.
func (p *Proc) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Pid returns the process id of the current run, 0 when not running.
func (p *Proc) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Wait waits up to timeout for the current run to exit on its own and returns its exit
// code; it fails when the process is still running after timeout.
func (p *Proc) Wait(timeout time.Duration) (int, error) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return 0, fmt.Errorf("%s: not started", p.Name)
	}
	select {
	case <-done:
	case <-time.After(timeout):
		return 0, fmt.Errorf("%s still running after %v; see %s", p.Name, timeout, p.LogPath())
	}
	p.mu.Lock()
	p.cmd = nil
	p.mu.Unlock()
	return cmd.ProcessState.ExitCode(), nil
}

// CountLog returns how many JSON lines of the process's log (all runs) have "msg" msg.
func (p *Proc) CountLog(msg string) int {
	f, err := os.Open(p.LogPath())
	if err != nil {
		return 0
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for sc.Scan() {
		var m struct {
			Msg string `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &m) == nil && m.Msg == msg {
			n++
		}
	}
	return n
}

// Stop sends SIGTERM and waits up to timeout for the process to exit, then kills it.
// It returns the exit code (-1 when killed by a signal).
func (p *Proc) Stop(timeout time.Duration) int {
	return p.signal(syscall.SIGTERM, timeout)
}

// Kill sends SIGKILL to the process group (kill -9) and waits for it to be gone.
func (p *Proc) Kill() { p.signal(syscall.SIGKILL, time.Minute) }

// Signal sends sig to the process (not its group) and waits up to timeout for it to
// exit, then kills the group. PostgreSQL's immediate shutdown is Signal(SIGQUIT, ...).
func (p *Proc) Signal(sig syscall.Signal, timeout time.Duration) int { return p.signal(sig, timeout) }

func (p *Proc) signal(sig syscall.Signal, timeout time.Duration) int {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return 0
	}
	var children []int
	if sig == syscall.SIGKILL {
		// PostgreSQL's backends run in process groups of their own (it calls setsid in
		// every child), so a kill of the group misses them: kill each child by pid too,
		// or a restart finds their shared memory still in use.
		children = childrenOf(cmd.Process.Pid)
		for _, pid := range children {
			_ = syscall.Kill(pid, sig)
		}
		_ = syscall.Kill(-cmd.Process.Pid, sig)
	} else {
		_ = cmd.Process.Signal(sig)
	}
	select {
	case <-done:
	case <-time.After(timeout):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
	// Children that outlive their parent (PostgreSQL's backends after a SIGKILL of the
	// postmaster) hold ports and shared memory: wait for the whole group to be gone.
	for i := 0; i < 500 && syscall.Kill(-cmd.Process.Pid, 0) == nil; i++ {
		if i == 100 {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, pid := range children {
		for i := 0; i < 500 && alive(pid); i++ {
			time.Sleep(10 * time.Millisecond)
		}
	}
	p.mu.Lock()
	p.cmd = nil
	p.mu.Unlock()
	return cmd.ProcessState.ExitCode()
}

// WaitLog waits until the current run logs a JSON line whose "msg" is msg and returns
// the line's fields. It fails when ctx ends or the process exits first.
func (p *Proc) WaitLog(ctx context.Context, msg string) (map[string]any, error) {
	p.mu.Lock()
	done, offset := p.done, p.offset
	p.mu.Unlock()
	if done == nil {
		return nil, fmt.Errorf("%s: not started", p.Name)
	}
	for {
		exited := false
		select {
		case <-done:
			exited = true
		default:
		}
		if line, err := findLog(p.LogPath(), offset, msg); err != nil || line != nil {
			return line, err
		}
		if exited {
			return nil, fmt.Errorf("%s exited before logging %q; see %s", p.Name, msg, p.LogPath())
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%s did not log %q: %w; see %s", p.Name, msg, ctx.Err(), p.LogPath())
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// Addr starts nothing: it waits for the log line msg and returns its "addr" field.
func (p *Proc) Addr(ctx context.Context, msg string) (string, error) {
	line, err := p.WaitLog(ctx, msg)
	if err != nil {
		return "", err
	}
	addr, _ := line["addr"].(string)
	if addr == "" {
		return "", fmt.Errorf("%s: log line %q has no addr", p.Name, msg)
	}
	return addr, nil
}

func findLog(path string, offset int64, msg string) (map[string]any, error) {
	f, err := os.Open(path) // #nosec G304 -- the log file this package created (Proc.LogPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil, err
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == msg {
			return m, nil
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, bufio.ErrTooLong) {
		return nil, err
	}
	return nil, nil
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

// statFields returns the fields of /proc/PID/stat after the command name, from the
// state on (field 3 of proc(5) is statFields[0]); nil when unreadable.
func statFields(pid int) []string {
	if pid <= 0 {
		return nil
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	// pid (comm) state ppid ...; comm may contain spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// procStat reads the parent pid and state of pid from /proc/PID/stat.
func procStat(pid int) (ppid int, state byte, ok bool) {
	fields := statFields(pid)
	if len(fields) < 2 {
		return 0, 0, false
	}
	ppid, err := strconv.Atoi(fields[1])
	return ppid, fields[0][0], err == nil
}

// clockTicks is Linux's USER_HZ, the unit of /proc/PID/stat's CPU times (100 on every
// mainstream architecture).
const clockTicks = 100

// CPUTime returns the user plus system CPU time process pid has used so far (0 when
// unknown), for benchmarks that report CPU per request by process.
func CPUTime(pid int) time.Duration {
	f := statFields(pid)
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64) // utime, field 14
	st, _ := strconv.ParseInt(f[12], 10, 64) // stime, field 15
	return time.Duration(ut+st) * time.Second / clockTicks
}

// LoadAvg returns the machine's 1-minute load average (0 when unknown).
func LoadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
