package chaos

import (
	"context"
	"flag"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// The short profile runs in `make test`; `make chaos` runs the long one. Flags (after
// -args) or CHAOS_DURATION / CHAOS_SEED set them: go test ./internal/chaos -run TestChaos
// -v -args -duration 5m -seed 42.
var (
	duration = flag.Duration("duration", envDuration("CHAOS_DURATION", 75*time.Second), "load-and-faults phase")
	seed     = flag.Uint64("seed", envUint("CHAOS_SEED", 0), "seed of the jobs and the fault schedule (0: from the clock)")
)

func envDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil && d > 0 {
		return d
	}
	return def
}

func envUint(name string, def uint64) uint64 {
	if n, err := strconv.ParseUint(os.Getenv(name), 10, 64); err == nil {
		return n
	}
	return def
}

// TestChaos kills workers, the relay and the API every 0.5 to 3 s, crashes Redis and
// restarts PostgreSQL in immediate mode, and checks that every accepted job has exactly
// one summary and exactly one email, and that only the poison inputs are dead-lettered.
func TestChaos(t *testing.T) {
	bin := testenv.Binary(t)
	dir, err := os.MkdirTemp("", "onceflow-chaos-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil { // the postgres user must reach its data
		t.Fatal(err)
	}
	rep, err := Run(context.Background(), Config{Bin: bin, Dir: dir, Seed: *seed, Duration: *duration, Log: testWriter{t}})
	if err != nil {
		t.Fatalf("chaos run could not complete: %v (logs in %s)", err, dir)
	}
	t.Log("\n" + rep.String())
	if rep.Accepted < 50 {
		t.Errorf("only %d jobs accepted: the run proves little", rep.Accepted)
	}
	if len(rep.Events) < 4 {
		t.Errorf("only %d fault events", len(rep.Events))
	}
	if rep.Failed() {
		t.Fatalf("invariants violated (seed %d; logs in %s):\n%s", rep.Seed, dir, rep)
	}
	_ = os.RemoveAll(dir)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p[:len(p)-1]))
	return len(p), nil
}
