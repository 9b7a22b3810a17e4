package onceflow_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

// pausePostgres stops (SIGSTOP) the PostgreSQL server listening on port and its
// backends, the way a hung host or a network partition without resets looks to a
// client: connections stay open and nothing answers. It returns the resume func, also
// run at cleanup.
func pausePostgres(t *testing.T, port int) func() {
	t.Helper()
	want := []byte("\x00-p\x00" + strconv.Itoa(port) + "\x00")
	var postmaster int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		cmd, err := os.ReadFile(d + "/cmdline")
		if err == nil && bytes.Contains(cmd, want) && strings.HasSuffix(string(bytes.SplitN(cmd, []byte{0}, 2)[0]), "postgres") {
			postmaster, _ = strconv.Atoi(filepath.Base(d))
		}
	}
	if postmaster == 0 {
		t.Fatalf("no postgres on port %d", port)
	}
	pids := []int{postmaster}
	for _, d := range dirs {
		stat, err := os.ReadFile(d + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(postmaster) {
			pid, _ := strconv.Atoi(filepath.Base(d))
			pids = append(pids, pid)
		}
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGSTOP)
	}
	resume := func() {
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	t.Cleanup(resume)
	return resume
}

// StateHandler promises "503 with Retry-After when a store does not answer", and Route
// bounds its store call (RouteConfig.Timeout, 503 past it); but StateHandler calls
// JobState with the request's context and no bound of its own, and pgx waits on an
// established connection for ever. With PostgreSQL hung (paused, as a hung host or a
// partition looks), a GET of a job's state never answers: each poll holds a goroutine,
// a server connection and one of the pool's connections (which the workers' commits
// share) until the client gives up. It should answer 503 within a bound like Route's.
func TestStateHandlerAnswersWhilePostgresHangs(t *testing.T) {
	t.Parallel()
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "")
	rdb, prefix := testenv.Redis(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, DB: pool, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	tenant := func(*http.Request) (string, error) { return "acme", nil }
	mux := http.NewServeMux()
	mux.Handle("GET /v1/jobs/{job_id}", onceflow.StateHandler(c, tenant))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	hc := &http.Client{Timeout: 30 * time.Second}
	get := func() (int, error) {
		resp, err := hc.Get(srv.URL + "/v1/jobs/job-1")
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if code, err := get(); err != nil || code != http.StatusNotFound {
		t.Fatalf("before the hang: %d %v, want 404", code, err)
	}
	resume := pausePostgres(t, pg.Port())
	code, err := get()
	resume()
	if err != nil || code != http.StatusServiceUnavailable {
		t.Fatalf("GET of a job's state while PostgreSQL hangs: %d %v; want 503 with Retry-After long before the client's 30s", code, err)
	}
}
