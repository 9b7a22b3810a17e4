package testenv

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// BinDir makes a temporary directory for executables a test binary builds once and
// shares among its tests: a sync.Once outlives every test, so no t.Cleanup can remove
// it. Its name carries the process id ("<prefix><pid>-<random>") and each call first
// removes the directories of that prefix whose process has exited, so a run of the
// whole suite leaves at most the directories of the test binaries still running.
func BinDir(prefix string) (string, error) {
	sweepBinDirs(prefix)
	return os.MkdirTemp("", prefix+strconv.Itoa(os.Getpid())+"-")
}

// sweepBinDirs removes the directories prefix<pid>-* of processes that no longer run.
// A directory of another layout (no pid) is left alone.
func sweepBinDirs(prefix string) {
	matches, _ := filepath.Glob(filepath.Join(os.TempDir(), prefix+"*"))
	for _, m := range matches {
		rest := strings.TrimPrefix(filepath.Base(m), prefix)
		pidText, _, ok := strings.Cut(rest, "-")
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if processRuns(pid) {
			continue
		}
		_ = os.RemoveAll(m)
	}
}

// processRuns reports whether a process with this id exists (signal 0 probes it;
// EPERM means it exists but belongs to someone else).
func processRuns(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
