package limitbench

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// TestLimitsBench is `make bench-limits`: the goodput runs (admission configured from
// three tenants and from one, learnt, off) and the fairness run, about 11 minutes on two
// cores. It runs only with ONCEFLOW_LIMITS_BENCH=1 (so `make test` skips it at once);
// LIMITS_BENCH_RUNS (comma-separated names of AllRuns) selects runs. It fails when a
// target is missed or an invariant broken, after printing the whole report;
// the runs' logs stay in the folder it names then, or always with
// LIMITS_BENCH_KEEP_LOGS=1.
func TestLimitsBench(t *testing.T) {
	if os.Getenv("ONCEFLOW_LIMITS_BENCH") != "1" {
		t.Skip("set ONCEFLOW_LIMITS_BENCH=1 to run the admission-control benchmark (make bench-limits)")
	}
	bin := testenv.Binary(t)
	dir, err := os.MkdirTemp("", "onceflow-limitbench-")
	if err != nil {
		t.Fatal(err)
	}
	var runs []string
	if v := os.Getenv("LIMITS_BENCH_RUNS"); v != "" {
		runs = strings.Split(v, ",")
	}
	rep, err := Run(context.Background(), Config{Bin: bin, Dir: dir, DatabaseURL: testenv.DatabaseURL(t), Runs: runs, Log: testWriter{t}})
	if rep != nil {
		t.Log("\n" + rep.String())
	}
	if err != nil {
		t.Fatalf("the benchmark could not complete: %v (logs in %s)", err, dir)
	}
	if rep.Failed() {
		t.Fatalf("targets missed or invariants broken (logs in %s):\n- %s", dir, strings.Join(rep.Violations(), "\n- "))
	}
	if os.Getenv("LIMITS_BENCH_KEEP_LOGS") == "1" {
		t.Logf("logs in %s", dir)
		return
	}
	_ = os.RemoveAll(dir)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// The steady state counts the calls after the first minute over the window from the
// first minute to the last call.
func TestSteady(t *testing.T) {
	t.Parallel()
	s := func(secs ...float64) []time.Duration {
		out := make([]time.Duration, len(secs))
		for i, v := range secs {
			out[i] = time.Duration(v * float64(time.Second))
		}
		return out
	}
	for _, tc := range []struct {
		times []time.Duration
		n     int
		w     time.Duration
	}{
		{s(1, 2, 59), 0, 0},
		{s(1, 60, 61, 70), 2, 10 * time.Second},
		{s(59.9, 60.1, 90), 2, 30 * time.Second},
		{nil, 0, 0},
	} {
		if n, w := steady(tc.times, time.Minute); n != tc.n || w != tc.w {
			t.Errorf("steady(%v) = %d, %v; want %d, %v", tc.times, n, w, tc.n, tc.w)
		}
	}
	// 600 calls a minute for two minutes after a burst: goodput 1.
	var done []time.Duration
	for i := range 600 {
		done = append(done, time.Duration(i)*time.Millisecond)
	}
	for i := 1; i <= 1200; i++ {
		done = append(done, time.Minute+time.Duration(i)*100*time.Millisecond)
	}
	g := &GoodputResult{Done: done, FirstMinute: time.Minute, RPM: 600, Jobs: 1800, Wall: done[len(done)-1]}
	if gp := g.Goodput(); gp < 0.999 || gp > 1.001 {
		t.Errorf("goodput %v, want 1", gp)
	}
	if w := g.IdealWall(); w != 2*time.Minute {
		t.Errorf("ideal wall %v, want 2m", w)
	}
}

// The report says so when a target is missed or an invariant broken, and only then.
func TestViolations(t *testing.T) {
	t.Parallel()
	var done []time.Duration
	for i := 1; i <= 1400; i++ {
		done = append(done, time.Minute+time.Duration(i)*100*time.Millisecond)
	}
	good := func() *GoodputResult {
		return &GoodputResult{Name: RunConfigured, Admission: true, Configured: true, Jobs: 1400, Summarised: 1400, Outbox: 1400,
			Complete: true, Done: done, FirstMinute: time.Minute, RPM: 600, Model: Model{Requests: 1405, OK: 1400, Limited: 5}}
	}
	fair := &FairnessResult{Late: 20, LateDone: 20, Complete: true, Last: 6 * time.Second, FairShare: 4 * time.Second}
	rep := &Report{Goodput: []*GoodputResult{good()}, Fairness: fair}
	if v := rep.Violations(); len(v) != 0 {
		t.Fatalf("violations of a good run: %v", v)
	}
	if !strings.Contains(rep.String(), "Every target met") {
		t.Errorf("report of a good run:\n%s", rep)
	}
	slow := good()
	slow.Done = append(clone(done[:700]), done[len(done)-1]+time.Minute) // half the calls, over twice the window
	many429 := good()
	many429.Model = Model{Requests: 2000, OK: 1400, Limited: 600}
	twice := good()
	twice.Model.OK = 1401
	off := good()
	off.Name, off.Admission, off.Configured, off.Summarised, off.DeadLetters, off.Outbox = RunOff, false, false, 1300, 100, 1300
	off.Model.OK = 1300
	late := *fair
	late.Last = 9 * time.Second
	for _, tc := range []struct {
		rep  *Report
		want string
	}{
		{&Report{Goodput: []*GoodputResult{slow}}, "goodput"},
		{&Report{Goodput: []*GoodputResult{many429}}, "answered 429"},
		{&Report{Goodput: []*GoodputResult{twice}}, "beyond one per summarised job"},
		{&Report{Fairness: &late}, "fair share"},
	} {
		v := tc.rep.Violations()
		if len(v) == 0 || !strings.Contains(strings.Join(v, "\n"), tc.want) {
			t.Errorf("violations %v, want one about %q", v, tc.want)
		}
		if !strings.Contains(tc.rep.String(), "TARGETS MISSED") {
			t.Errorf("the report does not say a target was missed:\n%s", tc.rep)
		}
	}
	if v := (&Report{Goodput: []*GoodputResult{off}}).Violations(); len(v) != 0 {
		t.Errorf("the baseline is held to the invariants only: %v", v)
	}
}

func clone(d []time.Duration) []time.Duration { return append([]time.Duration(nil), d...) }

// Metrics sums series across processes and reads labels with spaces in their values.
func TestMetrics(t *testing.T) {
	t.Parallel()
	m := Metrics{}
	page := `# HELP onceflow_llm_admission_deferred_total x
# TYPE onceflow_llm_admission_deferred_total counter
onceflow_llm_admission_deferred_total{model="gpt-4.1-mini",reason="requests per minute"} 7
onceflow_llm_admission_deferred_total{model="gpt-4.1-mini",reason="fair share"} 2
onceflow_queue_retries_scheduled_total{queue="summaries"} 3
onceflow_queue_dead_lettered_total{queue="summaries",reason="permanent"} 1
`
	for range 2 {
		if err := m.add(strings.NewReader(page)); err != nil {
			t.Fatal(err)
		}
	}
	if got := m.Deferred(); got != "fair share 4, requests per minute 14" {
		t.Errorf("Deferred() = %q", got)
	}
	if got := m.FailedRuns(); got != 8 {
		t.Errorf("FailedRuns() = %v, want 8", got)
	}
	if err := m.add(strings.NewReader("garbage\n")); err == nil {
		t.Error("a malformed sample was accepted")
	}
}

// The texts are 400 to 800 characters and the same for a seed.
func TestTexts(t *testing.T) {
	t.Parallel()
	b := &bench{cfg: Config{Seed: 15}}
	a, c := b.texts(200, 0), b.texts(200, 0)
	for i, s := range a {
		if len(s) < 400 || len(s) > 800 || s != c[i] {
			t.Fatalf("text %d: %d characters, stable %v", i, len(s), s == c[i])
		}
	}
	st := textStats(a)
	if st.MeanEstimate < 1024+100 || st.MeanUsage > st.MeanEstimate {
		t.Errorf("text stats %+v", st)
	}
}
