package testenv

import (
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Logger returns a logger that writes through t.Log, so a test's log lines show only when
// it fails (or with -v). Lines logged after the test ended are dropped rather than
// panicking the test binary.
func Logger(t testing.TB) *slog.Logger {
	t.Helper()
	w := &tWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct {
	t    testing.TB
	mu   sync.Mutex
	done bool
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done && len(p) > 0 {
		w.t.Log(strings.TrimSuffix(string(p), "\n"))
	}
	return len(p), nil
}

// Writer returns an io.Writer that writes through t.Log (a child process's output, for
// example), dropping what is written after the test ended.
func Writer(t testing.TB) io.Writer {
	t.Helper()
	w := &tWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return w
}
